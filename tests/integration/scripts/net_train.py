"""Train for a number of steps across hosts, for faults of the network (test_network_faults.py).

Usage: net_train.py STEPS OUT [--ckpt PATH --every K] [--resume] [--pause S] [--width W]

Deterministic: the same seed on every rank, each step's batch drawn from a generator seeded by
(rank, step), SGD with momentum. Every rank prints "rank R: step S done" after each step; with
--ckpt, a checkpoint (model, optimizer, step) every K steps ("rank R: saved at step S"); --resume
starts after the checkpoint's step. Rank 0 writes the final parameters to OUT after every rank
has checked that the replicas agree; every rank then prints "rank R: finished".
"""

import argparse
import time

import torch

import mpidp
from mpidp import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("steps", type=int)
parser.add_argument("out")
parser.add_argument("--ckpt")
parser.add_argument("--every", type=int, default=5)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--pause", type=float, default=0.0, help="seconds to sleep after each step")
parser.add_argument("--width", type=int, default=256, help="hidden width (gradient size)")
args = parser.parse_args()

mpidp.init()
rank = mpidp.rank()
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(64, args.width),
    torch.nn.ReLU(),
    torch.nn.Linear(args.width, args.width),
    torch.nn.ReLU(),
    torch.nn.Linear(args.width, 4),
)
opt = mpidp.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
    named_parameters=model.named_parameters(),
)
mpidp.broadcast_parameters(model.state_dict(), root_rank=0)
done = 0
if args.resume:
    done = checkpoint.load(args.ckpt, model=model, optimizer=opt)["step"]
    print(f"rank {rank}: resumed at step {done}", flush=True)
while done < args.steps:
    data = torch.Generator().manual_seed(1000 * rank + done)
    x = torch.randn(32, 64, generator=data)
    y = torch.randn(32, 4, generator=data)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    done += 1
    print(f"rank {rank}: step {done} done at {time.time():.3f}", flush=True)
    if args.ckpt and not args.resume and done % args.every == 0:
        checkpoint.save(args.ckpt, model=model, optimizer=opt, step=done)
        print(f"rank {rank}: saved at step {done}", flush=True)
    if args.pause:
        time.sleep(args.pause)
mpidp.check_replicas(model)
if rank == 0:
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
print(f"rank {rank}: finished", flush=True)
