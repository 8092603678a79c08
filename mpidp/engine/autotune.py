"""Autotune: a coordinate search over fusion and cycle knobs, scored on live traffic by rank 0.

The search (`Tuner`) is pure: it is fed one score per sample and answers with the parameters to
run next. Scores are bytes reduced per second of wall time over a sample, so with a fixed amount
of gradient per step a higher score is more steps per second. The first `warmup` samples after
every switch are dropped (buffers regrow, the queue drains the old setting's backlog), and a
point's score is the median of its next `samples` samples, which shrugs off a noisy neighbour.

Coordinate search: starting from the configured values, each tuned knob in turn is set to each of
its candidates (the others held at the best values so far), and keeps its best candidate; points
already measured are not measured again. Then, if the best point is not the start point, the two
are rematched in alternation (CONFIRM_ROUNDS turns each), and the winner of the rematch is kept
for good: a point that won the search only because the machine was quiet while it ran does
not replace the hand-set values. With the default candidates that is at most 14 + 4 points.

`Sampler` is the engine's side on rank 0: it cuts the traffic into samples of `sample_s` seconds,
feeds the tuner and writes the CSV log. Agreement is the engine's job: it forces a coordinator
cycle and broadcasts the new parameters with that cycle's responses, so every rank switches
before executing the same batch.
"""

import csv
import statistics
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..log import logger

KiB, MiB = 1024, 1024 * 1024
# Turns in which the search's winner and the start point are measured again, alternately, before
# the winner replaces the start (0: trust the search).
CONFIRM_ROUNDS = 2

# Knobs autotune may change, with their candidates (start values are added to these).
SPACE: Dict[str, Tuple] = {
    "fusion_threshold_bytes": (1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 64 * MiB),
    "fuse_below_bytes": (16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB),
    "cycle_time_ms": (0.0, 1.0, 2.5, 5.0),
}
CSV_HEADER = (
    "time_s",
    "kind",
    "fusion_threshold_bytes",
    "fuse_below_bytes",
    "cycle_time_ms",
    "bytes_per_s",
)


def search_space(config, space: Dict[str, Tuple] = SPACE) -> Dict[str, List]:
    """Candidates per tunable knob, without the knobs the user set explicitly."""
    out = {}
    for field, values in space.items():
        if field in config.explicit:
            continue
        out[field] = sorted(set(values) | {getattr(config, field)})
    return out


class Tuner:
    """Coordinate search over `space` from `start`; call `record(score)` once per sample."""

    def __init__(
        self,
        start: Dict[str, object],
        space: Mapping[str, Sequence],
        warmup: int,
        samples: int,
        confirm: int = CONFIRM_ROUNDS,
    ):
        if samples < 1 or warmup < 0 or confirm < 0:
            raise ValueError("need samples >= 1, warmup >= 0 and confirm >= 0")
        self.warmup, self.samples, self.confirm = warmup, samples, confirm
        self.start = dict(start)
        self.order = [k for k in space if len(space[k]) > 1]
        self.space = {k: list(space[k]) for k in self.order}
        self.current = dict(start)
        self.best = dict(start)
        self.best_score: Optional[float] = None
        self.scores: Dict[tuple, float] = {}  # point -> median score
        self.done = not self.order
        self._queue: List[Dict[str, object]] = []
        self._knob = -1
        self.skip = warmup
        self._pending: List[float] = []
        self.confirming = False
        self._rematch: List[Dict[str, object]] = []
        self.rematch: Dict[tuple, List[float]] = {}  # start and best -> their rematch medians

    def _key(self, point: Dict[str, object]) -> tuple:
        return tuple(point[k] for k in sorted(point))

    def _next_point(self) -> Optional[Dict[str, object]]:
        """The next unmeasured point of the search, or None when the search is over."""
        while True:
            while self._queue:
                point = self._queue.pop(0)
                if self._key(point) not in self.scores:
                    return point
            self._knob += 1
            if self._knob >= len(self.order):
                return None
            knob = self.order[self._knob]
            self._queue = [dict(self.best, **{knob: v}) for v in self.space[knob]]

    def record(self, score: float) -> Optional[Dict[str, object]]:
        """Take one sample's score; returns the parameters to switch to, or None to stay."""
        if self.done:
            return None
        if self.skip > 0:
            self.skip -= 1
            return None
        self._pending.append(score)
        if len(self._pending) < self.samples:
            return None
        median = statistics.median(self._pending)
        self._pending = []
        nxt: Optional[Dict[str, object]]
        if self.confirming:
            nxt = self._rematch_step(median)
        else:
            self.scores[self._key(self.current)] = median
            if self.best_score is None or median > self.best_score:
                self.best, self.best_score = dict(self.current), median
            nxt = self._next_point()
            if nxt is None and self.confirm and self.best != self.start:
                # The search's points were measured minutes apart, under whatever load the
                # machine had then: before leaving the start point, rematch the two in turns.
                self.confirming = True
                self._rematch = [self.best, self.start] * self.confirm
                self.rematch = {self._key(self.best): [], self._key(self.start): []}
                nxt = self._rematch.pop(0)  # may be the current point: then no switch
            elif nxt is None:
                self.done = True
                nxt = self.best
        if nxt == self.current:
            return None
        self.current = dict(nxt)
        self.skip = self.warmup
        return dict(nxt)

    def _rematch_step(self, median: float) -> Dict[str, object]:
        self.rematch[self._key(self.current)].append(median)
        if self._rematch:
            return self._rematch.pop(0)
        self.done = True
        best = statistics.median(self.rematch[self._key(self.best)])
        start = statistics.median(self.rematch[self._key(self.start)])
        if start >= best:
            self.best, self.best_score = dict(self.start), start
        else:
            self.best_score = best
        return self.best


