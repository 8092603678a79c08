"""Asynchronous collectives on tensors: validate, enqueue, return a handle; poll and synchronize."""

import contextlib
import threading
from typing import List

import numpy as np
import torch

from .waits import poll, synchronize  # noqa: F401 (mpidp.ops is where users find them)
from .op_args import (UNNAMED, check_output, check_reduction, check_splits, check_tensor,
                      check_reductions, check_tensors, op_name, parts_request, request,
                      resolve_op, same_device)
from .process_sets import member_of
from .engine.messages import OpType, ReduceOp, Request
from .engine.tensor_queue import Entry

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM

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


def _only(results):
    return results[0][0]


# ---- allreduce ----

def _grouped_allreduce(tensors, average, name, op, prescale_factor, postscale_factor, inplace,
                       process_set, what="allreduce"):
    """One op for the whole list when its tensors share dtype and device (the data path packs
    the small ones and reduces large ones in place), else one op per tensor."""
    target = member_of(process_set, what)
    reduce_op = resolve_op(average, op, what, target[1].size)
    base, cacheable = op_name(name, what)
    one = len(tensors) == 1 and what == "allreduce"

    def label(i):  # tensor i's name in an error message, made only for one
        return base if one else f"{base}.{i}"
    checked = check_tensors(tensors, what, label, inplace)
    n_dtypes = check_reductions(checked, reduce_op, prescale_factor, postscale_factor, what,
                                label)
    outs = checked if inplace else [torch.empty_like(t) for t in checked]
    same_device(checked, what)
    if not checked:
        return target, []
    if what == "allreduce" or n_dtypes > 1:
        entries = []
        for i, (t, out) in enumerate(zip(checked, outs)):
            req = request(label(i), cacheable, OpType.ALLREDUCE, t, reduce_op, prescale_factor,
                          postscale_factor)
            entries.append(new_entry(req, [t], [out]))
        return target, entries
    req = parts_request(base, cacheable, checked, reduce_op, prescale_factor, postscale_factor)
    return target, [new_entry(req, checked, outs)]


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None) -> int:
    """Start an allreduce into a new tensor; returns a handle. No synchronization until
    synchronize(handle), which blocks until every rank has submitted the same name."""
    target, entries = _grouped_allreduce([tensor], average, name, op, prescale_factor,
                                        postscale_factor, False, process_set)
    return submit(target, entries, _only)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None) -> int:
    """Start an in-place allreduce of `tensor`; returns a handle (see allreduce_async)."""
    target, entries = _grouped_allreduce([tensor], average, name, op, prescale_factor,
                                        postscale_factor, True, process_set)
    return submit(target, entries, lambda results: tensor)


def _flatten(results):
    return [t for outs in results for t in outs]


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=None) -> int:
    """Start allreduces of a list, submitted atomically; synchronize() returns a list."""
    target, entries = _grouped_allreduce(list(tensors), average, name, op, prescale_factor,
                                        postscale_factor, False, process_set,
                                        "grouped_allreduce")
    return submit(target, entries, _flatten)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=None) -> int:
    """In-place form of grouped_allreduce_async."""
    tensors = list(tensors)
    target, entries = _grouped_allreduce(tensors, average, name, op, prescale_factor,
                                        postscale_factor, True, process_set,
                                        "grouped_allreduce")
    return submit(target, entries, lambda results: tensors)


def bucket_allreduce_async_(request: Request, tensors: List[torch.Tensor], process_set=None,
                            cache_key=None) -> int:
    """Start an in-place allreduce of `tensors` under a request built earlier (by
    parts_request, from tensors of these shapes and dtype): the training layer's path for a
    gradient bucket, which skips the per-tensor checks its first submission made."""
    target = member_of(process_set, "DistributedOptimizer")
    return submit(target, [Entry(request, tensors, tensors, None, cache_key)], first_result)


# ---- allgather ----

def _allgather_entries(tensors, name, what, process_set):
    target = member_of(process_set, what)
    base, cacheable = op_name(name, what)
    entries = []
    for i, tensor in enumerate(tensors):
        label = base if what == "allgather" else f"{base}.{i}"
        t = check_tensor(tensor, f"{what} {label!r}", False)
        if t.dim() == 0:
            t = t.reshape(1)
        entries.append(new_entry(request(label, cacheable, OpType.ALLGATHER, t), t, None))
    same_device([e.tensor for e in entries], what)
    return target, entries


def allgather_async(tensor, name=None, process_set=None) -> int:
    """Start gathering every rank's tensor along dim 0 (dim 0 may differ); returns a handle."""
    target, entries = _allgather_entries([tensor], name, "allgather", process_set)
    return submit(target, entries, first_result)


def allgather_into_async(tensor, output, name=None, process_set=None) -> int:
    """Start gathering every rank's `tensor` (same shape on all) into `output`, rank r's as block
    r, in place if `tensor` is this rank's block; synchronize() returns `output`."""
    target, entries = _allgather_entries([tensor], name, "allgather", process_set)
    t = entries[0].tensor
    check_output(output, (target[1].size * t.shape[0],) + tuple(t.shape[1:]), t,
                 f"allgather {entries[0].request.name!r}", target[1].rank)
    entries[0].output = output
    return submit(target, entries, first_result)


