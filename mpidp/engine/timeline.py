"""Chrome-trace timeline by rank 0: per tensor, queue, negotiation (with arrivals), data phases.

File format (the Trace Event Format that Perfetto and chrome://tracing load): a JSON array of
events, one per line. Every event has "ph", "pid" (0), "tid", "ts" (microseconds since the
timeline started) and "name"; spans are complete events ("ph": "X" with "dur"), rank arrivals
are thread-scoped instant events ("ph": "i", "s": "t"), and metadata events ("ph": "M") name
each row. One row (tid) per tensor name, like Horovod's timeline; with mark_cycles, row 0 holds
one "cycle" span per engine cycle that did work.

On a tensor's row, in time order: "queue" (submitted on rank 0 until the engine drained it),
"negotiate" (drained until every rank agreed; "arrive" instants mark when each rank's request
submitted it, from the slow path's gather), then a span named after the op ("allreduce", ...)
while its batch ran, with "pack"/"mpi"/"unpack" phases nested in it when the data path reports
them through `mark`.

The file is written in batches by a writer thread, so the engine only appends tuples; a batch
reaches the file within milliseconds, so a job that is killed (a peer died) keeps what happened
before. It is valid JSON once `close()` ran (stop_timeline(), shutdown()). A process killed
before that leaves an array without its closing bracket, which the format allows (Perfetto and
chrome://tracing accept it); `load()` reads such a file by appending the bracket.
"""

import collections
import json
import threading
import time
from typing import Dict, List, Optional, Sequence

from ..config import TIMELINE_DYNAMIC
from ..log import logger
from .fusion import tensor_count
from .messages import OP_NAMES

# The writer wakes when events arrive, waits _COALESCE_S for the rest of the burst, and writes
# them: a job killed at once (a peer died and the launcher ended every rank) loses at most the
# last few milliseconds. Every _FLUSH_S it also writes what a wake-up may have missed.
_COALESCE_S = 0.005
_FLUSH_S = 0.25
_MAX_TENSORS_IN_ARGS = 64  # a fused batch lists at most this many names in its span's args
CYCLE_ROW = "engine cycles"


