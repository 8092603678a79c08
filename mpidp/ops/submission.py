"""Submission of checked entries to a process set's engine: blocking mode, handles, results."""

import contextlib
import threading
from typing import List

from ..engine.tensor_queue import Entry
from .op_args import UNNAMED

_local = threading.local()


@contextlib.contextmanager
def blocking():
    """Inside, submissions do not wake the engine thread: the caller is about to synchronize()
    and will run the engine's cycles itself if it is idle (Engine.drive)."""
    before = set_blocking(True)
    try:
        yield
    finally:
        set_blocking(before)


def set_blocking(flag: bool) -> bool:
    """Set whether this thread's submissions leave the engine asleep (see blocking());
    returns the previous setting."""
    before = getattr(_local, "blocking", False)
    _local.blocking = flag
    return before


def submit(target, entries: List[Entry], finish) -> int:
    state, member = target
    first = entries[0].request if entries else None
    if first is not None and not first.cacheable and first.name.startswith(UNNAMED):
        # Numbered only now, after validation: an op refused on one rank must not shift the
        # numbering that matches unnamed ops across ranks.
        number = member.auto_name()
        for entry in entries:
            entry.rename(entry.request.name.replace(UNNAMED, number, 1))
    member.engine.submit(entries, notify=not getattr(_local, "blocking", False))
    return state.handles.register(entries, finish, member.engine)


def new_entry(request, tensor, output, extra=None) -> Entry:
    return Entry(request, tensor, output, extra)


def first_result(results):
    return results[0]


def only_result(results):
    return results[0][0]
