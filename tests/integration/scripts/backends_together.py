"""One process, three faces: gloo as torch.distributed's default group, an "mpidp" group beside
it, and mpidp.torch's own DistributedOptimizer, all on one mpidp engine and world."""

import os
import sys

import torch
import torch.distributed as dist
from mpi4py import MPI

import mpidp
import mpidp.distributed  # noqa: F401  (registers backend "mpidp")
import mpidp.torch as hvd

comm = MPI.COMM_WORLD
hvd.init()
port = comm.bcast(29600 + os.getpid() % 300 if comm.rank == 0 else None, root=0)
os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
ours = dist.new_group(backend="mpidp")
r, n = dist.get_rank(), dist.get_world_size()

t_gloo, t_ours = torch.full((4,), float(r)), torch.full((4,), float(r))
dist.all_reduce(t_gloo)
dist.all_reduce(t_ours, group=ours)
expected = float(sum(range(n)))

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
)
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2), process_group=ours)
x = torch.randn(8, 4, generator=torch.Generator().manual_seed(r))
model(x).sum().backward()
opt.step()
ddp(x).sum().backward()
grads = [p.grad.clone() for p in ddp.parameters()]
for g in grads:
    dist.all_reduce(g, group=ours, op=dist.ReduceOp.MAX)
same_ddp = all(torch.allclose(g, p.grad) for g, p in zip(grads, ddp.parameters()))
weights = hvd.allgather(model.weight.detach()[None])
same_hvd = all(torch.equal(weights[0], w) for w in weights)

ok = (
    t_gloo.tolist() == [expected] * 4
    and t_ours.tolist() == [expected] * 4
    and same_ddp
    and same_hvd
    and mpidp.size() == n
)
print(
    f"rank {r}: gloo {t_gloo[0].item()} mpidp group {t_ours[0].item()} ddp-equal {same_ddp} "
    f"hvd-equal {same_hvd} ok {ok}",
    flush=True,
)
dist.destroy_process_group(ours)
dist.destroy_process_group()
hvd.shutdown()
sys.exit(0 if ok else 1)
