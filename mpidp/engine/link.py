"""Whether chunks pay across hosts: the link's pace, measured on the first chunked reductions."""

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
SAMPLES = 3  # chunked reductions timed before the ranks decide
# The least a test of MPI must read from a socket for the long sleeps between tests of a slow
# link (1 ms at 3 Gbit/s brings 375 KB): with UCX's own 64 KiB segments 1 ms sleeps ran a
# 1 Gbit/s link at 0.37 of its rate, with 2 MiB at its rate (BENCHMARKS.md, "A wait that sleeps").
LONG_SLEEP_SEGMENT = 1 << 20


class LinkPace:
    """The pace of the link between hosts, for the host data path's chunking: the ranks time
    their first SAMPLES chunked reductions, agree on the fastest any rank saw (one small
    collective, at the same point of the same batches on every rank), and keep chunking only if
    it is not below SLOW_LINK_BYTES_PER_S."""

    def __init__(self, comm, measure: bool):
        self._comm = comm
        self._left = SAMPLES if measure else 0
        self._best = 0.0
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

    @property
    def measuring(self) -> bool:
        """Whether the next chunked reduction is to be timed."""
        return self._left > 0

    def slow_after(self, nbytes: int, seconds: float) -> bool:
        """Note a chunked reduction of `nbytes` that took `seconds`; True once the ranks agree
        that the link is slow (then stop chunking). Synchronization: after the SAMPLES-th, a
        collective on the data communicator (every rank times the same reductions)."""
        self._best = max(self._best, nbytes / max(seconds, 1e-9))
        self._left -= 1
        if self._left:
            return False
        rate = np.array([self._best])
        mpi.allreduce(self._comm, None, rate, mpi.mpi_op(ReduceOp.MAX, False))
        slow = self.slow = float(rate[0]) < SLOW_LINK_BYTES_PER_S
        logger.info(
            "the link between hosts reduced at %.2f Gbit/s: large tensors go %s",
            rate[0] * 8e-9,
            "all at once, in pieces (a chunk's start and end would leave it idle)"
            if slow
            else "in chunks, one at a time",
        )
        return slow
