"""mpidp.engine.timeline: the Chrome-trace writer's JSON, event content and crash-safe layout."""

import json
import subprocess
import sys
import time
import types

import pytest

from mpidp.engine import timeline as tlm
from mpidp.engine.messages import OpType, Request, Response


def check_trace_format(events):
    tlm.validate(events)


def _entry(name, submitted):
    return types.SimpleNamespace(
        request=Request(name, OpType.ALLREDUCE, "float32", (4,)), submitted=submitted
    )


def _resp(name, op=OpType.ALLREDUCE):
    return Response(name, op, Request(name, op, "float32", (4,)))


def _rows(events):
    return {
        ev["args"]["name"]: ev["tid"]
        for ev in events
        if ev["ph"] == "M" and ev["name"] == "thread_name"
    }


def _record_two_ops(tl):
    t = time.monotonic()
    tl.drained([_entry("a", t), _entry("b", t + 0.001)], t + 0.002)
    tl.arrived(0, [_entry("a", 0).request], [0.003], t + 0.005)
    tl.arrived(1, [_entry("a", 0).request], [0.004], t + 0.005)
    tl.negotiated([_resp("a")], t + 0.006, "coordinator")
    tl.negotiated([_resp("b")], t + 0.007, "cache")
    time.sleep(0.01)  # the batch really runs after the made-up times above
    start = time.monotonic()
    tl.mark("pack")
    tl.mark("mpi")
    tl.batch_end([_resp("a"), _resp("b")], start, time.monotonic(), 32)
    tl.cycle(t + 0.002, time.monotonic(), 2)


def test_closed_timeline_is_valid_json_with_every_phase(tmp_path):
    path = tmp_path / "tl.json"
    tl = tlm.Timeline(str(path), mark_cycles=True)
    _record_two_ops(tl)
    tl.close()
    text = path.read_text()
    assert text.rstrip().endswith("]")
    events = json.loads(text)
    check_trace_format(events)
    rows = _rows(events)
    assert set(rows) == {"a", "b", tlm.CYCLE_ROW}
    assert rows[tlm.CYCLE_ROW] == 0
    by_row = {
        name: [ev for ev in events if ev.get("tid") == tid and ev["ph"] != "M"]
        for name, tid in rows.items()
    }
    assert [ev["name"] for ev in by_row["a"] if ev["ph"] == "X"] == [
        "queue",
        "negotiate",
        "allreduce",
        "pack",
        "mpi",
        "unpack",
    ]
    nego = next(ev for ev in by_row["a"] if ev["name"] == "negotiate")
    assert nego["args"]["path"] == "coordinator" and nego["args"]["arrival_order"] == [1, 0]
    arrivals = [ev for ev in by_row["a"] if ev["name"] == "arrive"]
    assert sorted(ev["args"]["rank"] for ev in arrivals) == [0, 1]
    # Rank 1's request waited 4 ms, rank 0's 3 ms: rank 1 submitted 1 ms earlier.
    by_rank = {ev["args"]["rank"]: ev["ts"] for ev in arrivals}
    assert by_rank[0] - by_rank[1] == pytest.approx(1000.0, abs=1.0)
    nego_b = next(ev for ev in by_row["b"] if ev["name"] == "negotiate")
    assert nego_b["args"] == {"path": "cache", "op": "allreduce"}
    queue_b = next(ev for ev in by_row["b"] if ev["name"] == "queue")
    assert queue_b["dur"] == pytest.approx(1000.0, abs=1.0)
    op = next(ev for ev in by_row["b"] if ev["name"] == "allreduce")
    assert op["args"] == {"tensors": 2, "bytes": 32, "batch": ["a", "b"]}
    for name in ("a", "b"):
        spans = [
            ev["ts"]
            for ev in by_row[name]
            if ev["ph"] == "X" and ev["name"] in ("queue", "negotiate", "allreduce")
        ]
        assert spans == sorted(spans)
    cycles = [ev for ev in by_row[tlm.CYCLE_ROW]]
    assert [ev["name"] for ev in cycles] == ["cycle"] and cycles[0]["args"] == {"responses": 2}


def test_without_mark_cycles_there_is_no_cycle_row_and_no_phases(tmp_path):
    path = tmp_path / "tl.json"
    tl = tlm.Timeline(str(path))
    t = time.monotonic()
    tl.drained([_entry("x", t)], t)
    tl.negotiated([_resp("x")], t, "cache")
    tl.batch_end([_resp("x")], t, t + 0.001, 16)
    tl.cycle(t, t + 0.001, 1)
    tl.close()
    events = json.loads(path.read_text())
    check_trace_format(events)
    assert set(_rows(events)) == {"x"}
    assert {ev["name"] for ev in events if ev["ph"] == "X"} == {"queue", "negotiate", "allreduce"}


def test_times_before_the_start_are_clamped_to_it(tmp_path):
    path = tmp_path / "tl.json"
    tl = tlm.Timeline(str(path))
    t = time.monotonic()
    tl.drained([_entry("early", t - 5.0)], t)
    tl.negotiated([_resp("early")], t + 0.001, "cache")
    tl.close()
    events = json.loads(path.read_text())
    check_trace_format(events)
    queue = next(ev for ev in events if ev["name"] == "queue")
    assert queue["ts"] == 0.0 and queue["dur"] < 1e6