class Timeline:
    """Rank 0's event recorder. Engine thread: the `drained`..`batch_end` hooks (cheap appends).
    Writer thread: turns tuples into JSON lines and writes them within `_COALESCE_S` of their
    arrival."""

    def __init__(self, path: str, mark_cycles: bool = False):
        self.path = path
        self.mark_cycles = mark_cycles
        self._file = open(path, "w", encoding="utf-8")  # errors reach the caller at once
        self._file.write("[\n")
        self._file.flush()
        self._first = True
        self._t0 = time.monotonic()
        self._events: "collections.deque" = collections.deque()
        self._rows: Dict[str, int] = {}
        self._since: Dict[str, tuple] = {}  # name -> (submitted, drained) on rank 0
        self._arrived: Dict[str, list] = {}  # name -> [(rank, time)] on the slow path
        self._marks: List[tuple] = []  # (phase, time) reported during the current batch
        self._closed = False
        self._wake = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="mpidp-timeline", daemon=True)
        self._writer.start()
        self._emit(("M", "process_name", "", 0.0, 0.0, {"name": "mpidp rank 0"}))
        if mark_cycles:
            self._emit(("M", "thread_name", CYCLE_ROW, 0.0, 0.0, {"name": CYCLE_ROW}))

    # ---- engine-thread hooks ----

    def _emit(self, event: tuple) -> None:
        if not self._closed:
            idle = not self._events  # the first event of a burst wakes the writer
            self._events.append(event)
            if idle:
                self._wake.set()

    def drained(self, entries, now: float) -> None:
        """Rank 0's engine took these entries off the submission queue at `now`."""
        for entry in entries:
            self._since[entry.request.name] = (entry.submitted, now)

    def arrived(self, rank: int, requests: Sequence, ages: Sequence[float], now: float) -> None:
        """The coordinator received `rank`'s requests at `now` (slow path), each `age` seconds
        after that rank submitted it: the submission is placed at now - age on rank 0's clock
        (the gather is one moment for all ranks, give or take its latency)."""
        for req, age in zip(requests, ages):
            self._arrived.setdefault(req.name, []).append((rank, now - age))

    def negotiated(self, responses: Sequence, now: float, path: str) -> None:
        """Every rank agreed on `responses` at `now`, through `path` ('cache' or 'coordinator')."""
        for resp in responses:
            name = resp.name
            since = self._since.pop(name, None)
            arrivals = self._arrived.pop(name, ())
            if since is None:
                continue  # submitted before the timeline started, or rank 0 had joined
            submitted, drained = since
            self._emit(("X", "queue", name, submitted, drained - submitted, None))
            args: Dict[str, object] = {"path": path, "op": OP_NAMES.get(resp.op, "error")}
            if resp.error:
                args["error"] = resp.error
            if arrivals:
                arrivals = sorted(arrivals, key=lambda a: a[1])
                args["arrival_order"] = [rank for rank, _ in arrivals]
            self._emit(("X", "negotiate", name, drained, now - drained, args))
            for rank, when in arrivals:
                self._emit(("i", "arrive", name, when, 0.0, {"rank": rank}))

    def mark(self, phase: str) -> None:
        """Called by the data path: phase `phase` of the current batch ends now."""
        self._marks.append((phase, time.monotonic()))

    def batch_end(self, batch: Sequence, start: float, end: float, nbytes: int) -> None:
        """A batch ran from `start` to `end`: one op span per tensor, phases nested in it."""
        names = [resp.name for resp in batch]
        op = OP_NAMES.get(batch[0].op, "op")
        args = {
            "tensors": tensor_count(batch),
            "bytes": nbytes,
            "batch": names[:_MAX_TENSORS_IN_ARGS],
        }
        if len(batch) == 1 and batch[0].request is not None and batch[0].request.parts:
            # A bucket (one op over several tensors): one span, its tensors' shapes listed.
            args["shapes"] = [list(s) for s in batch[0].request.parts[:_MAX_TENSORS_IN_ARGS]]
        phases, last = [], start
        for phase, when in self._marks:
            if when < start:
                continue  # left over from a batch that failed
            phases.append((phase, last, when - last))
            last = when
        if phases:
            phases.append(("unpack", last, end - last))
        self._marks = []
        for name in names:
            self._emit(("X", op, name, start, end - start, args))
            for phase, t, dur in phases:
                self._emit(("X", phase, name, t, dur, None))

    def cycle(self, start: float, end: float, responses: int) -> None:
        if self.mark_cycles:
            self._emit(("X", "cycle", CYCLE_ROW, start, end - start, {"responses": responses}))

    # ---- writer ----

    def _row(self, name: str, out: List[str]) -> int:
        tid = self._rows.get(name)
        if tid is None:
            # Row 0 is the cycle row, so tensor rows keep their order below it.
            tid = 0 if name == CYCLE_ROW else len(self._rows) + 1
            self._rows[name] = tid
            out.append(
                json.dumps(
                    {"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": name}}
                )
            )
            out.append(
                json.dumps(
                    {
                        "ph": "M",
                        "name": "thread_sort_index",
                        "pid": 0,
                        "tid": tid,
                        "args": {"sort_index": tid},
                    }
                )
            )
        return tid

    def _format(self, event: tuple, out: List[str]) -> None:
        ph, name, row, t, dur, args = event
        if ph == "M":
            if name == "process_name":
                out.append(json.dumps({"ph": "M", "name": name, "pid": 0, "args": args}))
            else:
                self._row(row, out)
            return
        # Whole nanoseconds, so a span ending where the next begins never seems to overlap it.
        # What began before the timeline started (a queued op, a peer's early submission) is
        # shown as beginning with it: viewers want no negative times.
        start = max(0, round((t - self._t0) * 1e9))
        ev = {"ph": ph, "name": name, "pid": 0, "tid": self._row(row, out), "ts": start / 1e3}
        if ph == "X":
            ev["dur"] = (max(round((t + dur - self._t0) * 1e9), start) - start) / 1e3
        elif ph == "i":
            ev["s"] = "t"
        if args:
            ev["args"] = args
        out.append(json.dumps(ev))

    def _flush(self) -> None:
        out: List[str] = []
        events = self._events
        while events:
            self._format(events.popleft(), out)
        if not out:
            return
        # Each event on its own line, the separator before it: a file cut between two writes
        # is a valid array once "]" is appended.
        text = ("" if self._first else ",\n") + ",\n".join(out)
        self._first = False
        self._file.write(text)
        self._file.flush()

    def _write_loop(self) -> None:
        while not self._closed:
            if self._wake.wait(_FLUSH_S) and not self._closed:
                self._wake.clear()
                time.sleep(_COALESCE_S)
            self._flush()

    def close(self) -> None:
        """Write what is buffered, close the array and the file; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._writer.join()
        self._flush()
        self._file.write("\n]\n")
        self._file.close()


def from_start(config, set_id: int, rank: int) -> Optional[Timeline]:
    """The timeline an engine records from init() on: on rank 0 of the global set when the
    `timeline_path` knob names a file, else None. A file that cannot be written is logged, not
    raised: raising would leave the other ranks' engines waiting."""
    if config.timeline_path in ("", TIMELINE_DYNAMIC) or set_id != 0 or rank != 0:
        return None
    try:
        return Timeline(config.timeline_path, config.timeline_mark_cycles)
    except OSError as exc:
        logger.error(
            "timeline: cannot write %r (%s); running without a timeline", config.timeline_path, exc
        )
        return None


