"""The stall inspector (rank 0): names ops some ranks submitted and others not; when to give up."""

import os
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ..config import KNOBS, read_env
from ..log import logger
from .messages import ORDERED_PREFIX

Snapshot = Sequence[Tuple[str, float]]  # one rank's pending (name, age in seconds)


def _ranks(ranks) -> str:
    return ",".join(map(str, sorted(ranks)))


def _describe(name: str) -> str:
    """'allreduce float32[3, 4] (op 'torch.w.allreduce.float32[3, 4]#0')' from an ordered op's
    name (prefix, group, kind, signature, count)."""
    parts = name[len(ORDERED_PREFIX) :].split(".", 2)
    if len(parts) == 3:
        return f"{parts[1]} {parts[2].rsplit('#', 1)[0]} (op {name!r})"
    return repr(name)


def _variable(field: str) -> str:
    """The variable that set knob `field`: the user's HOROVOD_* alias if that is what they set."""
    knob = next(k for k in KNOBS if k.field == field)
    return read_env(knob, os.environ)[0] or knob.env


class StallInspector:
    """Warns of each stalled name, again every warning_s while it waits (as Horovod does);
    returns a shutdown reason once a stall outlives the limit."""

    def __init__(self, size: int, warning_s: float, shutdown_s: float, order_check_s: float = 0.0):
        self.size = size
        self.warning_s = warning_s
        self.shutdown_s = shutdown_s
        self.order_check_s = order_check_s
        self._warned: Dict[str, Tuple[float, float]] = {}  # name -> (stall began, warned at)
        self._last_raise = 0.0

    def enabled(self) -> bool:
        return self.warning_s > 0 or self.shutdown_s > 0

    def should_raise(self, oldest_age: float, ordered_age: float = 0.0) -> bool:
        """Whether this rank should ask for a stall check now (rate-limited): its oldest op
        waited past a stall limit, or its oldest ordered op (ORDERED_PREFIX) past
        order_check_s."""
        w, s, o = self.warning_s, self.shutdown_s, self.order_check_s
        # Past the smallest positive limit iff past some positive limit (checked every cycle).
        late = oldest_age > 0 and (0 < w <= oldest_age or 0 < s <= oldest_age)
        if not (late or (ordered_age > 0 and 0 < o <= ordered_age)):
            return False
        threshold = min(t for t in (w, s, o) if t > 0)
        now = time.monotonic()
        if now - self._last_raise >= min(1.0, threshold / 2):
            self._last_raise = now
            return True
        return False

    def disorder(self, snapshots: Dict[int, Snapshot], joined: Sequence[int]):
        """Ranks that wait on different ordered calls: (every pending ordered name, the error
        naming each rank's oldest call), or None. Ranks that make the same calls in the same
        order always share the oldest pending call of the last of them to arrive, so when every
        rank waits on ordered calls and none is common to all, they called different ones."""
        ranks = [r for r in range(self.size) if r not in set(joined)]
        ordered = {
            r: [(n, a) for n, a in snapshots.get(r, ()) if n.startswith(ORDERED_PREFIX)]
            for r in ranks
        }
        if len(ranks) < 2 or not all(ordered.values()):
            return None
        common = set.intersection(*({n for n, _ in items} for items in ordered.values()))
        if common:
            return None
        oldest: Dict[str, List[int]] = {}
        for r, items in ordered.items():
            oldest.setdefault(max(items, key=lambda item: item[1])[0], []).append(r)
        calls = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {_ranks(rs)} called {_describe(name)}"
            for name, rs in sorted(oldest.items(), key=lambda kv: kv[1])
        )
        names = sorted({n for items in ordered.values() for n, _ in items})
        return names, (
            f"ranks called different collectives: {calls}; every rank of a group "
            f"must make the same calls (collective, dtypes, shapes) in the same order"
        )

    def inspect(self, snapshots: Dict[int, Snapshot], joined: Sequence[int]) -> Optional[str]:
        """Log stalled names with their missing ranks; return a shutdown reason if one is due."""
        present: Dict[str, List[int]] = {}
        age: Dict[str, float] = {}
        for rank, items in snapshots.items():
            for name, a in items:
                present.setdefault(name, []).append(rank)
                age[name] = max(age.get(name, 0.0), a)
        stalled = []
        for name, ranks in present.items():
            missing = set(range(self.size)) - set(ranks) - set(joined)
            if missing:
                stalled.append((age[name], name, ranks, missing))
        stalled.sort(reverse=True)
        lines = [
            f"  {name!r}: waited {a:.1f} s; missing ranks {_ranks(missing)} "
            f"(submitted by {_ranks(ranks)})"
            for a, name, ranks, missing in stalled
        ]
        if self.warning_s > 0:
            # Forget names that completed; a name whose start moved on by more than
            # warning_s / 2 is a new stall.
            now = time.monotonic()
            self._warned = {n: w for n, w in self._warned.items() if n in present}
            fresh = []
            for (a, name, _, _), line in zip(stalled, lines):
                if a < self.warning_s:
                    continue
                start = now - a
                prev = self._warned.get(name)
                if prev is not None and start - prev[0] < self.warning_s / 2:  # warned of before
                    if now - prev[1] < self.warning_s:
                        continue
                    start = prev[0]
                self._warned[name] = (start, now)
                fresh.append(line)
            if fresh:
                logger.warning(
                    "stall: %d op(s) submitted by some ranks but not others for more than "
                    "%.0f s (a rank is slow, stuck, or submits different names; repeated every "
                    "%.0f s while they wait):\n%s",
                    len(fresh),
                    self.warning_s,
                    self.warning_s,
                    "\n".join(fresh),
                )
        if self.shutdown_s > 0 and stalled and stalled[0][0] >= self.shutdown_s:
            # Every rank gets this reason: name each stalled op, so that each finds its own.
            shown = ", ".join(
                f"op {name!r} waited {a:.1f} s for ranks {_ranks(missing)} "
                f"(submitted by {_ranks(ranks)})"
                for a, name, ranks, missing in stalled[:4]
            )
            more = f", and {len(stalled) - 4} more" if len(stalled) > 4 else ""
            return (
                f"stall: {shown}{more}; {_variable('stall_shutdown_s')}="
                f"{self.shutdown_s:g}: shutting the engine down"
            )
        return None