def test_ops_unknown_to_the_timeline_get_no_queue_or_negotiation(tmp_path):
    path = tmp_path / "tl.json"
    tl = tlm.Timeline(str(path))
    t = time.monotonic()
    tl.negotiated([_resp("late")], t, "cache")  # drained before the timeline started
    tl.batch_end([_resp("late")], t, t, 0)
    tl.close()
    tl.close()  # idempotent
    names = [ev["name"] for ev in json.loads(path.read_text()) if ev["ph"] == "X"]
    assert names == ["allreduce"]


def test_error_response_is_noted_in_the_negotiation(tmp_path):
    path = tmp_path / "tl.json"
    tl = tlm.Timeline(str(path))
    t = time.monotonic()
    tl.drained([_entry("bad", t)], t)
    tl.negotiated([Response("bad", OpType.ERROR, None, error="shape differs")], t, "coordinator")
    tl.close()
    nego = [ev for ev in json.loads(path.read_text()) if ev["name"] == "negotiate"]
    assert nego[0]["args"]["error"] == "shape differs" and nego[0]["args"]["op"] == "error"


def test_events_after_close_are_dropped_and_the_file_stays_valid(tmp_path):
    path = tmp_path / "tl.json"
    tl = tlm.Timeline(str(path))
    tl.close()
    _record_two_ops(tl)
    assert json.loads(path.read_text()) == [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "mpidp rank 0"}}
    ]


def test_unwritable_path_raises_at_once(tmp_path):
    with pytest.raises(OSError):
        tlm.Timeline(str(tmp_path / "missing" / "tl.json"))


_KILLED = """
import os, signal, sys, time
from mpidp.engine import timeline as tlm
from mpidp.engine.messages import OpType, Request, Response
tl = tlm.Timeline(sys.argv[1])
for i in range(200):
    t = time.monotonic()
    tl.batch_end([Response(f"t{i}", OpType.ALLREDUCE, Request(f"t{i}", 0, "float32", (1,)))],
                 t, t, 4)
time.sleep(4 * tlm._FLUSH_S)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_process_leaves_a_loadable_array(tmp_path):
    path = tmp_path / "tl.json"
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(path)], timeout=60)
    assert proc.returncode == -9
    text = path.read_text()
    assert text.startswith("[\n") and not text.rstrip().endswith("]")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    events = json.loads(text + "]")  # what Perfetto's and Chrome's loaders do
    assert events == tlm.load(str(path))
    check_trace_format(events)
    assert {ev["name"] for ev in events if ev["ph"] == "X"} == {"allreduce"}
    assert len([ev for ev in events if ev["ph"] == "X"]) == 200


def test_load_reads_a_closed_file_too(tmp_path):
    path = tmp_path / "tl.json"
    tl = tlm.Timeline(str(path))
    tl.close()
    assert tlm.load(str(path)) == json.loads(path.read_text())


@pytest.mark.parametrize(
    "bad",
    [
        {"ph": "B", "name": "x", "pid": 0, "tid": 1, "ts": 0},  # phase we never write
        {"ph": "X", "name": "x", "pid": 0, "tid": 1, "ts": 0},  # X without dur
        {"ph": "X", "name": "x", "pid": 0, "tid": 1, "ts": -1, "dur": 1},  # negative time
        {"ph": "X", "name": "x", "pid": 0, "tid": "1", "ts": 0, "dur": 1},  # tid not an integer
        {"ph": "i", "name": "x", "pid": 0, "tid": 1, "ts": 0},  # instant without scope
        {"ph": "M", "name": "thread_name", "pid": 0, "args": {"name": "x"}},  # no tid
    ],
)
def test_validate_rejects_events_viewers_cannot_place(bad):
    with pytest.raises(ValueError):
        tlm.validate([bad])


def test_validate_rejects_spans_that_overlap_without_nesting():
    row = [
        {"ph": "X", "name": "a", "pid": 0, "tid": 1, "ts": 0, "dur": 10},
        {"ph": "X", "name": "b", "pid": 0, "tid": 1, "ts": 5, "dur": 10},
    ]
    with pytest.raises(ValueError, match="overlaps"):
        tlm.validate(row)
    row[1]["tid"] = 2  # on another row they may overlap
    assert tlm.validate(row) == {"X": 2}
    row[1].update(tid=1, dur=5)  # nested: fine
    assert tlm.validate(row) == {"X": 2}


_JOB = """
import os, signal, sys, time
import torch
import mpidp
mpidp.init()
for i in range(10):
    mpidp.allreduce(torch.ones(8), name=f"op{i}")
    mpidp.allreduce(torch.ones(8), name=f"op{i}")  # the cached fast path this time
time.sleep(1.0)  # past the writer's flush period
if mpidp.rank() == 0:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def test_a_job_killed_mid_run_leaves_a_timeline_viewers_can_read(tmp_path):
    from integration.launch import clean_shm, run, shm_files

    script = tmp_path / "job.py"
    script.write_text(_JOB)
    path = tmp_path / "tl.json"
    before = shm_files()
    try:
        result = run(2, script, env={"MPIDP_TIMELINE": str(path)}, timeout=120)
    finally:
        clean_shm(before)
    assert result.returncode != 0, result.output
    text = path.read_text()
    assert not text.rstrip().endswith("]")
    events = json.loads(text + "]")  # what Perfetto's and Chrome's loaders do
    assert events == tlm.load(str(path))
    tlm.validate(events)
    rows = _rows(events)
    assert set(rows) == {f"op{i}" for i in range(10)}
    paths = {ev["args"]["path"] for ev in events if ev["name"] == "negotiate"}
    assert paths == {"coordinator", "cache"}
