"""torch.distributed over backend "mpidp" against gloo and raw MPI, side by side in one job.

    mpiexec -n 2 python benchmarks/torch_distributed.py [--reps 200] [--rounds 5]

Rows (medians over every round; the slowest rank's median):
- blocking 4 B dist.all_reduce on an "mpidp" group, on a gloo group, mpidp's own
  mpidp.allreduce_ of a named tensor, and mpi4py's Allreduce (goal: mpidp group <= 30 us);
- 64 MB dist.all_reduce on the "mpidp" group, gloo, and raw MPI Allreduce (goal: <= 1.05x raw);
- an FSDP2 (fully_shard) training step of an MLP with the "mpidp" group and with gloo's
  (goal: mpidp / gloo <= 0.80).
Default group: gloo (a TCP rendezvous whose address travels over MPI); the "mpidp" group is
made by dist.new_group(backend="mpidp") beside it, as a script mixing backends would.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

import mpidp
import mpidp.distributed  # noqa: F401  (registers backend "mpidp")


def timed(fn, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def fsdp_step_fn(group, seed: int):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        *[layer for _ in range(4) for layer in (torch.nn.Linear(512, 512), torch.nn.ReLU())]
    )
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 512)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    return step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    mpidp.init()
    port = comm.bcast(29500 + os.getpid() % 1000 if comm.rank == 0 else None, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
    ours, gloo = dist.new_group(backend="mpidp"), dist.group.WORLD
    raw = comm.Dup()

    small = torch.ones(1)
    big = torch.ones(16 * 1024 * 1024)
    big_np = big.numpy()
    small_np = small.numpy()
    rows = {
        "4 B all_reduce, mpidp group (us)": lambda: dist.all_reduce(small, group=ours),
        "4 B all_reduce, gloo group (us)": lambda: dist.all_reduce(small, group=gloo),
        "4 B mpidp.allreduce_ (us)": lambda: mpidp.allreduce_(small, name="bench.4b", op=mpidp.Sum),
        "4 B raw MPI Allreduce (us)": lambda: raw.Allreduce(MPI.IN_PLACE, small_np),
        "64 MB all_reduce, mpidp group (ms)": lambda: dist.all_reduce(big, group=ours),
        "64 MB all_reduce, gloo group (ms)": lambda: dist.all_reduce(big, group=gloo),
        "64 MB raw MPI Allreduce (ms)": lambda: raw.Allreduce(MPI.IN_PLACE, big_np),
    }
    steps = {
        "FSDP2 step, mpidp group (ms)": fsdp_step_fn(ours, 0),
        "FSDP2 step, gloo group (ms)": fsdp_step_fn(gloo, 0),
    }
    times = {k: [] for k in list(rows) + list(steps)}
    for fn in list(rows.values()) + list(steps.values()):  # warm-up: caches, allocations
        for _ in range(3):
            fn()
    for _ in range(args.rounds):
        for name, fn in rows.items():
            reps = args.reps if name.startswith("4 B") else max(3, args.reps // 40)
            comm.Barrier()
            times[name].append(timed(fn, reps))
        for name, fn in steps.items():
            comm.Barrier()
            times[name].append(timed(fn, 5))
    med = {k: statistics.median(v) for k, v in times.items()}
    med = {k: max(v) for k, v in zip(med, zip(*comm.allgather(list(med.values()))))}
    if comm.rank == 0:
        print(
            f"torch.distributed, np={comm.size}, 1 torch thread per rank, medians of "
            f"{args.rounds} rounds"
        )
        for k, v in med.items():
            print(f"  {k:38s} {v * (1e6 if '(us)' in k else 1e3):10.1f}")
        for label, a, b, goal in (
            (
                "4 B mpidp group / raw MPI",
                "4 B all_reduce, mpidp group (us)",
                "4 B raw MPI Allreduce (us)",
                "",
            ),
            (
                "64 MB mpidp group / raw MPI",
                "64 MB all_reduce, mpidp group (ms)",
                "64 MB raw MPI Allreduce (ms)",
                "(goal <= 1.05)",
            ),
            (
                "FSDP2 mpidp / gloo",
                "FSDP2 step, mpidp group (ms)",
                "FSDP2 step, gloo group (ms)",
                "(goal <= 0.80)",
            ),
        ):
            print(f"  {label:38s} {med[a] / med[b]:10.3f}   {goal}")
    dist.destroy_process_group()
    mpidp.shutdown()


if __name__ == "__main__":
    main()
