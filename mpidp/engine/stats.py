"""Engine counters: cheap per-cycle and per-batch tallies that mpidp.stats() reads as a snapshot."""

import time
from typing import Any, Dict

from .messages import OP_NAMES, OpType

# What each key of a snapshot means; mpidp.stats() documents itself from this table.
KEYS = {
    "cycles": "engine cycles run (idle ones included)",
    "slow_cycles": "cycles that negotiated through the coordinator (gather/bcast at rank 0)",
    "cache_hits": "ops negotiated by their response-cache bit alone (the fast path)",
    "cache_misses": "ops negotiated through the coordinator (first use, changed metadata, "
    "cache off or full)",
    "collectives": "data-path calls: one per fused batch or unfused op",
    "fused_collectives": "collectives that carried more than one tensor",
    "tensors": "tensors those collectives carried (joined ranks' zeros included)",
    "tensors_per_collective": "tensors / collectives (0.0 before the first)",
    "bytes": "payload bytes of those tensors (each rank's own input; allgather: this rank's part)",
    "wire_bytes": "bytes of the buffers this rank handed to those collectives, in the width "
    "they travel: as `bytes`, but a value reduced in a wider type counts that "
    "type's size, and padding counts",
    "negotiate_s": "seconds in negotiation calls, waiting for peers included (the one in "
    "progress too)",
    "collective_s": "seconds in the data path (pack, MPI call, unpack, scaling; the batch in "
    "progress too)",
    "wall_s": "seconds since the counters started (init() or the last reset)",
    "by_op": "per op kind ('allreduce', ...): {'collectives', 'tensors', 'bytes'}",
}


class EngineStats:
    """Written by the engine thread only (`baseline` aside); readers take `snapshot()`, which
    needs no lock because every field is a number updated by one writer (a snapshot may
    straddle one cycle)."""

    __slots__ = (
        "cycles",
        "slow_cycles",
        "cache_hits",
        "cache_misses",
        "collectives",
        "fused_collectives",
        "tensors",
        "bytes",
        "negotiate",
        "collective",
        "op_collectives",
        "op_tensors",
        "op_bytes",
        "wire_bytes",
        "started",
        "baseline",
    )

    def __init__(self):
        self.cycles = 0
        self.slow_cycles = 0
        self.cache_hits = 0
        self.cache_misses = 0
        self.collectives = 0
        self.fused_collectives = 0
        self.tensors = 0
        self.bytes = 0
        self.wire_bytes = 0  # counted by the data path, which alone knows the width
        # (seconds so far, start of the one in progress or 0.0), replaced whole so a reader
        # on another thread sees both halves of one moment: a window then counts only the
        # part of a long negotiation (an engine waiting for peers) that falls inside it.
        self.negotiate = (0.0, 0.0)
        self.collective = (0.0, 0.0)
        # Indexed by OpType: a list index costs less than a dict update per batch.
        self.op_collectives = [0] * len(OpType)
        self.op_tensors = [0] * len(OpType)
        self.op_bytes = [0] * len(OpType)
        self.started = time.monotonic()
        self.baseline = None  # set by mpidp.stats(reset=True) on the user's side

    def begin_negotiation(self, now: float) -> None:
        self.negotiate = (self.negotiate[0], now)

    def end_negotiation(self, now: float) -> None:
        total, since = self.negotiate
        self.negotiate = (total + now - since, 0.0)

    def begin_batch(self, now: float) -> None:
        self.collective = (self.collective[0], now)

    def batch(self, op: int, tensors: int, nbytes: int, seconds: float) -> None:
        """One data-path call of `tensors` tensors and `nbytes` bytes took `seconds`."""
        self.collective = (self.collective[0] + seconds, 0.0)
        self.collectives += 1
        if tensors > 1:
            self.fused_collectives += 1
        self.tensors += tensors
        self.bytes += nbytes
        self.op_collectives[op] += 1
        self.op_tensors[op] += tensors
        self.op_bytes[op] += nbytes

    def snapshot(self) -> Dict[str, object]:
        """The counters as a plain dict (keys: KEYS)."""
        by_op = {}
        for op in OpType:
            if self.op_collectives[op]:
                by_op[OP_NAMES[op]] = {
                    "collectives": self.op_collectives[op],
                    "tensors": self.op_tensors[op],
                    "bytes": self.op_bytes[op],
                }
        now = time.monotonic()
        spent = []
        for total, since in (self.negotiate, self.collective):
            spent.append(total + (now - since if since else 0.0))
        collectives = self.collectives
        tensors = self.tensors
        return {
            "cycles": self.cycles,
            "slow_cycles": self.slow_cycles,
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "collectives": collectives,
            "fused_collectives": self.fused_collectives,
            "tensors": tensors,
            "tensors_per_collective": tensors / collectives if collectives else 0.0,
            "bytes": self.bytes,
            "wire_bytes": self.wire_bytes,
            "negotiate_s": spent[0],
            "collective_s": spent[1],
            "wall_s": now - self.started,
            "by_op": by_op,
        }


class BatchBytes:
    """Payload bytes of a batch, remembered per response: cached responses come back as the
    same objects cycle after cycle, and a dict hit costs a third of recomputing the size."""

    _LIMIT = 4096  # unnamed or uncached ops bring new names forever: start over past this

    def __init__(self, nbytes):
        self._nbytes = nbytes  # Response -> bytes
        self._memo: Dict[str, tuple] = {}

    def __call__(self, batch) -> int:
        memo = self._memo
        total = 0
        for resp in batch:
            hit = memo.get(resp.name)
            if hit is None or hit[0] is not resp:
                if len(memo) >= self._LIMIT:
                    memo.clear()
                hit = memo[resp.name] = (resp, self._nbytes(resp))
            total += hit[1]
        return total


def difference(now: Dict[str, Any], base: Dict[str, Any]) -> Dict[str, Any]:
    """Counters accumulated between two snapshots (`base` taken first), in snapshot form."""
    out: Dict[str, Any] = {}
    for key, value in now.items():
        if key == "by_op":
            ops = {}
            for op, counts in value.items():
                old = base["by_op"].get(op, {})
                delta = {k: v - old.get(k, 0) for k, v in counts.items()}
                if delta["collectives"]:
                    ops[op] = delta
            out[key] = ops
        elif key != "tensors_per_collective":
            out[key] = value - base[key]
    out["tensors_per_collective"] = (
        out["tensors"] / out["collectives"] if out["collectives"] else 0.0
    )
    return out
