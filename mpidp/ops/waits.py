"""Waiting on handles: poll() and synchronize(), the synchronization point of every async op."""

from typing import Optional

from ..runtime import world
from .eager import eager


@eager
def poll(handle: int) -> bool:
    """True once the op behind `handle` has completed (synchronize() will not block)."""
    return world.state().handles.poll(handle)


@eager
def synchronize(handle: int, timeout: Optional[float] = None):
    """Wait for the op behind `handle` and return its output (a tuple for alltoall with splits,
    a list for grouped ops). Raises the op's error, the same one on every rank. With `timeout`
    (seconds), raises OpTimeoutError and keeps the handle valid if the op is still pending."""
    state = world.state()
    if state.handles.poll(handle):
        return state.handles.wait(handle)
    engine = state.handles.owner(handle) or state.engine
    with engine.user_waiting():
        if timeout is None:  # a driving thread cannot give up half-way through a cycle
            engine.drive(state.handles.members(handle))
        return state.handles.wait(handle, timeout)


class CallableHandle(int):
    """A handle that is also Horovod's callable: `handle()` is `synchronize(handle)`.

    Horovod's sparse_allreduce_async returns a function that waits and returns the result, and
    scripts call it; an int underneath, so poll() and synchronize() take it as any handle."""

    __slots__ = ()

    def __call__(self):
        """Wait for the op and return its output. Synchronization: synchronize()'s."""
        return synchronize(self)


def when_done(handle: int, fn) -> None:
    """Call `fn()` once the op behind `handle` has completed (at once if it has): on the thread
    that completes it, inside the engine's cycle, so `fn` must only hand the news on (queue
    it), never block or wait for an op. synchronize(handle) then returns without waiting."""
    world.state().handles.when_done(handle, fn)
