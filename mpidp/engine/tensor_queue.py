"""The op record and the submission queue: every op in flight on this rank, in one table."""

import contextlib
import enum
import threading
import time
from typing import Dict, List, Optional

import torch

from .handles import Handle
from .messages import Request, op_label


def _outside_inference(tensor, output):
    """`tensor` and `output` (tensors, lists of them, or None) with each inference tensor (made
    under torch.inference_mode(), a setting of the submitting thread) replaced by a normal
    tensor on the same memory: the engine thread, outside inference mode, may then write and
    scale them in place, which torch refuses on inference tensors there."""
    aliases = {}

    def normal(t):
        if not isinstance(t, torch.Tensor) or not t.is_inference():
            return t
        if id(t) not in aliases:
            with torch.inference_mode(False):
                aliases[id(t)] = torch.from_dlpack(t)
        return aliases[id(t)]

    def each(x):
        return [normal(t) for t in x] if isinstance(x, list) else normal(x)

    return each(tensor), each(output)


_NO_CONTEXT = contextlib.nullcontext()


def normal_mode():
    """Outside inference mode for an engine cycle on a user thread that is in it: tensors the
    cycle makes and keeps (fusion buffers) must be normal ones, which the engine thread may
    write in place later."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else _NO_CONTEXT


class OpState(enum.IntEnum):
    """Where an op stands in negotiation (Entry.state); the engine and the protocol move it."""

    NEW = 0  # submitted, not yet admitted by the engine
    CACHED = 1  # waits on its response-cache bit in the band (Entry.bit)
    TO_SEND = 2  # its request goes to the coordinator at the next slow path
    SENT = 3  # its request is with the coordinator, which answers once every rank sent it


class Entry(Handle):
    """One in-flight op: the request, its tensors, where negotiation stands, and its completion.

    This is the only record of an op. The queue's `ops` table holds it from submission until the
    engine completes it; the user's integer handle (HandleTable) names it; stats and the
    timeline read it. For ALLREDUCE, `tensor` and `output` are lists (one tensor per part of
    the request); for every other op, single tensors (None for barrier and join).
    """

    __slots__ = ("request", "tensor", "output", "extra", "submitted", "state", "bit", "cache_key")

    def __init__(self, request: Request, tensor, output, extra=None, cache_key=None):
        Handle.__init__(self, request.name)
        if torch.is_inference_mode_enabled():
            tensor, output = _outside_inference(tensor, output)
        self.request = request
        self.tensor = tensor  # input
        self.output = output  # where the result goes (is `tensor` when in place)
        self.extra = extra  # op-specific: alltoall splits
        self.submitted = time.monotonic()
        self.state = OpState.NEW
        self.bit = -1  # response-cache bit while CACHED
        if cache_key is None and request.cacheable:
            cache_key = request.cache_key()
        self.cache_key = cache_key

    def rename(self, name: str) -> None:
        """Give an unnamed op the number it drew (before it is queued)."""
        self.request = self.request._replace(name=name)
        self.name = name


def is_block(tensor, output, index: int) -> bool:
    """Whether `tensor` is exactly block `index` of `output` (blocks of tensor's size, end to
    end): an allgather into `output` from it then runs in place, moving nothing locally."""
    return (
        tensor.dtype == output.dtype
        and tensor.is_contiguous()
        and output.is_contiguous()
        and tensor.data_ptr() == output.data_ptr() + index * tensor.numel() * tensor.element_size()
    )


def given_output(entry: Entry, dims):
    """The caller's output tensor of an allgather (ops.allgather_into_async), None if it gave
    none. It holds equal blocks, so every rank must have given the same first dimension."""
    if entry.output is None:
        return None
    if len(set(dims)) > 1:
        raise ValueError(
            f"{entry.request.name!r}: an allgather into an output tensor needs the "
            f"same first dimension on every rank; the ranks gave {list(dims)}"
        )
    return entry.output


def into_output(entry: Entry, result):
    """`result`, in the caller's output tensor when the op has one."""
    if entry.output is None or entry.output is result:
        return result
    entry.output.copy_(result)
    return entry.output


class TensorQueue:
    """Thread-safe table of in-flight ops plus the list of those the engine has not yet taken.

    `wake` is the condition an idle engine sleeps on; submissions notify it.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.wake = threading.Condition(self._lock)
        self.ops: Dict[str, Entry] = {}  # every op in flight on this rank, by name
        self._new: List[Entry] = []
        self._closed: Optional[BaseException] = None
        self._sleeping = False

    def push(self, entries: List[Entry], notify: bool = True) -> None:
        """Enqueue atomically (a grouped op is all or nothing); raise on duplicate names.
        `notify=False`: the caller drives the engine itself (see Engine.drive)."""
        with self._lock:
            if self._closed is not None:
                raise type(self._closed)(*self._closed.args)
            names = [e.request.name for e in entries]
            for entry in entries:
                if entry.request.name in self.ops or names.count(entry.request.name) > 1:
                    raise ValueError(
                        f"{op_label(entry.request)}: an op with this name is already in flight "
                        f"on this rank; synchronize it first or give each op a unique name"
                    )
            for entry in entries:
                self.ops[entry.request.name] = entry
            self._new.extend(entries)
            if notify and self._sleeping:
                self.wake.notify()

    def hold(self, entry: Entry) -> bool:
        """Record `entry` as in flight without queueing it (Engine.express runs it at once),
        if no other op is in flight; False otherwise, or once the queue is closed."""
        with self._lock:
            if self._closed is not None or self.ops or self._new:
                return False
            self.ops[entry.request.name] = entry
            return True

    def take_lone(self, entry: Entry) -> bool:
        """Take `entry` from the queue if it is the only op in flight and not yet taken (then
        as hold() had recorded it); False otherwise."""
        with self._lock:
            if self._closed is not None or len(self.ops) != 1 or self._new != [entry]:
                return False
            self._new = []
            return True

    def drain(self) -> List[Entry]:
        with self._lock:
            new, self._new = self._new, []
            return new

    def has_new(self) -> bool:
        return bool(self._new)

    def notify(self) -> None:
        with self._lock:
            self.wake.notify()

    def sleep(self, timeout: float, busy) -> None:
        """Block until a submission, notify() or `timeout`, unless `busy()` (called under the
        lock, so a submission cannot slip in between the check and the wait)."""
        with self._lock:
            if self._new or self._closed is not None or busy():
                return
            self._sleeping = True
            self.wake.wait(timeout)
            self._sleeping = False

    def finished(self, entry: Entry) -> None:
        with self._lock:
            if self.ops.get(entry.request.name) is entry:
                del self.ops[entry.request.name]

    def close(self, error: BaseException) -> List[Entry]:
        """Refuse later submissions with `error`; return every op still in flight."""
        with self._lock:
            self._closed = error
            left = list(self.ops.values())
            self.ops.clear()
            self._new = []
            self.wake.notify_all()
        return left
