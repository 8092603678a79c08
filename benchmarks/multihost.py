"""Flat against hierarchical allreduce across hosts, side by side in one MPI job.

    mpiexec -hosts hosta:2,hostb:2 -n 4 python benchmarks/multihost.py [--rounds 5]
                                                        [--sizes 4K,256K,4M,16M] [--iters 10]

Meant for several hosts with several ranks each (docs/clusters.md says how to build a cluster of
network namespaces on one machine for it). Each round runs mpidp with the flat allreduce, mpidp
with `hierarchical_allreduce` (reduce-scatter in the host, allreduce across hosts, allgather in
the host) and raw mpi4py Allreduce on one buffer, in an order that rotates from round to round.
mpidp is started with init(hierarchical_allreduce=...) and stopped with shutdown() for each
contender. A sample is the largest time over the ranks of `--iters` blocking float32 allreduces
(Sum) after a barrier, per call; the table gives medians over the rounds and hier / flat.
"""

import argparse
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

import mpidp

UNITS = {"K": 1024, "M": 1024 * 1024}


def parse_size(text):
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def timed(comm, call, iters):
    call()  # warm-up (and, for mpidp, the negotiation that the cache then skips)
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return comm.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX)


def run_mpidp(comm, sizes, iters, hierarchical):
    mpidp.init(hierarchical_allreduce=int(hierarchical))
    path = mpidp.runtime.state().engine.backend.routes["cpu"]
    if path.hierarchical != hierarchical:
        raise SystemExit(f"asked for hierarchical={hierarchical}, the engine has "
                         f"{path.hierarchical}: need >1 host and >1 rank per host, equal counts")
    out = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        name = f"bench.{nbytes}"
        out[nbytes] = timed(comm, lambda: mpidp.allreduce_(t, op=mpidp.Sum, name=name), iters)
    mpidp.shutdown()
    return out


def run_raw(comm, sizes, iters):
    out = {}
    for nbytes in sizes:
        buf = np.ones(nbytes // 4, dtype=np.float32)
        out[nbytes] = timed(comm, lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), iters)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--sizes", default="4K,256K,4M,16M")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    comm = MPI.COMM_WORLD.Dup()
    contenders = {"flat": lambda: run_mpidp(comm, sizes, args.iters, False),
                  "hierarchical": lambda: run_mpidp(comm, sizes, args.iters, True),
                  "raw": lambda: run_raw(comm, sizes, args.iters)}
    names = list(contenders)
    samples = {name: {n: [] for n in sizes} for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for nbytes, secs in contenders[name]().items():
                samples[name][nbytes].append(secs)
    hosts = len(set(comm.allgather(MPI.Get_processor_name())))
    if comm.Get_rank() != 0:
        return
    print(f"{comm.Get_size()} ranks on {hosts} host(s), {args.rounds} rounds of {args.iters} "
          f"calls; medians, ms per call")
    print(f"{'bytes':>10} {'flat':>9} {'hier':>9} {'raw':>9} {'hier/flat':>10}")
    for n in sizes:
        med = {name: statistics.median(samples[name][n]) * 1e3 for name in names}
        print(f"{n:>10} {med['flat']:>9.3f} {med['hierarchical']:>9.3f} {med['raw']:>9.3f} "
              f"{med['hierarchical'] / med['flat']:>10.2f}")


if __name__ == "__main__":
    main()
