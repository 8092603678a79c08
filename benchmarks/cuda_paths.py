"""One data path for device tensors, side by side with DDP and no communication, in one job.

    MPIDP_BACKEND=mpi|gloo|nccl mpiexec -n 2 python benchmarks/cuda_paths.py [--device cuda]
        [--rounds 5] [--steps 5] [--json out.json]

The path mpidp takes is the launch's MPIDP_BACKEND (docs/data_paths.md: mpi = CUDA-aware MPI or
staged through pinned host memory, gloo = staged to gloo, nccl = NCCL); tests/gpu_check.py
launches this once per path and puts the rows into one table. Contenders, in rotating order on
copies of one ResNet-18 (benchmarks/models.py, batch 16 of 32x32 per rank):
  no communication     forward, backward, SGD step
  mpidp                the same with mpidp.DistributedOptimizer
  DDP                  torch DistributedDataParallel over NCCL when every rank of the host has a
                       GPU of its own (NCCL refuses two ranks on one device), else over gloo
and the ResNet-18 gradient set (62 tensors, 46.8 MB) reduced as one grouped_allreduce_, beside
its staged floor: the same set concatenated on the device, copied to pinned host memory, reduced
by one blocking MPI_Allreduce there and copied back, by hand (what a staged path cannot beat).
--device cpu runs the same job on host tensors (the CPU twin that CI runs).
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
from rounds import order as rounds_order  # noqa: E402

import mpidp  # noqa: E402
from mpidp.runtime import world  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pick_device(kind):
    if kind == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", mpidp.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def ddp_backend(comm, device):
    """nccl where every rank of each host has its own GPU, else gloo; the same on every rank."""
    own_gpu = device.type == "cuda" and torch.cuda.device_count() >= mpidp.local_size()
    return "nccl" if all(comm.allgather(own_gpu)) else "gloo"


def setup_dist(comm, backend):
    port = comm.bcast(29500 + os.getpid() % 1000 if comm.rank == 0 else None, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=comm.rank, world_size=comm.size)


def timed_steps(model, opt, x, y, steps, device):
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def timed_allreduce(grads, device, reps):
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        mpidp.grouped_allreduce_(grads, name="cuda_paths.grads")
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def timed_floor(grads, device, comm, reps):
    """The staged floor: device cat, copy to pinned host memory, MPI_Allreduce, copy back."""
    pinned = torch.empty(
        sum(g.numel() for g in grads), dtype=grads[0].dtype, pin_memory=device.type == "cuda"
    )
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        pinned.copy_(torch.cat([g.reshape(-1) for g in grads]))
        comm.Allreduce(MPI.IN_PLACE, pinned.numpy(), op=MPI.SUM)
        pinned.to(device)
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("cuda_paths.py --device cuda: torch sees no GPU here")
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    mpidp.init()
    device = pick_device(args.device)
    path = world.state().engine.backend.names.get(device.type, "?")
    backend = ddp_backend(comm, device)
    setup_dist(comm, backend)

    torch.manual_seed(0)
    base = models.ResNet18().to(device)
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(16, 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 1000, (16,), generator=g).to(device)

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

    plain, ours, ddp_model = (copy.deepcopy(base) for _ in range(3))
    ddp_model = torch.nn.parallel.DistributedDataParallel(
        ddp_model, device_ids=[device.index] if device.type == "cuda" else None
    )
    runners = {
        "no communication": (plain, sgd(plain)),
        f"mpidp ({path})": (
            ours,
            mpidp.DistributedOptimizer(sgd(ours), named_parameters=ours.named_parameters()),
        ),
        f"DDP ({backend})": (ddp_model, sgd(ddp_model)),
    }
    times = {name: [] for name in runners}
    names = list(runners)
    for name in names:  # warm-up: allocator, caches, mpidp's response cache, NCCL set-up
        timed_steps(*runners[name], x, y, 2, device)
    for r in range(args.rounds):
        for name in rounds_order(names, r):
            comm.Barrier()
            times[name] += timed_steps(*runners[name], x, y, args.steps, device)
    grads = [torch.randn_like(p) for p in base.parameters()]
    timed_allreduce(grads, device, 2)
    comm.Barrier()
    times["allreduce of the gradient set"] = timed_allreduce(
        grads, device, args.rounds * args.steps
    )
    timed_floor(grads, device, comm, 2)
    comm.Barrier()
    times["staged floor of that allreduce"] = timed_floor(
        grads, device, comm, args.rounds * args.steps
    )
    # The slowest rank sets the pace: each figure is the largest median over ranks.
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    med = {k: max(v) for k, v in zip(med, zip(*comm.allgather(list(med.values()))))}
    if comm.rank == 0:
        row = {
            "device": device.type,
            "n": comm.size,
            "path": path,
            "ddp": backend,
            "ms": med,
            "mpidp_over_ddp": med[f"mpidp ({path})"] / med[f"DDP ({backend})"],
        }
        print(
            f"cuda_paths: {device.type} tensors, np={comm.size}, mpidp path {path}, medians "
            f"of {args.rounds}x{args.steps} (ms)"
        )
        for k, v in med.items():
            print(f"  {k:34s} {v:9.2f}")
        print(f"  mpidp step / DDP ({backend}) step      {row['mpidp_over_ddp']:9.3f}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(row, fh)
    dist.destroy_process_group()
    mpidp.shutdown()


if __name__ == "__main__":
    main()
