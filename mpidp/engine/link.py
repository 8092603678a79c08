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
