"""ShardedOptimizer side by side with DistributedOptimizer and torch's ZeroRedundancyOptimizer.

    mpiexec -n 2 python benchmarks/sharded.py [--rounds 5] [--steps 5] [--models resnet18,mlp6.3M]
    python benchmarks/sharded.py --rss [--np 2]      (peak RSS: one launch per contender)

Adam (two state tensors per parameter), one torch thread per rank. Each round runs every
contender for --steps steps on its own copy of the model (same initial weights), in a rotating
order; medians over all rounds, the slowest rank's. Printed per model: step time of
- mpidp.DistributedOptimizer (state unsharded),
- mpidp.ShardedOptimizer stage 1 and stage 2,
- torch's ZeroRedundancyOptimizer with DDP over gloo (its documented use: DDP averages the
  gradients, ZeRO steps its shard and broadcasts the updated parameters),
and each one's optimizer-state bytes on this rank, with the goals: sharded state <= unsharded / N
plus the state of the largest parameter; sharded step <= 1.05x DistributedOptimizer's; sharded
step faster than ZeroRedundancyOptimizer's.
"""

import argparse
import copy
import os
import re
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rounds import order as rounds_order  # noqa: E402
from train_step import MODELS, setup_gloo  # noqa: E402

NAMES = [
    "DistributedOptimizer",
    "ShardedOptimizer stage 1",
    "ShardedOptimizer stage 2",
    "ZeroRedundancyOptimizer (gloo)",
]


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def build(name, base):
    """(model, optimizer, the torch optimizer that holds this rank's state)."""
    import mpidp

    model = copy.deepcopy(base)
    if name == "DistributedOptimizer":
        inner = adam(model.parameters())
        return model, mpidp.DistributedOptimizer(inner, model.named_parameters()), inner
    if name.startswith("ShardedOptimizer"):
        inner = adam(model.parameters())
        opt = mpidp.ShardedOptimizer(inner, model.named_parameters(), stage=int(name[-1]))
        return model, opt, inner
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    return ddp, opt, opt.optim


def state_bytes(inner) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in inner.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def step(model, opt, x, y) -> float:
    start = time.perf_counter()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    return time.perf_counter() - start


def bench(model_name, names, comm, rounds, steps):
    make, make_input, batch, classes = MODELS[model_name]
    torch.manual_seed(0)
    base = make()
    runners = {n: build(n, base) for n in names}
    g = torch.Generator().manual_seed(comm.rank)
    x, y = make_input(batch), torch.randint(0, classes, (batch,), generator=g)
    times = {n: [] for n in names}
    for n in names:  # warm-up: allocator, caches, the engine's response cache, lazy state
        for _ in range(2):
            step(*runners[n][:2], x, y)
    for r in range(rounds):
        for n in rounds_order(names, r):
            comm.Barrier()
            times[n] += [step(*runners[n][:2], x, y) for _ in range(steps)]
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    med = {k: max(v) for k, v in zip(med, zip(*comm.allgather(list(med.values()))))}
    held = {n: max(comm.allgather(state_bytes(runners[n][2]))) for n in names}
    largest = max(p.numel() * p.element_size() for p in base.parameters())
    return med, held, largest


def report(model_name, med, held, largest, size):
    print(f"\n{model_name}: step ms (median, slowest rank) and optimizer state MB per rank")
    for n in med:
        print(f"  {n:32s} {med[n]:8.1f} ms  {held[n] / 2**20:8.1f} MB")
    full = held["DistributedOptimizer"]
    bound = full / size + 2 * largest  # two state tensors of the largest parameter
    for n in ("ShardedOptimizer stage 1", "ShardedOptimizer stage 2"):
        print(
            f"  {n}: state / bound {held[n] / bound:6.3f} (goal <= 1; bound = unsharded/N "
            f"+ largest parameter's state = {bound / 2**20:.1f} MB)"
        )
        print(
            f"  {n} / DistributedOptimizer  {med[n] / med['DistributedOptimizer']:6.3f} "
            f"(goal <= 1.05)"
        )
        print(f"  {n} / ZeroRedundancyOptimizer {med[n] / med[NAMES[3]]:6.3f} (goal < 1)")


def rss_driver(np_, models, steps):
    """One launch per contender (peak RSS is per process): the max over ranks, in MB."""
    print(f"peak RSS per rank (max over ranks), np={np_}, {steps} steps after building")
    for model_name in models.split(","):
        for n in NAMES:
            cmd = [
                "mpiexec",
                "-n",
                str(np_),
                sys.executable,
                os.path.abspath(__file__),
                "--only",
                n,
                "--models",
                model_name,
                "--steps",
                str(steps),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            mb = re.search(r"RSS ([\d.]+)", out).group(1)
            print(f"  {model_name:10s} {n:32s} {float(mb):8.1f} MB")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rss", action="store_true", help="driver: one launch per contender")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--only", help="(used by --rss) run this contender alone")
    args = parser.parse_args()
    if args.rss:
        return rss_driver(args.np, args.models, args.steps)
    import torch.distributed as dist
    from mpi4py import MPI

    import mpidp

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    mpidp.init()
    setup_gloo(comm)
    names = [args.only] if args.only else NAMES
    for model_name in args.models.split(","):
        rounds = 1 if args.only else args.rounds
        med, held, largest = bench(model_name, names, comm, rounds, args.steps)
        if args.only:
            rss = max(comm.allgather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
            if comm.rank == 0:
                print(f"RSS {rss / 1024:.1f}")
        elif comm.rank == 0:
            print(f"np={comm.size}, Adam, {args.rounds} rounds x {args.steps} steps")
            report(model_name, med, held, largest, comm.size)
    dist.destroy_process_group()
    mpidp.shutdown()


if __name__ == "__main__":
    main()
