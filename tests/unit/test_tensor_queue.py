"""tensor_queue: the op record (Entry) and the queue's one table of ops in flight."""

import threading

import pytest
import torch

from mpidp.engine.messages import OpType, Request
from mpidp.engine.tensor_queue import Entry, OpState, TensorQueue
from mpidp.errors import EngineShutdownError


def entry(name, op=OpType.ALLREDUCE, cacheable=True):
    parts = [torch.zeros(3)]
    return Entry(Request(name, op, "float32", (3,), cacheable=cacheable), parts, parts)


def test_entry_fields():
    e = entry("a")
    assert e.request.name == "a" and e.output is e.tensor
    assert e.name == "a" and not e.done()
    assert e.state == OpState.NEW and e.bit == -1
    assert e.cache_key == e.request.cache_key()
    assert entry("b", cacheable=False).cache_key is None
    e.rename("noname.3")
    assert e.name == e.request.name == "noname.3"


def test_entry_is_its_own_completion():
    e = entry("a")
    e.set_result([1])
    assert e.done() and e.wait() == [1]


def test_push_then_drain_in_order_and_ops_table():
    q = TensorQueue()
    assert not q.has_new()
    es = [entry("a"), entry("b")]
    q.push(es)
    q.push([entry("c")])
    assert q.has_new()
    assert list(q.ops) == ["a", "b", "c"]
    assert [e.request.name for e in q.drain()] == ["a", "b", "c"]
    assert not q.has_new()
    assert q.drain() == []
    assert list(q.ops) == ["a", "b", "c"]  # drained ops stay in flight until finished


def test_sleep_returns_at_once_when_busy_or_new():
    q = TensorQueue()
    q.sleep(5.0, lambda: True)  # busy: no wait
    q.push([entry("a")])
    q.sleep(5.0, lambda: False)  # something new: no wait


def test_push_wakes_a_sleeper_unless_told_not_to():
    q = TensorQueue()
    woke = threading.Event()

    def sleeper():
        q.sleep(5.0, lambda: False)
        woke.set()

    t = threading.Thread(target=sleeper)
    t.start()
    try:
        for _ in range(200):  # until the sleeper waits
            if q._sleeping:
                break
            threading.Event().wait(0.005)
        q.push([entry("a")], notify=False)
        assert not woke.wait(0.1)
        q.notify()
        assert woke.wait(5.0)
    finally:
        q.notify()
        t.join(5.0)


def test_duplicate_name_in_flight_raises():
    q = TensorQueue()
    q.push([entry("a")])
    q.drain()  # drained but not finished: still in flight
    with pytest.raises(ValueError, match="allreduce 'a'.*already in flight"):
        q.push([entry("a")])


def test_duplicate_name_within_one_push_raises_and_enqueues_nothing():
    q = TensorQueue()
    with pytest.raises(ValueError, match="'a'"):
        q.push([entry("a"), entry("b"), entry("a")])
    assert q.drain() == [] and q.ops == {}
    q.push([entry("a"), entry("b")])
    assert [e.request.name for e in q.drain()] == ["a", "b"]


def test_push_is_atomic_when_one_name_is_in_flight():
    q = TensorQueue()
    q.push([entry("b")])
    q.drain()
    with pytest.raises(ValueError, match="'b'"):
        q.push([entry("a"), entry("b"), entry("c")])
    assert q.drain() == []
    q.push([entry("a"), entry("c")])
    assert [e.request.name for e in q.drain()] == ["a", "c"]


def test_finished_frees_the_name_only_for_that_record():
    q = TensorQueue()
    a = entry("a")
    q.push([a])
    q.drain()
    q.finished(entry("a"))  # another record of the same name: not the one in flight
    assert "a" in q.ops
    q.finished(a)
    q.push([entry("a")])
    assert [e.request.name for e in q.drain()] == ["a"]


def test_close_returns_every_op_in_flight_and_push_raises_close_error():
    q = TensorQueue()
    q.push([entry("a")])
    q.drain()
    q.push([entry("b"), entry("c")])
    left = q.close(EngineShutdownError("engine stopped: test"))
    assert sorted(e.request.name for e in left) == ["a", "b", "c"]
    assert q.drain() == [] and q.ops == {}
    with pytest.raises(EngineShutdownError, match="engine stopped: test"):
        q.push([entry("d")])
    with pytest.raises(EngineShutdownError):
        q.push([])


def test_close_raises_a_fresh_copy_each_time():
    q = TensorQueue()
    err = EngineShutdownError("x")
    q.close(err)
    with pytest.raises(EngineShutdownError) as first:
        q.push([entry("a")])
    assert first.value is not err


def test_op_states_are_one_enum_with_distinct_values():
    """The engine and the protocol share one set of states: no value stands for two."""
    assert len({int(s) for s in OpState}) == len(OpState) == 4
