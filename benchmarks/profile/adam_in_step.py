"""Adam's own step inside a training step and alone, default and fused, in one job.

    mpiexec -n 2 python benchmarks/profile/adam_in_step.py [--model resnet18] [--rounds 6]

One torch thread per rank. Each contender on its own copy of the model, in turn, 3 steps per
round (the first round is warm-up); a sample is the wrapped optimizer's step() alone, with the
minor page faults it took (getrusage):
- dist, after backward + sync: DistributedOptimizer(Adam) as training runs it
  (synchronize(), then the inner step);
- dist, second step: the inner step again at once (caches warm, same gradients);
- plain, after backward: torch's Adam after a backward pass, no mpidp;
- alone: that Adam stepped again and again, nothing between;
- fused, after backward / alone: the same with Adam(fused=True).
Prints per rank the median ms and faults of each.
"""

import argparse
import copy
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from train_step import MODELS, workload  # noqa: E402


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(opt):
    f0, t0 = faults(), time.perf_counter()
    opt.step()
    return time.perf_counter() - t0, faults() - f0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet18", choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    from mpi4py import MPI

    import mpidp

    torch.set_num_threads(1)
    mpidp.init()
    comm = MPI.COMM_WORLD
    base, x, y = workload(args.model)

    def copy_with(**kw):
        model = copy.deepcopy(base)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3, **kw)

    m1, a1 = copy_with()
    dist = mpidp.DistributedOptimizer(a1, m1.named_parameters())
    m2, a2 = copy_with()
    m3, a3 = copy_with(fused=True)
    names = [
        "dist, after backward + sync",
        "dist, second step",
        "plain, after backward",
        "alone",
        "fused, after backward",
        "fused, alone",
    ]
    got = {n: [] for n in names}

    def keep(rnd, name, sample):
        if rnd:
            got[name].append(sample)

    for rnd in range(args.rounds):
        comm.Barrier()
        for _ in range(3):
            dist.zero_grad()
            F.cross_entropy(m1(x), y).backward()
            dist.synchronize()
            keep(rnd, names[0], timed(a1))
            keep(rnd, names[1], timed(a1))
        for model, opt, after, alone in (
            (m2, a2, names[2], names[3]),
            (m3, a3, names[4], names[5]),
        ):
            comm.Barrier()
            for _ in range(3):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                keep(rnd, after, timed(opt))
                keep(rnd, alone, timed(opt))
    mine = {
        n: (statistics.median(t for t, _ in v) * 1e3, statistics.median(f for _, f in v))
        for n, v in got.items()
    }
    every = comm.gather(mine, 0)
    if comm.rank == 0:
        print(f"{args.model}, np={comm.size}: the wrapped optimizer's step, median ms (faults)")
        for n in names:
            cells = "  ".join(
                f"rank {r}: {d[n][0]:6.1f} ({d[n][1]:.0f})" for r, d in enumerate(every)
            )
            print(f"  {n:30s} {cells}")
    mpidp.shutdown()


if __name__ == "__main__":
    main()
