"""Whether chunks pay across hosts: the link's pace, measured when the data path is made."""

import time
from typing import Optional

import numpy as np

from ..log import logger
from . import mpi
from .messages import ReduceOp

# A link slower than this (bytes per second) sets the pace of a large reduction, not the cores:
# each chunk's collective then leaves the link idle at its start and end (64 MB at 1 Gbit/s:
# 0.78-0.87 of the link in 4-8 MiB chunks, 0.98 whole), while on a fast link the cores set the
# pace and cache-sized chunks reduce faster (10 Gbit/s: 0.92-0.98 chunked, 0.6-0.77 whole;
# BENCHMARKS.md, "Chunks across hosts follow the link").
SLOW_LINK_BYTES_PER_S = 3e9 / 8
SAMPLES = 3  # reductions timed before the ranks decide
QUICK_BYTES = 256 << 10  # the first look at the link (LinkPace.measure)
# The least a test of MPI must read from a socket for the long sleeps between tests of a slow
# link (1 ms at 3 Gbit/s brings 375 KB): with UCX's own 64 KiB segments 1 ms sleeps ran a
# 1 Gbit/s link at 0.37 of its rate, with 2 MiB at its rate (BENCHMARKS.md, "A wait that sleeps").
LONG_SLEEP_SEGMENT = 1 << 20


class LinkPace:
    """The pace of the link between hosts, measured once when the data path is made: the ranks
    time SAMPLES reductions of a two-chunk buffer (after one untimed, which opens the
    connections; unless a first look at a small one found the link far below the mark) and
    agree on the fastest rate any rank saw. Below SLOW_LINK_BYTES_PER_S the link is slow: large
    tensors then go whole in pieces, and the training layer lays out finer buckets
    (training/buckets.py bucket_caps)."""

    def __init__(self, comm, measure: bool):
        self._comm = comm
        self._measure = measure
        self.slow: Optional[bool] = None  # the ranks' verdict, once they agreed on one

    def sleep_max(self, segment: int) -> float:
        """The longest sleep between MPI's tests of a transfer across the link while no user
        thread waits: mpi.NETWORK_SLEEP_LONG_S once the ranks found the link slow, where a test
        reads at least LONG_SLEEP_SEGMENT bytes from a socket (`segment`: what UCX's TCP
        transport reads, mpi_library.ucx_tcp_segment; 0 where unknown); else the short
        mpi.NETWORK_SLEEP_MAX_S, which a fast link needs (10 Gbit/s, 2 MiB reads: a 23 MB
        allreduce in 41 ms, as spinning; 44 ms under 250 us sleeps, 71 under 1 ms)."""
        if self.slow and segment >= LONG_SLEEP_SEGMENT:
            return mpi.NETWORK_SLEEP_LONG_S
        return mpi.NETWORK_SLEEP_MAX_S

    def measure(self, chunk_bytes: int) -> bool:
        """Time the link (if this pace was made to) and return whether the ranks found it slow.
        A first look at QUICK_BYTES settles a link far below the mark at once (the full measure
        would take seconds there: 8 MiB x 4 at 10 Mbit/s is 27 s). Synchronization: when
        measuring, 2 allreduces of QUICK_BYTES and, unless they settle it, (SAMPLES + 1) x 2 of
        `chunk_bytes`, each set followed by one of 8 bytes, on every rank of the data
        communicator."""
        if not self._measure:
            return False
        self._measure = False
        step = max(chunk_bytes // 4, 1)
        rate = self._rate(max(QUICK_BYTES // 4, 1), 1, 1)
        if rate >= SLOW_LINK_BYTES_PER_S / 4:
            rate = self._rate(step, 2, SAMPLES)
        slow = self.slow = rate < SLOW_LINK_BYTES_PER_S
        logger.info(
            "the link between hosts reduced at %.2f Gbit/s: large tensors go %s",
            rate * 8e-9,
            "all at once, in pieces (a chunk's start and end would leave it idle), and "
            "DistributedOptimizer's buckets are finer"
            if slow
            else "in chunks, one at a time",
        )
        return slow

    def _rate(self, step: int, chunks: int, samples: int) -> float:
        """The fastest rate (bytes/s) any rank saw reducing `chunks` chunks of `step` float32
        values, over `samples` timed rounds after one untimed (which opens the connections)."""
        buf = np.zeros(chunks * step, dtype=np.float32)
        op = mpi.mpi_op(ReduceOp.SUM, False)
        best = 0.0
        for k in range(samples + 1):
            start = time.perf_counter()
            for lo in range(0, len(buf), step):
                mpi.allreduce(self._comm, None, buf[lo : lo + step], op)
            if k:
                best = max(best, buf.nbytes / max(time.perf_counter() - start, 1e-9))
        rate = np.array([best])
        mpi.allreduce(self._comm, None, rate, mpi.mpi_op(ReduceOp.MAX, False))
        return float(rate[0])
