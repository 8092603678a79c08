"""The tensor queue: submissions from user threads, drained by the engine at each cycle."""

import threading
import time
from typing import List, Optional

import torch

from .handles import Handle
from .messages import Request, op_label


class Entry:
    """A submitted op as the engine holds it: request, tensors and handle."""

    __slots__ = ("request", "tensor", "output", "handle", "extra", "submitted", "bit", "cache_key")

    def __init__(self, request: Request, tensor: Optional[torch.Tensor],
                 output: Optional[torch.Tensor], handle: Handle, extra=None):
        self.request = request
        self.tensor = tensor      # input (None for barrier/join)
        self.output = output      # where the result goes (is `tensor` when in place)
        self.handle = handle
        self.extra = extra        # op-specific: alltoall splits
        self.submitted = time.monotonic()
        self.bit = -1             # response-cache bit while waiting on the fast path
        self.cache_key = request.cache_key() if request.cacheable else None


class TensorQueue:
    """Thread-safe submission queue; rejects a name that is already in flight."""

    def __init__(self):
        self._lock = threading.Lock()
        self._new: List[Entry] = []
        self._in_flight = set()
        self._closed: Optional[BaseException] = None
        self.wake = threading.Event()  # set on submission so a sleeping engine starts a cycle
        self.sleeping = False  # the engine is (about to be) waiting on `wake`

    def push(self, entries: List[Entry]) -> None:
        """Enqueue atomically (a grouped op is all or nothing); raise on duplicate names."""
        with self._lock:
            if self._closed is not None:
                raise type(self._closed)(*self._closed.args)
            names = [e.request.name for e in entries]
            for entry in entries:
                if entry.request.name in self._in_flight or names.count(entry.request.name) > 1:
                    raise ValueError(
                        f"{op_label(entry.request)}: an op with this name is already in flight "
                        f"on this rank; synchronize it first or give each op a unique name")
            self._in_flight.update(names)
            self._new.extend(entries)
        # Waking an engine that is mid-cycle is wasted work (it drains the queue next cycle
        # anyway) and takes the GIL from a burst of submissions.
        if self.sleeping:
            self.wake.set()

    def drain(self) -> List[Entry]:
        with self._lock:
            new, self._new = self._new, []
            return new

    def has_new(self) -> bool:
        return bool(self._new)

    def finished(self, name: str) -> None:
        with self._lock:
            self._in_flight.discard(name)

    def close(self, error: BaseException) -> List[Entry]:
        """Refuse later submissions with `error`; return what was queued but not drained."""
        with self._lock:
            self._closed = error
            new, self._new = self._new, []
            self._in_flight.clear()
        self.wake.set()
        return new
