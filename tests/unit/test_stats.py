"""mpidp.engine.stats: counters, snapshots and their differences."""

from mpidp.engine import stats
from mpidp.engine.messages import OpType


def test_fresh_counters_are_zero_and_every_key_is_documented():
    snap = stats.EngineStats().snapshot()
    assert set(snap) == set(stats.KEYS)
    for key, value in snap.items():
        if key == "by_op":
            assert value == {}
        elif key != "wall_s":
            assert value == 0, key
    assert snap["wall_s"] >= 0.0


def test_batch_counts_collectives_tensors_bytes_and_time_per_op():
    st = stats.EngineStats()
    st.batch(OpType.ALLREDUCE, 5, 1000, 0.25)
    st.batch(OpType.ALLREDUCE, 1, 4096, 0.5)
    st.batch(OpType.ALLGATHER, 1, 12, 0.125)
    snap = st.snapshot()
    assert snap["collectives"] == 3
    assert snap["fused_collectives"] == 1
    assert snap["tensors"] == 7
    assert snap["tensors_per_collective"] == 7 / 3
    assert snap["bytes"] == 1000 + 4096 + 12
    assert snap["collective_s"] == 0.875
    assert snap["by_op"] == {
        "allreduce": {"collectives": 2, "tensors": 6, "bytes": 5096},
        "allgather": {"collectives": 1, "tensors": 1, "bytes": 12},
    }


def test_difference_counts_only_what_happened_in_between():
    st = stats.EngineStats()
    st.batch(OpType.ALLREDUCE, 4, 400, 1.0)
    st.cycles, st.cache_hits = 10, 4
    before = st.snapshot()
    st.batch(OpType.ALLREDUCE, 2, 200, 0.5)
    st.batch(OpType.BROADCAST, 1, 8, 0.25)
    st.cycles, st.cache_hits, st.cache_misses = 13, 6, 1
    st.begin_negotiation(5.0)
    st.end_negotiation(7.0)
    diff = stats.difference(st.snapshot(), before)
    assert diff["cycles"] == 3
    assert diff["cache_hits"] == 2 and diff["cache_misses"] == 1
    assert diff["collectives"] == 2 and diff["tensors"] == 3 and diff["bytes"] == 208
    assert diff["tensors_per_collective"] == 1.5
    assert diff["collective_s"] == 0.75 and diff["negotiate_s"] == 2.0
    assert diff["fused_collectives"] == 1
    assert diff["by_op"] == {
        "allreduce": {"collectives": 1, "tensors": 2, "bytes": 200},
        "broadcast": {"collectives": 1, "tensors": 1, "bytes": 8},
    }
    assert diff["wall_s"] >= 0.0


def test_difference_of_an_idle_window_has_no_ops_and_no_division_by_zero():
    st = stats.EngineStats()
    st.batch(OpType.ALLREDUCE, 2, 8, 0.1)
    snap = st.snapshot()
    diff = stats.difference(snap, snap)
    assert diff["collectives"] == 0 and diff["tensors_per_collective"] == 0.0
    assert diff["by_op"] == {}


def test_batch_bytes_remembers_sizes_per_response_object():
    from mpidp.engine import fusion
    from mpidp.engine.messages import Request, Response

    calls = []

    def nbytes(resp):
        calls.append(resp.name)
        return fusion.nbytes(resp)

    count = stats.BatchBytes(nbytes)
    a = Response("a", OpType.ALLREDUCE, Request("a", OpType.ALLREDUCE, "float32", (4, 2)))
    b = Response("b", OpType.ALLREDUCE, Request("b", OpType.ALLREDUCE, "float64", (3,)))
    assert count([a, b]) == 32 + 24
    assert count([a, b]) == 56 and calls == ["a", "b"]
    # Same name, new response (the tensor's shape changed): measured again.
    a2 = Response("a", OpType.ALLREDUCE, Request("a", OpType.ALLREDUCE, "int8", (5,)))
    assert count([a2]) == 5 and calls == ["a", "b", "a"]


def test_time_in_progress_counts_up_to_the_snapshot(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(stats.time, "monotonic", lambda: clock[0])
    st = stats.EngineStats()
    st.begin_negotiation(100.0)
    clock[0] = 103.0
    assert st.snapshot()["negotiate_s"] == 3.0  # still waiting for peers
    before = st.snapshot()
    clock[0] = 104.0
    st.end_negotiation(104.0)
    st.begin_batch(104.0)
    clock[0] = 104.5
    diff = stats.difference(st.snapshot(), before)
    # The window from 103 to 104.5 holds 1 s of negotiation and 0.5 s of an unfinished batch.
    assert diff["negotiate_s"] == 1.0 and diff["collective_s"] == 0.5 and diff["wall_s"] == 1.5
    st.batch(OpType.ALLREDUCE, 1, 4, 0.75)
    clock[0] = 110.0
    assert st.snapshot()["collective_s"] == 0.75
