"""FSDP2 (fully_shard) over backend "mpidp" against one process: argv[1] steps of SGD with
momentum, each rank on its slice of a global batch of 48, while every rank also trains an
unsharded copy on the whole batch. Rank 0 prints the largest difference of the parameters and
how far training moved them; the job exits 1 if they differ by more than 1e-5 or barely moved
(equal only because nothing happened)."""

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import mpidp.distributed  # noqa: F401

BATCH = 48  # divides evenly over 1, 2, 3 and 4 ranks: every rank's mean weighs the same
TOLERANCE = 1e-5

steps = int(sys.argv[1])
dist.init_process_group("mpidp")
rank, size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
one = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
start = copy.deepcopy(one)
sharded = copy.deepcopy(one)
for layer in sharded:
    if isinstance(layer, nn.Linear):
        fully_shard(layer)
fully_shard(sharded)
opt_one = torch.optim.SGD(one.parameters(), lr=0.1, momentum=0.9)
opt_sharded = torch.optim.SGD(sharded.parameters(), lr=0.1, momentum=0.9)

data = torch.Generator().manual_seed(1)
per_rank = BATCH // size
for _ in range(steps):
    x = torch.randn(BATCH, 64, generator=data)
    y = torch.randint(0, 10, (BATCH,), generator=data)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for model, opt, xs, ys in ((one, opt_one, x, y), (sharded, opt_sharded, x[mine], y[mine])):
        opt.zero_grad()
        F.cross_entropy(model(xs), ys).backward()
        opt.step()

diff = max(
    (p.full_tensor() - q).abs().max().item() for p, q in zip(sharded.parameters(), one.parameters())
)
moved = max((q - p0).abs().max().item() for q, p0 in zip(one.parameters(), start.parameters()))
dist.destroy_process_group()
if rank == 0:
    print(
        f"fsdp2 vs one process after {steps} steps: max |diff| {diff:.3g}, moved {moved:.3g} "
        f"on {size} rank(s)",
        flush=True,
    )
sys.exit(0 if diff <= TOLERANCE and moved > 1000 * TOLERANCE else 1)
