"""Where a step of DistributedOptimizer and ShardedOptimizer (stage 1, 2) goes, phase by phase.

    mpiexec -n 2 python benchmarks/profile/sharded_phases.py [--model resnet18|mlp6.3M]
        [--rounds 6] [--steps 4]

Adam, one torch thread per rank, each contender on its own copy of the model, in turn, for
--steps steps per round (the first round is warm-up). Rank 0 prints the median per phase, ms:
zero_grad + forward + backward; synchronize() (the gradients' reduction: allreduce, or
reduce-scatter); the wrapped optimizer's own step (timed by wrapping it); the rest of step()
(the sharded allgather); the whole step.
"""

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from train_step import MODELS, workload  # noqa: E402


def build(kind, base):
    import mpidp

    model = copy.deepcopy(base)
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    if kind == "DistributedOptimizer":
        opt = mpidp.DistributedOptimizer(inner, model.named_parameters())
    else:
        opt = mpidp.ShardedOptimizer(inner, model.named_parameters(), stage=int(kind[-1]))
    spent = {"inner": 0.0}
    step = inner.step

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            spent["inner"] += time.perf_counter() - start

    inner.step = timed
    return model, opt, spent


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet18", choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    from mpi4py import MPI

    import mpidp

    torch.set_num_threads(1)
    mpidp.init()
    comm = MPI.COMM_WORLD
    base, x, y = workload(args.model)
    kinds = ["DistributedOptimizer", "ShardedOptimizer stage 1", "ShardedOptimizer stage 2"]
    runs = {k: build(k, base) for k in kinds}
    phases = {k: [] for k in kinds}
    for rnd in range(args.rounds):
        for kind, (model, opt, spent) in runs.items():
            comm.Barrier()
            for _ in range(args.steps):
                spent["inner"] = 0.0
                t0 = time.perf_counter()
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                t1 = time.perf_counter()
                opt.synchronize()
                t2 = time.perf_counter()
                with opt.skip_synchronize():
                    opt.step()
                t3 = time.perf_counter()
                if rnd:
                    phases[kind].append(
                        (t1 - t0, t2 - t1, spent["inner"], t3 - t2 - spent["inner"], t3 - t0)
                    )
    if comm.rank == 0:
        print(f"{args.model}, np={comm.size}: median ms per phase (rank 0)")
        print(f"  {'':26s} {'fwd+bwd':>8s} {'sync':>8s} {'inner':>8s} {'rest':>8s} {'step':>8s}")
        for kind, rows in phases.items():
            cols = [statistics.median(c) * 1e3 for c in zip(*rows)]
            print(f"  {kind:26s} " + " ".join(f"{c:8.2f}" for c in cols))
    mpidp.shutdown()


if __name__ == "__main__":
    main()
