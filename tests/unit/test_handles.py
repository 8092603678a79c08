"""handles.Handle and HandleTable: completion, errors, timeouts and spent handles."""

import threading

import pytest

from mpidp.engine.handles import Handle, HandleTable
from mpidp.errors import CollectiveError, EngineShutdownError, MismatchError, OpTimeoutError


def test_result_after_set_result():
    h = Handle("a")
    assert not h.done()
    h.set_result(42)
    assert h.done()
    assert h.wait() == 42
    assert h.wait(0) == 42


def test_wait_timeout_raises_op_timeout_and_stays_pending():
    h = Handle("grad.w")
    with pytest.raises(OpTimeoutError, match="'grad.w'.*still pending") as info:
        h.wait(0.01)
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, CollectiveError)
    assert not h.done()
    h.set_result("late")
    assert h.wait(0.01) == "late"


def test_a_waiter_ends_even_when_another_waiter_kept_the_lock(monkeypatch):
    """Completion releases the lock once; a waiter whose Ctrl-C lands between taking it and
    passing it on keeps it. The other waiters still end, by the done flag."""
    import mpidp.engine.handles as handles

    monkeypatch.setattr(handles, "_LOOK_S", 0.05)
    h = Handle("shared")
    seen = []
    waiter = threading.Thread(target=lambda: seen.append(h.wait()))
    waiter.start()
    # As set_result, but the release went to a waiter that was interrupted before passing it on.
    h._result, h._done = "value", True
    waiter.join(5)
    assert not waiter.is_alive() and seen == ["value"]


def test_set_error_then_wait_raises_that_type_with_same_message():
    h = Handle("a")
    err = MismatchError("allreduce 'a': rank 0 sent ...")
    h.set_error(err)
    assert h.done()
    with pytest.raises(MismatchError, match="rank 0 sent") as info:
        h.wait()
    # A fresh copy per waiter, so tracebacks do not accumulate on a shared object.
    assert info.value is not err
    with pytest.raises(MismatchError):
        h.wait()


def test_first_error_wins():
    h = Handle("a")
    h.set_error(EngineShutdownError("first"))
    h.set_error(MismatchError("second"))
    with pytest.raises(EngineShutdownError, match="first"):
        h.wait()


def test_error_after_result_is_ignored():
    h = Handle("a")
    h.set_result(1)
    h.set_error(EngineShutdownError("late"))
    assert h.wait() == 1


def test_wait_wakes_when_completed_from_another_thread():
    h = Handle("a")
    timer = threading.Timer(0.02, h.set_result, args=("done",))
    timer.start()
    try:
        assert h.wait(5.0) == "done"
    finally:
        timer.cancel()


# ---- HandleTable ----


def test_register_poll_wait():
    table = HandleTable()
    a, b = Handle("a"), Handle("b")
    hid = table.register([a, b], lambda results: tuple(results))
    assert isinstance(hid, int)
    assert table.poll(hid) is False
    a.set_result(1)
    assert table.poll(hid) is False
    b.set_result(2)
    assert table.poll(hid) is True
    assert table.wait(hid) == (1, 2)


def test_ids_are_distinct_and_increasing():
    table = HandleTable()
    ids = [table.register([Handle(str(i))], list) for i in range(5)]
    assert ids == sorted(set(ids))


def test_handle_is_spent_after_successful_wait():
    table = HandleTable()
    h = Handle("a")
    h.set_result(7)
    hid = table.register([h], lambda r: r[0])
    assert table.wait(hid) == 7
    with pytest.raises(ValueError, match="unknown"):
        table.wait(hid)
    with pytest.raises(ValueError, match="unknown"):
        table.poll(hid)


@pytest.mark.parametrize("bad", [12345, -1, None, "1", [1]])
def test_unknown_handle_raises_value_error(bad):
    table = HandleTable()
    table.register([Handle("a")], list)
    with pytest.raises(ValueError, match="unknown"):
        table.poll(bad)
    with pytest.raises(ValueError, match="unknown"):
        table.wait(bad)


def test_table_wait_timeout_keeps_handle_valid():
    table = HandleTable()
    h = Handle("a")
    hid = table.register([h], lambda r: r[0])
    with pytest.raises(OpTimeoutError):
        table.wait(hid, timeout=0.01)
    assert table.poll(hid) is False
    h.set_result("ok")
    assert table.wait(hid, timeout=0.01) == "ok"


def test_table_wait_timeout_covers_the_whole_group():
    table = HandleTable()
    a, b = Handle("a"), Handle("b")
    a.set_result(1)
    hid = table.register([a, b], list)
    with pytest.raises(OpTimeoutError, match="'b'"):
        table.wait(hid, timeout=0.01)
    b.set_result(2)
    assert table.wait(hid) == [1, 2]


def test_table_wait_error_spends_handle_and_raises_member_error():
    table = HandleTable()
    a, b = Handle("a"), Handle("b")
    a.set_result(1)
    b.set_error(MismatchError("bad b"))
    hid = table.register([a, b], list)
    assert table.poll(hid) is True
    with pytest.raises(MismatchError, match="bad b"):
        table.wait(hid)
    with pytest.raises(ValueError):
        table.wait(hid)


def test_finish_receives_results_in_member_order():
    table = HandleTable()
    hs = [Handle(str(i)) for i in range(4)]
    for i, h in reversed(list(enumerate(hs))):
        h.set_result(i * 10)
    hid = table.register(hs, lambda r: r)
    assert table.wait(hid) == [0, 10, 20, 30]


class _CompletesAsItTimesOut(Handle):
    """A member the engine completes just after its waiter's timeout ran out."""

    __slots__ = ()

    def wait(self, timeout=None):
        if timeout is not None and not self.done():
            self.set_result("late")
            raise OpTimeoutError("timed out")
        return super().wait(timeout)


def test_grouped_wait_with_member_completed_right_after_its_timeout_returns_results():
    table = HandleTable()
    first, second = Handle("g.0"), _CompletesAsItTimesOut("g.1")
    first.set_result("early")
    hid = table.register([first, second], lambda results: results)
    assert table.wait(hid, timeout=0.01) == ["early", "late"]
    with pytest.raises(ValueError, match="unknown"):
        table.poll(hid)


def test_grouped_wait_timeout_names_the_late_member_and_keeps_the_handle():
    table = HandleTable()
    first, second = Handle("g.0"), Handle("g.1")
    first.set_result(1)
    hid = table.register([first, second], lambda results: results)
    with pytest.raises(OpTimeoutError, match="'g.1'.*within 0.01 s"):
        table.wait(hid, timeout=0.01)
    second.set_result(2)
    assert table.wait(hid, timeout=0.01) == [1, 2]
