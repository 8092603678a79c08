"""Completion of an op (set once by the engine, awaited by users) and the handles users hold."""

import itertools
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..errors import OpTimeoutError

_LOOK_S = 1.0  # how often a waiter looks at the done flag besides the lock (Handle.wait)


def _timed_out(name: str, timeout: float) -> OpTimeoutError:
    return OpTimeoutError(
        f"op {name!r} did not complete within {timeout:g} s and is still pending; call "
        f"synchronize() again, and check the other ranks (see mpidp's stall warning in the log)"
    )


class Handle:
    """Completion of one op; the engine calls `set_result` or `set_error` once.

    A held lock, released on completion, is a tenth of the cost of a threading.Event to create,
    and one is created per op per step. The engine's op record (tensor_queue.Entry) is one.
    """

    __slots__ = ("name", "_lock", "_done", "_result", "_error", "_then")

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self._result = None
        self._error: Optional[BaseException] = None
        self._then: Optional[Callable[["Handle"], None]] = None

    def done(self) -> bool:
        return self._done

    def set_result(self, result) -> None:
        self._result = result
        self._done = True
        self._lock.release()
        if self._then is not None:
            self._then(self)

    def set_error(self, error: BaseException) -> None:
        if not self._done:
            self._error = error
            self._done = True
            self._lock.release()
            if self._then is not None:
                self._then(self)

    def then(self, fn: Callable[["Handle"], None]) -> None:
        """Call `fn(self)` on completion, on the completing thread (at once if done already).
        `fn` may be called twice when completion races with this call: it must be idempotent."""
        self._then = fn
        if self._done:
            fn(self)

    def wait(self, timeout: Optional[float] = None):
        """Block until completed; raise its error (a fresh copy per waiter) or OpTimeoutError.

        Completion releases the lock once, and each waiter passes it on; a waiter whose Ctrl-C
        lands between taking and passing it keeps it, so waiters also look at the done flag
        every _LOOK_S rather than trusting the lock alone."""
        if not self._done:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._done:
                left = _LOOK_S
                if timeout is not None and deadline is not None:
                    left = min(left, deadline - time.monotonic())
                    if left <= 0:
                        raise _timed_out(self.name, timeout)
                if self._lock.acquire(timeout=left):
                    self._lock.release()  # let any other waiter through too
        if self._error is not None:
            raise type(self._error)(*self._error.args)
        return self._result


_IDS = itertools.count(1)


class HandleTable:
    """Integer handles as Horovod returns them: each names the ops (Entry records) of one call."""

    def __init__(self):
        # One count for the whole process (next() on it is atomic under the GIL): a handle
        # kept from before shutdown() and init() must not name a later op.
        self._ids = _IDS
        self._ops: Dict[int, Tuple[List[Handle], Callable[[list], Any], Any]] = {}

    def register(self, members: List[Handle], finish: Callable[[list], Any], owner=None) -> int:
        """A new handle for `members`; `owner` is whatever runs them (the process set's engine)."""
        hid = next(self._ids)
        self._ops[hid] = (members, finish, owner)
        return hid

    def owner(self, hid: int):
        return self._get(hid)[2]

    def members(self, hid: int) -> List[Any]:
        """The op's tensor_queue.Entry objects (Handles that carry the request too)."""
        return self._get(hid)[0]

    def _get(self, hid: int):
        try:
            return self._ops[hid]
        except (KeyError, TypeError):
            raise ValueError(
                f"handle {hid!r} is unknown: it was already synchronized, or it "
                f"belongs to an earlier init()"
            ) from None

    def when_done(self, hid: int, fn: Callable[[], None]) -> None:
        """Call `fn()` once, when every op of handle `hid` has completed: on the thread that
        completes the last one (the engine's, or a user thread driving it; at once if all are
        done). `fn` runs inside the engine's cycle: it must not block or wait for an op."""
        members = self._get(hid)[0]
        if not members:
            fn()
            return
        seen: set = set()
        lock = threading.Lock()

        def one(handle: Handle) -> None:
            with lock:
                if id(handle) in seen:
                    return
                seen.add(id(handle))
                last = len(seen) == len(members)
            if last:
                fn()

        for h in members:
            h.then(one)

    def poll(self, hid: int) -> bool:
        return all(h.done() for h in self._get(hid)[0])

    def wait(self, hid: int, timeout: Optional[float] = None):
        """Results of every member passed through the op's finish; the handle is then spent."""
        members, finish, _ = self._get(hid)
        deadline = None if timeout is None else time.monotonic() + timeout
        results = []
        try:
            for h in members:
                try:
                    results.append(
                        h.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                    )
                except OpTimeoutError:
                    # The engine may complete the member between the timed-out wait and this
                    # check; then the op is done and the handle is spent as usual.
                    if not h.done():
                        assert timeout is not None  # only a wait with a timeout times out
                        raise _timed_out(h.name, timeout) from None
                    results.append(h.wait(0))
        except OpTimeoutError:
            raise
        except BaseException:
            self._ops.pop(hid, None)
            raise
        self._ops.pop(hid, None)
        return finish(results)
