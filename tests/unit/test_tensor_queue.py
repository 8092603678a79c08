"""tensor_queue.TensorQueue: duplicate names, atomic push, finished(), close()."""

import pytest
import torch

from mpidp.engine.handles import Handle
from mpidp.engine.messages import OpType, Request
from mpidp.engine.tensor_queue import Entry, TensorQueue
from mpidp.errors import EngineShutdownError


def entry(name, op=OpType.ALLREDUCE, cacheable=True):
    t = torch.zeros(3)
    return Entry(Request(name, op, "float32", (3,), cacheable=cacheable), t, t, Handle(name))


def test_entry_fields():
    e = entry("a")
    assert e.request.name == "a" and e.output is e.tensor
    assert e.handle.name == "a"
    assert e.bit == -1
    assert e.cache_key == e.request.cache_key()
    assert entry("b", cacheable=False).cache_key is None


def test_push_then_drain_in_order():
    q = TensorQueue()
    assert not q.has_new()
    es = [entry("a"), entry("b")]
    q.push(es)
    assert not q.wake.is_set()  # an engine that is mid-cycle is not woken
    q.sleeping = True
    q.push([entry("c")])
    assert q.has_new()
    assert q.wake.is_set()  # a sleeping one is
    assert [e.request.name for e in q.drain()] == ["a", "b", "c"]
    assert not q.has_new()
    assert q.drain() == []


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
    assert q.drain() == []
    # None of the names was reserved.
    q.push([entry("a"), entry("b")])
    assert [e.request.name for e in q.drain()] == ["a", "b"]


def test_push_is_atomic_when_one_name_is_in_flight():
    q = TensorQueue()
    q.push([entry("b")])
    q.drain()
    q.wake.clear()
    with pytest.raises(ValueError, match="'b'"):
        q.push([entry("a"), entry("b"), entry("c")])
    assert q.drain() == []
    assert not q.wake.is_set()
    # 'a' and 'c' were not reserved by the failed push.
    q.push([entry("a"), entry("c")])
    assert [e.request.name for e in q.drain()] == ["a", "c"]


def test_finished_frees_the_name():
    q = TensorQueue()
    q.push([entry("a")])
    q.drain()
    q.finished("a")
    q.push([entry("a")])
    assert [e.request.name for e in q.drain()] == ["a"]
    q.finished("never-submitted")  # harmless


def test_close_returns_undrained_and_push_raises_close_error():
    q = TensorQueue()
    q.push([entry("a")])
    q.drain()
    q.push([entry("b"), entry("c")])
    q.wake.clear()
    left = q.close(EngineShutdownError("engine stopped: test"))
    assert [e.request.name for e in left] == ["b", "c"]
    assert q.wake.is_set()
    assert q.drain() == []
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
