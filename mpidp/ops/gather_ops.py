"""Asynchronous allgather, broadcast, alltoall and reducescatter: checks, then submission."""

import numpy as np
import torch

from ..engine.messages import OpType, ReduceOp
from ..errors import ArgumentError
from ..runtime.process_sets import member_of
from .eager import eager
from .op_args import (
    check_output,
    check_reduction,
    check_splits,
    check_tensor,
    op_name,
    request,
    resolve_op,
    same_device,
)
from .submission import first_result, new_entry, submit

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM


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


@eager
def allgather_async(tensor, name=None, process_set=None) -> int:
    """Start gathering every rank's tensor along dim 0 (dim 0 may differ); returns a handle."""
    target, entries = _allgather_entries([tensor], name, "allgather", process_set)
    return submit(target, entries, first_result)


@eager
def allgather_into_async(tensor, output, name=None, process_set=None) -> int:
    """Start gathering every rank's `tensor` (same shape on all) into `output`, rank r's as block
    r, in place if `tensor` is this rank's block; synchronize() returns `output`."""
    target, entries = _allgather_entries([tensor], name, "allgather", process_set)
    t = entries[0].tensor
    check_output(
        output,
        (target[1].size * t.shape[0],) + tuple(t.shape[1:]),
        t,
        f"allgather {entries[0].request.name!r}",
        target[1].rank,
    )
    entries[0].output = output
    return submit(target, entries, first_result)


@eager
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
        raise ValueError(
            f"{what} {base!r}: root_rank {root_rank} is out of range; the world "
            f"has ranks 0..{size - 1}"
        )
    if root_rank not in member.ranks:
        raise ValueError(
            f"{what} {base!r}: root_rank {root_rank} is not in process set "
            f"{member.set_id} (ranks {list(member.ranks)}); root_rank is a global "
            f"rank and must be a member"
        )
    out = t if inplace else torch.empty_like(t)
    req = request(base, cacheable, OpType.BROADCAST, t, root=member.ranks.index(root_rank))
    finish = (lambda results: tensor) if inplace else first_result
    return submit(target, [new_entry(req, t, out)], finish)


@eager
def broadcast_async(tensor, root_rank, name=None, process_set=None) -> int:
    """Start a broadcast from global rank `root_rank` into a new tensor (input untouched)."""
    return _broadcast(tensor, root_rank, name, False, process_set)


@eager
def broadcast_async_(tensor, root_rank, name=None, process_set=None) -> int:
    """Start an in-place broadcast from global rank `root_rank`."""
    return _broadcast(tensor, root_rank, name, True, process_set)


# ---- alltoall ----


@eager
def alltoall_async(tensor, splits=None, name=None, process_set=None) -> int:
    """Start an alltoall: rows splits[i] go to rank i (of the set). synchronize() returns the
    output, or (output, received_splits) when `splits` was given."""
    return alltoall_received_async(tensor, splits, name, process_set, splits is not None)


def alltoall_received_async(
    tensor, splits=None, name=None, process_set=None, received: bool = True
) -> int:
    """alltoall_async whose synchronize() returns (output, received_splits) even without
    `splits` (the gradient sends back what each rank received, which differs from what it
    sent when ranks hold different row counts); `received=False`: the output alone."""
    what = "alltoall"
    target = member_of(process_set, what)
    base, cacheable = op_name(name, what)
    t = check_tensor(tensor, f"{what} {base!r}", False)
    if t.dim() == 0:
        raise ArgumentError(f"{what} {base!r}: needs at least one dimension to split")
    size = target[1].size
    arr = None
    if splits is not None:
        arr = check_splits(splits, t, size, f"{what} {base!r}")
    elif t.shape[0] % size:
        raise ValueError(
            f"{what} {base!r}: dim 0 ({t.shape[0]}) does not divide evenly among "
            f"{size} ranks; pass splits="
        )
    req = request(base, cacheable, OpType.ALLTOALL, t)
    finish = first_result if received else (lambda results: results[0][0])
    return submit(target, [new_entry(req, t, None, arr)], finish)


# ---- reducescatter ----


def _reducescatter_entries(tensors, name, op, prescale_factor, postscale_factor, what, process_set):
    target = member_of(process_set, what)
    reduce_op = resolve_op(None, op, what)
    if reduce_op not in (Average, Sum):
        raise ArgumentError(
            f"{what}: reduce op {reduce_op.name.capitalize()} is not "
            f"supported; use mpidp.Average or mpidp.Sum"
        )
    base, cacheable = op_name(name, what)
    entries = []
    for i, tensor in enumerate(tensors):
        label = base if what == "reducescatter" else f"{base}.{i}"
        t = check_tensor(tensor, f"{what} {label!r}", False)
        if t.dim() == 0:
            raise ArgumentError(
                f"{what} {label!r}: cannot scatter a scalar; give a tensor "
                f"with at least one dimension"
            )
        check_reduction(t, reduce_op, prescale_factor, postscale_factor, f"{what} {label!r}")
        req = request(
            label, cacheable, OpType.REDUCESCATTER, t, reduce_op, prescale_factor, postscale_factor
        )
        entries.append(new_entry(req, t, None))
    same_device([e.tensor for e in entries], what)
    return target, entries


@eager
def reducescatter_async(
    tensor, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0, process_set=None
) -> int:
    """Start a reduce-scatter along dim 0; the first dim0 % size ranks get one extra row."""
    target, entries = _reducescatter_entries(
        [tensor], name, op, prescale_factor, postscale_factor, "reducescatter", process_set
    )
    return submit(target, entries, first_result)


@eager
def reducescatter_into_async(tensor, output, name=None, op=Average, process_set=None) -> int:
    """Start reducescatter_async's op with this rank's rows written into `output` (apart from
    `tensor`); synchronize() returns `output`."""
    target, entries = _reducescatter_entries(
        [tensor], name, op, 1.0, 1.0, "reducescatter", process_set
    )
    t, member = entries[0].tensor, target[1]
    rows = t.shape[0] // member.size + (member.rank < t.shape[0] % member.size)
    check_output(
        output, (rows,) + tuple(t.shape[1:]), t, f"reducescatter {entries[0].request.name!r}"
    )
    entries[0].output = output
    return submit(target, entries, first_result)


@eager
def grouped_reducescatter_async(
    tensors, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0, process_set=None
) -> int:
    """Reduce-scatter a list, submitted atomically; synchronize() returns a list."""
    target, entries = _reducescatter_entries(
        list(tensors),
        name,
        op,
        prescale_factor,
        postscale_factor,
        "grouped_reducescatter",
        process_set,
    )
    return submit(target, entries, list)