def grouped_allgather_async(tensors, name=None, process_set=None) -> int:
    """Start allgathers of a list, submitted atomically; synchronize() returns a list."""
    target, entries = _allgather_entries(list(tensors), name, "grouped_allgather", process_set)
    return submit(target, entries, list)


# ---- broadcast ----

def _broadcast(tensor, root_rank, name, inplace, process_set) -> int:
    what = "broadcast"
    target = member_of(process_set, what)
    member = target[1]
    base, cacheable = op_name(name, what)
    t = check_tensor(tensor, f"{what} {base!r}", inplace)
    size = target[0].comms.size
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise TypeError(f"{what} {base!r}: root_rank must be an int, got {root_rank!r}")
    if not 0 <= root_rank < size:
        raise ValueError(f"{what} {base!r}: root_rank {root_rank} is out of range; the world "
                         f"has ranks 0..{size - 1}")
    if root_rank not in member.ranks:
        raise ValueError(f"{what} {base!r}: root_rank {root_rank} is not in process set "
                         f"{member.set_id} (ranks {list(member.ranks)}); root_rank is a global "
                         f"rank and must be a member")
    out = t if inplace else torch.empty_like(t)
    req = request(base, cacheable, OpType.BROADCAST, t, root=member.ranks.index(root_rank))
    finish = (lambda results: tensor) if inplace else first_result
    return submit(target, [new_entry(req, t, out)], finish)


def broadcast_async(tensor, root_rank, name=None, process_set=None) -> int:
    """Start a broadcast from global rank `root_rank` into a new tensor (input untouched)."""
    return _broadcast(tensor, root_rank, name, False, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=None) -> int:
    """Start an in-place broadcast from global rank `root_rank`."""
    return _broadcast(tensor, root_rank, name, True, process_set)


# ---- alltoall ----

def alltoall_async(tensor, splits=None, name=None, process_set=None) -> int:
    """Start an alltoall: rows splits[i] go to rank i (of the set). synchronize() returns the
    output, or (output, received_splits) when `splits` was given."""
    what = "alltoall"
    target = member_of(process_set, what)
    base, cacheable = op_name(name, what)
    t = check_tensor(tensor, f"{what} {base!r}", False)
    if t.dim() == 0:
        raise ValueError(f"{what} {base!r}: needs at least one dimension to split")
    size = target[1].size
    arr = None
    if splits is not None:
        arr = check_splits(splits, t, size, f"{what} {base!r}")
    elif t.shape[0] % size:
        raise ValueError(f"{what} {base!r}: dim 0 ({t.shape[0]}) does not divide evenly among "
                         f"{size} ranks; pass splits=")
    req = request(base, cacheable, OpType.ALLTOALL, t)
    finish = first_result if splits is not None else (lambda results: results[0][0])
    return submit(target, [new_entry(req, t, None, arr)], finish)


# ---- reducescatter ----

def _reducescatter_entries(tensors, name, op, prescale_factor, postscale_factor, what,
                           process_set):
    target = member_of(process_set, what)
    reduce_op = resolve_op(None, op, what)
    if reduce_op not in (Average, Sum):
        raise ValueError(f"{what}: reduce op {reduce_op.name.capitalize()} is not supported; "
                         f"use mpidp.Average or mpidp.Sum")
    base, cacheable = op_name(name, what)
    entries = []
    for i, tensor in enumerate(tensors):
        label = base if what == "reducescatter" else f"{base}.{i}"
        t = check_tensor(tensor, f"{what} {label!r}", False)
        if t.dim() == 0:
            raise ValueError(f"{what} {label!r}: cannot scatter a scalar; give a tensor with "
                             f"at least one dimension")
        check_reduction(t, reduce_op, prescale_factor, postscale_factor, f"{what} {label!r}")
        req = request(label, cacheable, OpType.REDUCESCATTER, t, reduce_op, prescale_factor,
                       postscale_factor)
        entries.append(new_entry(req, t, None))
    same_device([e.tensor for e in entries], what)
    return target, entries


def reducescatter_async(tensor, name=None, op=Average, prescale_factor=1.0,
                        postscale_factor=1.0, process_set=None) -> int:
    """Start a reduce-scatter along dim 0; the first dim0 % size ranks get one extra row."""
    target, entries = _reducescatter_entries([tensor], name, op, prescale_factor,
                                            postscale_factor, "reducescatter", process_set)
    return submit(target, entries, first_result)


def reducescatter_into_async(tensor, output, name=None, op=Average, process_set=None) -> int:
    """Start reducescatter_async's op with this rank's rows written into `output` (apart from
    `tensor`); synchronize() returns `output`."""
    target, entries = _reducescatter_entries([tensor], name, op, 1.0, 1.0, "reducescatter",
                                            process_set)
    t, member = entries[0].tensor, target[1]
    rows = t.shape[0] // member.size + (member.rank < t.shape[0] % member.size)
    check_output(output, (rows,) + tuple(t.shape[1:]), t,
                 f"reducescatter {entries[0].request.name!r}")
    entries[0].output = output
    return submit(target, entries, first_result)


def grouped_reducescatter_async(tensors, name=None, op=Average, prescale_factor=1.0,
                                postscale_factor=1.0, process_set=None) -> int:
    """Reduce-scatter a list, submitted atomically; synchronize() returns a list."""
    target, entries = _reducescatter_entries(list(tensors), name, op, prescale_factor,
                                            postscale_factor, "grouped_reducescatter",
                                            process_set)
    return submit(target, entries, list)
