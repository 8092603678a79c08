"""Where a blocking 4 B allreduce's time goes: torch.distributed's wrapper, the group, the lane.

    mpiexec -n 2 python benchmarks/profile/express_latency.py [--iters 2000] [--rounds 7]

Four contenders in one job, each timed in blocks of `--iters` back-to-back calls with nothing
else between them (benchmarks/torch_distributed.py interleaves its rows with 64 MB calls and
FSDP steps), a sample being the slowest rank's block mean, the row the median over `--rounds`:

  raw        mpi4py's Allreduce of one float32 (IN_PLACE)
  mpidp      mpidp.allreduce_ of a named tensor: the express lane
  dist       dist.all_reduce on the world group of backend "mpidp" (init_process_group("mpidp"))
  dist-null  the same call on that group with its allreduce replaced by one that returns a
             finished work at once: what torch's own wrapper costs, the floor for `dist`
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

import mpidp
import mpidp.distributed  # noqa: F401  (registers backend "mpidp")
from mpidp.distributed.group import ProcessGroupMpidp
from mpidp.distributed.work import Work


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    raw = comm.Dup()
    mpidp.init()
    dist.init_process_group("mpidp")
    t = torch.ones(1)
    raw_buf = t.numpy().copy()
    done = Work.finished([])
    real = ProcessGroupMpidp.allreduce

    def null(self, tensors, opts=None):
        return done

    rows = {
        "raw": lambda: raw.Allreduce(MPI.IN_PLACE, raw_buf),
        "mpidp": lambda: mpidp.allreduce_(t, name="express.latency", op=mpidp.Sum),
        "dist": lambda: dist.all_reduce(t),
    }
    samples = {name: [] for name in [*rows, "dist-null"]}
    for fn in rows.values():
        for _ in range(200):
            fn()
    for _ in range(args.rounds):
        for name, fn in rows.items():
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                fn()
            samples[name].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
        # The null group swaps the method once per block, not per call: torch's path alone.
        ProcessGroupMpidp.allreduce = null  # type: ignore[method-assign]
        try:
            start = time.perf_counter()
            for _ in range(args.iters):
                dist.all_reduce(t)
            samples["dist-null"].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
        finally:
            ProcessGroupMpidp.allreduce = real  # type: ignore[method-assign]
    if comm.rank == 0:
        print(f"blocking 4 B, np={comm.size}, {args.rounds} rounds of {args.iters} calls (us)")
        med = {k: statistics.median(v) / args.iters * 1e6 for k, v in samples.items()}
        for name, us in med.items():
            rounds = " / ".join(f"{s / args.iters * 1e6:.1f}" for s in samples[name])
            print(f"  {name:10s} {us:7.1f}   rounds {rounds}")
        print(
            f"  dist - mpidp {med['dist'] - med['mpidp']:.1f} us (the group and torch's "
            f"wrapper; torch's alone {med['dist-null']:.1f}), mpidp / raw "
            f"{med['mpidp'] / med['raw']:.1f}x"
        )
    dist.destroy_process_group()
    mpidp.shutdown()


if __name__ == "__main__":
    main()
