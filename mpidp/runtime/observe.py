"""Observability: engine counters (stats, stats_window) and the Chrome-trace timeline."""

import os
import time
from typing import Optional

from ..engine import stats as _stats
from ..engine.timeline import Timeline
from . import world
from .process_sets import member_of


def _engine(process_set=None):
    """The engine serving `process_set` on this rank (None: the global set; a ProcessSet or its
    id otherwise); ValueError if this rank is not a member."""
    return member_of(process_set, "stats")[1].engine


def stats(reset: bool = False, process_set=None) -> dict:
    """This rank's engine counters since init() or the last stats(reset=True), as a dict.

    Keys (mpidp.engine.stats.KEYS has the same list):
      cycles, slow_cycles     engine cycles; those that went through the coordinator
      cache_hits              ops negotiated by their response-cache bit (fast path)
      cache_misses            ops negotiated through the coordinator
      collectives             data-path calls (one per fused batch or unfused op)
      fused_collectives       those carrying more than one tensor
      tensors, bytes          tensors and payload bytes carried
      tensors_per_collective  tensors / collectives
      negotiate_s             seconds in negotiation, waiting for peers included
      collective_s            seconds in the data path (pack, MPI call, unpack)
      wall_s                  seconds the counters cover
      by_op                   {'allreduce': {'collectives', 'tensors', 'bytes'}, ...}
      params                  the fusion and cycle knobs in force (autotune may change them)

    Not collective and no synchronization point: it reads counters the engine thread updates
    (a snapshot may straddle one engine cycle). With reset=True the returned values are still
    the ones before the reset; later calls count from here.
    """
    engine = _engine(process_set)
    counters = engine.stats
    now = counters.snapshot()
    base = counters.baseline
    out = _stats.difference(now, base) if base is not None else now
    out["params"] = engine.params()
    if reset:
        # The engine thread is the counters' only writer, so a reset moves a baseline instead.
        counters.baseline = now
    return out


class StatsWindow:
    """Counters over a stretch of a program (a window of training steps); see stats_window()."""

    def __init__(self, process_set=None):
        self._engine = _engine(process_set)
        self._begin: Optional[dict] = None
        self.stats: Optional[dict] = None
        self.wall_s = 0.0

    def start(self) -> "StatsWindow":
        self._begin = self._engine.stats.snapshot()
        self._t0 = time.perf_counter()
        self.stats = None
        return self

    def stop(self) -> dict:
        """End the window; returns the counters accumulated in it (stats() keys)."""
        if self._begin is None:
            raise RuntimeError("StatsWindow.stop() before start()")
        self.wall_s = time.perf_counter() - self._t0
        self.stats = _stats.difference(self._engine.stats.snapshot(), self._begin)
        self._begin = None
        return self.stats

    def _stopped(self) -> dict:
        if self.stats is None:
            raise RuntimeError("the window is still open: read it after stop() or the with block")
        return self.stats

    @property
    def comm_fraction(self) -> float:
        """Seconds the engine spent in collectives / wall seconds of the window.

        The engine runs beside the training thread, so time in collectives that overlaps the
        backward pass counts too: this is the share of the window the data path was busy, an
        upper bound on what communication cost the step.
        """
        seconds = self._stopped()["collective_s"]
        return seconds / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def negotiate_fraction(self) -> float:
        """Seconds in negotiation (waiting for the slowest rank included) / wall seconds."""
        seconds = self._stopped()["negotiate_s"]
        return seconds / self.wall_s if self.wall_s > 0 else 0.0

    def __enter__(self) -> "StatsWindow":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def stats_window(process_set=None) -> StatsWindow:
    """A window over the counters: `with mpidp.stats_window() as w: <steps>` then read
    w.comm_fraction, w.negotiate_fraction, w.wall_s and w.stats (the counters of the window).

    Not collective: each rank measures its own engine. Windows may nest or overlap.
    """
    return StatsWindow(process_set)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline (open it in Perfetto or chrome://tracing).

    Rank 0 writes `file_path` (replacing a timeline already running); on other ranks this only
    checks the arguments. Not collective: the engine starts recording at its next cycle. An
    unwritable path raises OSError on rank 0.
    """
    if not isinstance(file_path, (str, os.PathLike)) or not os.fspath(file_path):
        raise ValueError(f"start_timeline: file_path must be a non-empty path, not {file_path!r}")
    engine = world.state().engine
    if engine.rank != 0:
        return
    timeline = Timeline(os.fspath(file_path), bool(mark_cycles))
    old, engine.timeline = engine.timeline, timeline
    if old is not None:
        old.close()


def stop_timeline() -> None:
    """Stop the timeline and close its file (then valid JSON); a no-op when none runs.

    Not collective; only rank 0 has something to stop. Events of the cycle running at the time
    of the call may be left out.
    """
    engine = world.state().engine
    old, engine.timeline = engine.timeline, None
    if old is not None:
        old.close()