def load(path: str) -> List[dict]:
    """The events of a timeline file, also one cut short by a killed process (no closing ']')."""
    with open(path, encoding="utf-8") as f:
        text = f.read().rstrip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "\n]"
    return json.loads(text)


def validate(events) -> Dict[str, int]:
    """Check the Trace Event Format rules that Perfetto and chrome://tracing rely on, for the
    events this module writes; ValueError names the first event that breaks one. Returns how
    many events of each phase there are.

    Rules: a list of objects; "ph" one of X, i, M; "name" a string; "pid" and (except on
    process metadata) "tid" integers; "ts" and X's "dur" numbers >= 0 in microseconds; an
    instant's scope "s" one of g, p, t; "args" an object; and the complete events of one row
    nest: a span that starts inside another ends inside it too (viewers drop the rest).
    """
    if not isinstance(events, list):
        raise ValueError("a trace is a JSON array of events")
    counts: Dict[str, int] = {}
    rows: Dict[int, list] = {}
    for ev in events:
        if (
            not isinstance(ev, dict)
            or ev.get("ph") not in ("X", "i", "M")
            or not isinstance(ev.get("name"), str)
            or type(ev.get("pid")) is not int
            or not isinstance(ev.get("args", {}), dict)
        ):
            raise ValueError(f"malformed event {ev!r}")
        counts[ev["ph"]] = counts.get(ev["ph"], 0) + 1
        if ev["ph"] == "M" and ev["name"] == "process_name":
            continue
        if type(ev.get("tid")) is not int:
            raise ValueError(f"event without an integer tid: {ev!r}")
        if ev["ph"] == "M":
            if ev["name"] not in ("thread_name", "thread_sort_index"):
                raise ValueError(f"unknown metadata event {ev!r}")
            continue
        ts, dur = ev.get("ts"), ev.get("dur", 0)
        if (
            not isinstance(ts, (int, float))
            or ts < 0
            or not isinstance(dur, (int, float))
            or dur < 0
            or (ev["ph"] == "X" and "dur" not in ev)
        ):
            raise ValueError(f"bad ts/dur in {ev!r}")
        if ev["ph"] == "i" and ev.get("s") not in ("g", "p", "t"):
            raise ValueError(f"instant event without scope g/p/t: {ev!r}")
        if ev["ph"] == "X":
            rows.setdefault(ev["tid"], []).append((ts, ts + dur, ev["name"]))
    for tid, spans in rows.items():
        stack: list = []
        for begin, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= begin + 1e-6:
                stack.pop()
            if stack and end > stack[-1][1] + 1e-6:
                raise ValueError(
                    f"row {tid}: {name!r} at {begin} us overlaps {stack[-1]} without nesting in it"
                )
            stack.append((begin, end, name))
    return counts
