"""Stalls inside MPI calls: a rank waiting in a call that its peers cannot complete.

The stall inspector (stall.py) finds ops that some ranks submitted and others did not, and it
works through the network: rank 0 gathers every rank's pending ops and broadcasts the shutdown.
Two stalls escape it. A collective that every rank entered but that cannot finish (a host cut
off, a link crawling at a fraction of its rate) has no missing rank; and when the network to a
host is gone, the inspector's own messages cannot pass either. MPI over TCP does not fail such a
call for many minutes (TCP retransmits for about 15).

So every engine has a watch thread that reads the start of the call in progress from the
engine's counters (stats.py: a negotiation's band exchange, a data-path batch), and:
- a data-path call older than the warning limit is logged (again every warning limit while it
  lasts), naming the op kind, this rank and the ranks on other hosts it waits for; older than the
  shutdown limit, the job ends with that message (mpi.abort_job);
- a negotiation call is allowed the limits plus NEGOTIATION_SLACK_S: a peer whose user code is
  slow to submit is the inspector's business, and the inspector wakes such a peer within about a
  second of the limits, which ends the call.
Both limits are the stall knobs (MPIDP_STALL_WARNING_S, MPIDP_STALL_SHUTDOWN_S); 0 turns each off.
"""

import threading
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

from ..log import logger
from . import mpi

NEGOTIATION_SLACK_S = 2.0


def watch(engine) -> "CallWatch":
    """The watch of `engine`'s calls, to start() with the engine; it ends once the engine has
    stopped for good (a call the engine left then is no stall)."""
    return CallWatch(
        engine.stats,
        engine.rank,
        remote_ranks(engine.comms),
        engine.config.stall_warning_s,
        engine.config.stall_shutdown_s,
        alive=engine.running,
        hosts=engine.comms.hosts,
    )


def remote_ranks(comms) -> list:
    """Ranks of the engine's communicator that are not on this host (local; no communication)."""
    local = comms.local.Get_group().Translate_ranks(
        list(range(comms.local.Get_size())), comms.world.Get_group()
    )
    return sorted(set(range(comms.size)) - set(local))


def _ranks(ranks: Sequence[int], hosts: Optional[Sequence[str]] = None) -> str:
    if not ranks:
        return "none"
    return ", ".join(f"{r} ({hosts[r]})" if hosts else str(r) for r in ranks)


class CallWatch:
    """The watch thread of one engine (see the module docstring). `abort(message)` ends the job
    (mpi.abort_job; tests pass their own); the thread ends once `alive()` is false."""

    def __init__(
        self,
        stats,
        rank: int,
        remote: Sequence[int],
        warning_s: float,
        shutdown_s: float,
        abort: Callable[[str], None] = mpi.abort_job,
        alive: Callable[[], bool] = lambda: True,
        hosts: Optional[Sequence[str]] = None,
    ):
        self.stats = stats
        self.hosts = hosts  # each rank's host name, to name the unreachable ones
        self.alive = alive
        self.rank = rank
        self.remote = list(remote)
        self.warning_s = warning_s
        self.shutdown_s = shutdown_s
        self.abort = abort
        self._warned: Dict[str, Tuple[float, float]] = {}  # kind -> (call's start, warned at)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def enabled(self) -> bool:
        return self.warning_s > 0 or self.shutdown_s > 0

    def start(self) -> None:
        if self.enabled():
            self._thread = threading.Thread(target=self._run, name="mpidp-call-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the watch's thread and wait for it (briefly): a process set's engine stops it at
        removal, and sets added and removed in a loop must not pile threads up."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(1.0)

    def _period(self) -> float:
        limits = [t for t in (self.warning_s, self.shutdown_s) if t > 0]
        return max(0.05, min(1.0, min(limits) / 10))

    def _run(self) -> None:
        while not self._stop.wait(self._period()) and self.alive():
            if self.check(time.monotonic()):
                return

    def check(self, now: float) -> bool:
        """Look at the calls in progress once; True once the job was ended."""
        calls = (
            ("data-path collective", self.stats.collective[1], 0.0),
            ("negotiation exchange", self.stats.negotiate[1], NEGOTIATION_SLACK_S),
        )
        for kind, since, slack in calls:
            if not since:
                self._warned.pop(kind, None)
                continue
            age = now - since
            if 0 < self.shutdown_s <= age - slack:
                self.abort(
                    f"stall: rank {self.rank} has waited {age:.1f} s in a {kind} that "
                    f"its peers cannot complete (ranks on other hosts: "
                    f"{_ranks(self.remote, self.hosts)}): a host is unreachable or its "
                    f"link has stalled; MPIDP_STALL_SHUTDOWN_S={self.shutdown_s:g}: "
                    f"ending the job"
                )
                return True
            if 0 < self.warning_s <= age - slack:
                start, at = self._warned.get(kind, (None, 0.0))
                if start != since or now - at >= self.warning_s:
                    self._warned[kind] = (since, now)
                    logger.warning(
                        "stall: rank %d has waited %.1f s in a %s for its peers (ranks on "
                        "other hosts: %s): a slow or cut-off link, or a slow rank; repeated "
                        "every %.0f s while it waits",
                        self.rank,
                        age,
                        kind,
                        _ranks(self.remote, self.hosts),
                        self.warning_s,
                    )
        return False
