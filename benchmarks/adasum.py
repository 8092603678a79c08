"""Adasum against Average: ResNet-18's gradients through grouped allreduce, one MPI job.

    mpiexec -n 2 python benchmarks/adasum.py [--rounds 15] [--bucket-mb 25] [--fraction 1.0]
    mpiexec -n 4 python benchmarks/adasum.py          (Adasum needs a power-of-2 world)

The set: ResNet-18's 62 gradient tensors (11,689,512 float32 at --fraction 1; each tensor's
element count times --fraction, at least 1, for a quick check), in reverse order, cut into
buckets of at most --bucket-mb MiB (0: one op for the whole set) as DistributedOptimizer cuts
them. Contenders, run once each per round, in an order that alternates from round to round:

  average   grouped_allreduce_async_(bucket, op=Average) for every bucket, then synchronize()
  adasum    the same with op=Adasum (engine/adasum.py: vector halving, distance doubling,
            point to point, per-tensor dot products in float64)

Every sample is the largest elapsed time over the ranks, after a barrier; the table gives the
median over the rounds and the ratio adasum / average. Before timing, each contender's result
is checked once: Average against the exact mean, Adasum for bitwise equality across ranks.
"""

import argparse
import math
import os
import statistics
import sys
import time
import zlib

import torch
from mpi4py import MPI

import mpidp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce import RESNET18_SHAPES  # noqa: E402

MB = 1024 * 1024


def buckets(tensors, bucket_bytes: int):
    """Consecutive tensors, at most bucket_bytes together (a larger tensor alone; 0: one)."""
    out, cur, nbytes = [], [], 0
    for t in tensors:
        size = t.numel() * t.element_size()
        if cur and bucket_bytes and nbytes + size > bucket_bytes:
            out.append(cur)
            cur, nbytes = [], 0
        cur.append(t)
        nbytes += size
    return out + ([cur] if cur else [])


def reduce_all(groups, op, prefix):
    handles = [
        mpidp.grouped_allreduce_async_(g, name=f"{prefix}.{i}", op=op) for i, g in enumerate(groups)
    ]
    for h in handles:
        mpidp.synchronize(h)


def timed(comm, fn) -> float:
    comm.Barrier()
    began = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - began, op=MPI.MAX)


def check(comm, tensors, groups):
    """Average gives the exact mean of rank + 1; Adasum gives the same bits on every rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    for t in tensors:
        t.fill_(rank + 1)
    reduce_all(groups, mpidp.Average, "adasum_bench.check_avg")
    want = (size + 1) / 2
    if not all(bool((t == want).all()) for t in tensors):
        raise AssertionError(f"Average: wrong result on rank {rank}")
    g = torch.Generator().manual_seed(rank)
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=g))
    reduce_all(groups, mpidp.Adasum, "adasum_bench.check_adasum")
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.numpy().tobytes(), crc)
    if len(set(comm.allgather(crc))) != 1:
        raise AssertionError("Adasum: the ranks' results differ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--bucket-mb",
        type=float,
        default=25.0,
        help="bucket size in MiB, as MPIDP_BUCKET_BYTES (0: the whole set at once)",
    )
    ap.add_argument(
        "--fraction",
        type=float,
        default=1.0,
        help="scale every tensor's element count (a quick check: 0.01)",
    )
    args = ap.parse_args()
    mpidp.init()
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    tensors = [
        torch.zeros(max(1, int(math.prod(s) * args.fraction))) for s in reversed(RESNET18_SHAPES)
    ]
    groups = buckets(tensors, int(args.bucket_mb * MB))
    total = sum(t.numel() for t in tensors)
    if rank == 0:
        print(
            f"# {size} ranks, {len(tensors)} tensors, {total:,} float32 "
            f"({total * 4 / MB:.1f} MiB) in {len(groups)} op(s); data path "
            f"{mpidp.runtime.world.state().engine.backend.names}",
            flush=True,
        )
    check(comm, tensors, groups)
    calls = {
        "average": lambda: reduce_all(groups, mpidp.Average, "adasum_bench.avg"),
        "adasum": lambda: reduce_all(groups, mpidp.Adasum, "adasum_bench.adasum"),
    }
    names = list(calls)
    for _ in range(args.warmup):
        for name in names:
            calls[name]()
    samples = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            samples[name].append(timed(comm, calls[name]))
        for t in tensors:  # Average keeps values as they are, Adasum may grow them: reset
            t.fill_(0.5)
    med = {name: statistics.median(v) for name, v in samples.items()}
    if rank == 0:
        for name in names:
            print(
                f"{name:>8}: {med[name] * 1e3:9.2f} ms median of {args.rounds} "
                f"(min {min(samples[name]) * 1e3:.2f}, max {max(samples[name]) * 1e3:.2f})"
            )
        print(f"ratio adasum / average: {med['adasum'] / med['average']:.2f}x", flush=True)
    comm.Free()
    mpidp.shutdown()


if __name__ == "__main__":
    main()