class Tuned:
    """The knobs autotune may change on one engine, and every switch made: (cycle, values).
    Every rank runs the same cycles, so a cycle count names the same cycle on every rank."""

    FIELDS = ("fusion_threshold_bytes", "fuse_below_bytes", "cycle_time_ms")
    fusion_threshold_bytes: int
    fuse_below_bytes: int
    cycle_time_ms: float

    def __init__(self, config):
        for field in self.FIELDS:
            setattr(self, field, getattr(config, field))
        self.switches: List[tuple] = []

    def values(self) -> dict:
        return {field: getattr(self, field) for field in self.FIELDS}

    def switch(self, params: dict, cycle: int) -> None:
        for field, value in params.items():
            setattr(self, field, value)
        self.switches.append((cycle, dict(params)))
        logger.debug("autotune: switched to %s at cycle %d", params, cycle)


class Sampler:
    """Rank 0's sampling: `poll` at each cycle start returns new parameters when it is time."""

    def __init__(self, config, start: Dict[str, object]):
        self.tuner = Tuner(
            start,
            search_space(config),
            config.autotune_warmup_samples,
            config.autotune_samples_per_point,
        )
        self.sample_s = config.autotune_sample_s
        self._log = None
        if config.autotune_log:
            self._log = open(config.autotune_log, "a", newline="", encoding="utf-8")
            self._csv = csv.writer(self._log)
            self._csv.writerow(CSV_HEADER)
        self._t0 = time.perf_counter()
        self._began: Optional[float] = None
        self._bytes0 = 0
        if self.tuner.done:
            logger.info("autotune: nothing to tune (every tunable knob was set explicitly)")

    @property
    def done(self) -> bool:
        """The search has ended (the best parameters are in force or on their way)."""
        return self.tuner.done

    @property
    def best(self) -> Dict[str, object]:
        return dict(self.tuner.best)

    def _write(self, kind: str, params: Dict[str, object], score: float, now: float) -> None:
        if self._log is not None:
            self._csv.writerow(
                [
                    f"{now - self._t0:.3f}",
                    kind,
                    params.get("fusion_threshold_bytes", ""),
                    params.get("fuse_below_bytes", ""),
                    params.get("cycle_time_ms", ""),
                    f"{score:.1f}",
                ]
            )
            self._log.flush()

    def poll(self, total_bytes: int, busy: bool) -> Optional[Dict[str, object]]:
        """`total_bytes` so far; `busy`: ops are in flight. Parameters to switch to, or None."""
        if self.tuner.done:
            return None
        now = time.perf_counter()
        if self._began is None:
            # A sample starts with traffic: an idle engine before training says nothing.
            if busy:
                self._began, self._bytes0 = now, total_bytes
            return None
        elapsed = now - self._began
        if elapsed < self.sample_s:
            return None
        moved = total_bytes - self._bytes0
        self._began, self._bytes0 = (now, total_bytes) if busy else (None, 0)
        if moved == 0:
            return None  # no traffic in the window: the program paused, not the knobs' fault
        score = moved / elapsed
        kind = (
            "warmup" if self.tuner.skip > 0 else ("rematch" if self.tuner.confirming else "sample")
        )
        self._write(kind, self.tuner.current, score, now)
        switch = self.tuner.record(score)
        if self.tuner.done:
            self._write("chosen", self.tuner.best, self.tuner.best_score or 0.0, now)
            logger.info(
                "autotune chose %s (%.1f MB/s; start point %s)",
                self.tuner.best,
                (self.tuner.best_score or 0.0) / 1e6,
                self._start_score(),
            )
            self.close()
        if switch is not None:
            self._began = None  # the next sample starts under the new parameters
        return switch

    def _start_score(self) -> str:
        first = next(iter(self.tuner.scores.values()), None)
        return "unmeasured" if first is None else f"{first / 1e6:.1f} MB/s"

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
