"""Timeline at run time and from MPIDP_TIMELINE: rank 0's Chrome-trace file and its content."""

import json
import os
import shutil
import tempfile

import pytest
import torch
from mpi_util import assert_all, raises_all, run_all

import mpidp
from mpidp.engine import timeline as tlm
from mpidp.runtime import observe, world

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def shared_dir():
    """A directory every rank names the same (rank 0 makes it; all ranks run on this host)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    path = comm.bcast(tempfile.mkdtemp(prefix="mpidp-tl-") if comm.rank == 0 else None, 0)
    yield path
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _ops(tag):
    size = mpidp.size()
    for _ in range(2):  # the second time through, cacheable ops take the fast path
        handles = [
            mpidp.allreduce_async_(torch.ones(16 * (i + 1)), name=f"{tag}.ar{i}") for i in range(3)
        ]
        for h in handles:
            mpidp.synchronize(h)
        mpidp.allgather(torch.ones(mpidp.rank() + 1, 2), name=f"{tag}.ag")
        mpidp.broadcast(torch.ones(3), root_rank=0, name=f"{tag}.bc")
        mpidp.alltoall(torch.ones(size, 2), name=f"{tag}.a2a")
        mpidp.reducescatter(torch.ones(size * 2), name=f"{tag}.rs")
    mpidp.allreduce(torch.ones(1 << 18), name=f"{tag}.big")  # not fused
    return [f"{tag}.ar{i}" for i in range(3)] + [
        f"{tag}.{s}" for s in ("ag", "bc", "a2a", "rs", "big")
    ]


def _rows(events):
    return {
        ev["args"]["name"]: ev["tid"]
        for ev in events
        if ev["ph"] == "M" and ev["name"] == "thread_name"
    }


def _check_content(path, names, mark_cycles):
    """Rank 0: the file is a valid trace holding every op's phases in order. '' if so."""
    with open(path) as f:
        text = f.read()
    events = json.loads(text)  # closed: valid JSON as it is
    tlm.validate(events)
    rows = _rows(events)
    problems = []
    if set(names) - set(rows):
        problems.append(f"rows missing: {set(names) - set(rows)}")
    if mark_cycles != (tlm.CYCLE_ROW in rows):
        problems.append(f"cycle row present: {tlm.CYCLE_ROW in rows}, wanted {mark_cycles}")
    size = mpidp.size()
    for name in names:
        mine = [ev for ev in events if ev.get("tid") == rows.get(name) and ev["ph"] != "M"]
        spans = [ev for ev in mine if ev["ph"] == "X"]
        kinds = [ev["name"] for ev in spans]
        op = name.rsplit(".", 1)[1]
        op = {"ag": "allgather", "bc": "broadcast", "a2a": "alltoall", "rs": "reducescatter"}.get(
            op, "allreduce"
        )
        for needed in ("queue", "negotiate", op):
            if needed not in kinds:
                problems.append(f"{name}: no {needed!r} span in {kinds}")
        top = [ev["ts"] for ev in spans if ev["name"] in ("queue", "negotiate", op)]
        if top != sorted(top):
            problems.append(f"{name}: spans out of order {kinds}")
        paths = [ev["args"]["path"] for ev in spans if ev["name"] == "negotiate"]
        if paths[:1] != ["coordinator"]:
            problems.append(f"{name}: first negotiation {paths[:1]}")
        arrivals = sorted(ev["args"]["rank"] for ev in mine if ev["name"] == "arrive")
        if arrivals[:size] != list(range(size)):
            problems.append(
                f"{name}: arrivals {arrivals}, wanted every rank once per coordinator negotiation"
            )
        if not name.endswith(".big") and "cache" not in paths:
            problems.append(f"{name}: never negotiated by the cache: {paths}")
        for ev in spans:
            if ev["name"] == op and name not in ev["args"]["batch"]:
                problems.append(f"{name}: its {op} span lists {ev['args']['batch']}")
    return "; ".join(problems)


def test_start_and_stop_at_run_time(shared_dir):
    path = os.path.join(shared_dir, "run.json")
    run_all(observe.start_timeline, path, mark_cycles=True)
    names = run_all(_ops, "tl.run")
    run_all(observe.stop_timeline)
    run_all(observe.stop_timeline)  # a second stop is a no-op
    exists = os.path.exists(path)
    assert_all(exists or mpidp.rank() != 0, "rank 0 wrote no file")
    problems = _check_content(path, names, mark_cycles=True) if mpidp.rank() == 0 else ""
    assert_all(not problems, problems)
    assert_all(world.state().engine.timeline is None, "timeline still attached")


