"""Wake-up messages between engines: point to point on the wake communicator, never waited on."""

import time
from typing import List

import numpy as np
from mpi4py import MPI

from ...log import logger
from .waiting import SLEEP_MAX_S

_WAKE_TAG = 7


class WakeBox:
    """Wake-up messages (three int64: epoch, cycle, flags), probed for, never waited on.
    Messages of another epoch (an earlier engine's) are dropped. Sends are non-blocking and
    kept until they complete, so a wake never blocks its sender. It counts what it sent to each
    rank and what it received, so that the last cycle can take every wake-up still on its way
    (drain()): one left unreceived at exit is a message MPI warns of (UCX: "unexpected
    tag-receive descriptor ... was not matched").

    A matched probe (Improbe, then the matched message's receive), not a posted ANY_SOURCE
    receive: with MPICH 5.0.2 over UCX and shared memory (several ranks on each of several
    nodes), a receive from any source re-posted after one message from another node had
    matched never matched the next one from that node, which stayed in UCX's unexpected queue
    (4 ranks on 2 nodes, a wake-up from each peer: 1-2 of 3 arrived, the drain waited out its
    bound at every shutdown; the probe took all 3 at once).
    """

    def __init__(self, comm, epoch: int):
        self.comm = comm
        self.epoch = epoch
        self._buf = np.zeros(3, dtype=np.int64)
        self._sends: List[MPI.Request] = []
        self.sent = [0] * comm.Get_size()  # wake-ups of this epoch sent to each rank
        self._got = 0  # wake-ups of this epoch received

    def take(self) -> list:
        """Every (cycle, flags) of this epoch that has arrived since the last call."""
        got: List[tuple] = []
        while True:
            message = self.comm.Improbe(source=MPI.ANY_SOURCE, tag=_WAKE_TAG)
            if message is None:
                return got
            message.Recv([self._buf, MPI.INT64_T])  # matched and small: returns at once
            if int(self._buf[0]) == self.epoch:
                got.append((int(self._buf[1]), int(self._buf[2])))
                self._got += 1

    def send(self, cycle: int, flags: int, ranks) -> None:
        """Send (cycle, flags) to each rank in `ranks`."""
        self._sends = [r for r in self._sends if not r.Test()]
        msg = np.array([self.epoch, cycle, flags], dtype=np.int64)
        for rank in ranks:
            self._sends.append(self.comm.Isend([msg, MPI.INT64_T], dest=rank, tag=_WAKE_TAG))
            self.sent[rank] += 1

    def drain(self, expected: int, timeout_s: float = 2.0) -> None:
        """Receive wake-ups until `expected` of this epoch have arrived in all (the peers' sent
        counts for this rank), and let this rank's own sends complete; both bounded by
        `timeout_s`. Synchronization: the peers' matching sends and receives."""
        deadline = time.monotonic() + timeout_s
        delay = 20e-6
        while time.monotonic() < deadline:
            self.take()
            self._sends = [r for r in self._sends if not r.Test()]
            if self._got >= expected and not self._sends:
                return
            time.sleep(delay)
            delay = min(delay * 2, SLEEP_MAX_S)
        logger.warning(
            "%d of the %d wake-up message(s) the peers sent this rank, and %d of its own, were "
            "still on their way after %.1f s at shutdown; MPI may warn of them at exit",
            max(expected - self._got, 0),
            expected,
            len(self._sends),
            timeout_s,
        )

    def close(self) -> None:
        """Forget the sends that have completed (local); those still in flight are left to
        MPI."""
        self._sends = [r for r in self._sends if not r.Test()]