def test_without_mark_cycles_and_restart_replaces_the_file(shared_dir):
    first = os.path.join(shared_dir, "first.json")
    second = os.path.join(shared_dir, "second.json")
    run_all(observe.start_timeline, first)
    run_all(_ops, "tl.first")
    run_all(observe.start_timeline, second)  # closes the first
    names = run_all(_ops, "tl.second")
    run_all(observe.stop_timeline)
    problems = ""
    if mpidp.rank() == 0:
        with open(first) as f:
            json.loads(f.read())  # closed by the restart: valid as it is
        problems = _check_content(second, names, mark_cycles=False)
        rows = _rows(json.loads(open(second).read()))
        if any(name.startswith("tl.first") for name in rows):
            problems += f"; the second file has the first's ops: {sorted(rows)}"
    assert_all(not problems, problems)


def test_data_path_phases_nest_in_the_collective(shared_dir):
    """HostBackend reports phase ends (pack, mpi) through backend.timeline_mark; with what
    follows the last mark (unpack) they appear nested in the op's span."""
    path = os.path.join(shared_dir, "phases.json")
    backend = world.state().engine.backend
    run_all(observe.start_timeline, path)
    handles = [mpidp.allreduce_async(torch.ones(8), name=f"tl.ph{i}") for i in range(4)]
    run_all(lambda: [mpidp.synchronize(h) for h in handles])
    run_all(observe.stop_timeline)
    run_all(mpidp.allreduce, torch.ones(2), name="tl.after")  # a cycle with data, no timeline
    problems = ""
    if mpidp.rank() == 0:
        events = json.loads(open(path).read())
        tlm.validate(events)  # nesting included
        rows = _rows(events)
        for i in range(4):
            kinds = [
                ev["name"]
                for ev in events
                if ev.get("tid") == rows[f"tl.ph{i}"] and ev["ph"] == "X"
            ]
            # A fused batch packs first; a tensor reduced on its own goes to MPI in place.
            tail = kinds[kinds.index("allreduce") :] if "allreduce" in kinds else kinds
            if tail not in (["allreduce", "pack", "mpi", "unpack"], ["allreduce", "mpi", "unpack"]):
                problems += f"tl.ph{i}: {kinds}; "
    assert_all(not problems, problems)
    assert_all(
        getattr(backend, "timeline_mark", "unset") is None or mpidp.rank() != 0,
        "the hook stays set after the timeline stopped",
    )


def test_bad_arguments_raise_on_every_rank():
    raises_all(ValueError, observe.start_timeline, "")
    raises_all(ValueError, observe.start_timeline, None)


def test_unwritable_path_raises_on_rank_zero_only():
    def start():
        try:
            observe.start_timeline("/nonexistent-dir/x/tl.json")
        except OSError:
            return "raised"
        return "ok"

    got = run_all(start)
    assert_all(got == ("raised" if mpidp.rank() == 0 else "ok"), got)
    assert_all(world.state().engine.timeline is None, "a timeline was attached")


def test_timeline_knob_at_init_is_closed_by_shutdown(shared_dir):
    path = os.path.join(shared_dir, "knob.json")
    mpidp.shutdown()
    try:
        mpidp.init(timeline_path=path, timeline_mark_cycles=True)
        names = run_all(_ops, "tl.knob")
    finally:
        mpidp.shutdown()
        mpidp.init()
    problems = _check_content(path, names, mark_cycles=True) if mpidp.rank() == 0 else ""
    assert_all(not problems, problems)


@pytest.mark.parametrize("var", ["MPIDP_TIMELINE", "HOROVOD_TIMELINE"])
def test_timeline_dynamic_writes_nothing_until_started(shared_dir, var, monkeypatch):
    """As in Horovod: DYNAMIC starts no timeline (and makes no file named DYNAMIC); a later
    start_timeline() records as usual."""
    cwd = os.getcwd()
    os.chdir(shared_dir)  # where a file named DYNAMIC would appear
    monkeypatch.setenv(var, "DYNAMIC")
    path = os.path.join(shared_dir, "later.json")
    mpidp.shutdown()
    try:
        mpidp.init()
        attached = world.state().engine.timeline is not None
        run_all(mpidp.allreduce, torch.ones(2), name="tl.dyn.before")
        made = os.path.exists(os.path.join(shared_dir, "DYNAMIC"))
        run_all(mpidp.start_timeline, path)
        names = run_all(_ops, "tl.dyn")
        run_all(mpidp.stop_timeline)
    finally:
        monkeypatch.delenv(var)
        mpidp.shutdown()
        mpidp.init()
        os.chdir(cwd)
    assert_all(not attached and not made, f"timeline attached {attached}, DYNAMIC file {made}")
    problems = _check_content(path, names, mark_cycles=False) if mpidp.rank() == 0 else ""
    assert_all(not problems, problems)
