"""Asynchronous allreduce (plain, grouped, a bucket's) and the reduce ops: build entries, submit."""

from typing import List

import torch

from ..engine.dtypes import HALF
from ..engine.messages import OpType, ReduceOp, Request
from ..engine.tensor_queue import Entry
from ..runtime.process_sets import member_of
from .eager import eager
from .op_args import (
    check_reductions,
    check_tensors,
    op_name,
    parts_request,
    request,
    resolve_op,
    same_device,
)
from .submission import first_result, new_entry, only_result, submit

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM


# ---- allreduce ----


def _grouped_allreduce(
    tensors,
    average,
    name,
    op,
    prescale_factor,
    postscale_factor,
    inplace,
    process_set,
    what="allreduce",
    wire=None,
):
    """One op for the whole list when its tensors share dtype and device (the data path packs
    the small ones and reduces large ones in place), else one op per tensor. `wire`: the dtype
    the values travel in (cast_allreduce_async_), None for their own."""
    target = member_of(process_set, what)
    reduce_op = resolve_op(average, op, what, target[1].size)
    base, cacheable = op_name(name, what)
    one = len(tensors) == 1 and what == "allreduce"

    def label(i):  # tensor i's name in an error message, made only for one
        return base if one else f"{base}.{i}"

    checked = check_tensors(tensors, what, label, inplace)
    n_dtypes = check_reductions(checked, reduce_op, prescale_factor, postscale_factor, what, label)
    outs = checked if inplace else [torch.empty_like(t) for t in checked]
    same_device(checked, what)
    if not checked:
        return target, []
    if wire is not None:
        _check_wire(checked, wire, reduce_op, n_dtypes, what)
    if what == "allreduce" or n_dtypes > 1:
        entries = []
        for i, (t, out) in enumerate(zip(checked, outs)):
            req = request(
                label(i),
                cacheable,
                OpType.ALLREDUCE,
                t,
                reduce_op,
                prescale_factor,
                postscale_factor,
            )
            entries.append(new_entry(req, [t], [out]))
        return target, entries
    req = parts_request(
        base, cacheable, checked, reduce_op, prescale_factor, postscale_factor, wire=wire
    )
    return target, [new_entry(req, checked, outs)]


def _check_wire(tensors, wire, reduce_op, n_dtypes: int, what: str) -> None:
    """A clear error unless `tensors` may travel as `wire`: one floating dtype other than it,
    a 16-bit float wire, a reduction the data path runs on the cast values."""
    if wire not in HALF:
        raise ValueError(f"{what}: wire_dtype must be torch.float16 or torch.bfloat16, not {wire}")
    if n_dtypes > 1 or not tensors[0].is_floating_point() or tensors[0].dtype is wire:
        raise ValueError(
            f"{what}: the tensors must share one floating dtype other than the wire's "
            f"{wire} (got {sorted({str(t.dtype) for t in tensors})}); reduce the others "
            f"with grouped_allreduce_async_"
        )
    if reduce_op == Adasum:
        raise ValueError(
            f"{what}: Adasum runs on the tensors' own values; compress with "
            f"Compression.fp16 before it instead of a wire dtype"
        )


@eager
def allreduce_async(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
) -> int:
    """Start an allreduce into a new tensor; returns a handle. No synchronization until
    synchronize(handle), which blocks until every rank has submitted the same name."""
    target, entries = _grouped_allreduce(
        [tensor], average, name, op, prescale_factor, postscale_factor, False, process_set
    )
    return submit(target, entries, only_result)


@eager
def allreduce_async_(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
) -> int:
    """Start an in-place allreduce of `tensor`; returns a handle (see allreduce_async)."""
    target, entries = _grouped_allreduce(
        [tensor], average, name, op, prescale_factor, postscale_factor, True, process_set
    )
    return submit(target, entries, lambda results: tensor)


def _flatten(results):
    return [t for outs in results for t in outs]


@eager
def grouped_allreduce_async(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
) -> int:
    """Start allreduces of a list, submitted atomically; synchronize() returns a list."""
    target, entries = _grouped_allreduce(
        list(tensors),
        average,
        name,
        op,
        prescale_factor,
        postscale_factor,
        False,
        process_set,
        "grouped_allreduce",
    )
    return submit(target, entries, _flatten)


@eager
def grouped_allreduce_async_(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
) -> int:
    """In-place form of grouped_allreduce_async."""
    tensors = list(tensors)
    target, entries = _grouped_allreduce(
        tensors,
        average,
        name,
        op,
        prescale_factor,
        postscale_factor,
        True,
        process_set,
        "grouped_allreduce",
    )
    return submit(target, entries, lambda results: tensors)


@eager
def cast_allreduce_async_(
    tensors,
    wire_dtype,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
) -> int:
    """In-place allreduce of `tensors` (one floating dtype and device) as one op whose values
    travel as `wire_dtype` (float16 or bfloat16): the result of reducing the tensors cast to
    it, cast back. The data path casts them on the way, piece by piece where it can, so the
    casts overlap the transfer (Compression.fp16 does them on the caller's thread, whole).
    The training layer's path for a compressed gradient bucket. No synchronization until
    synchronize(handle), which blocks until every rank has submitted the same name."""
    tensors = list(tensors)
    target, entries = _grouped_allreduce(
        tensors,
        None,
        name,
        op,
        prescale_factor,
        postscale_factor,
        True,
        process_set,
        "cast_allreduce",
        wire_dtype,
    )
    return submit(target, entries, lambda results: tensors)


@eager
def bucket_allreduce_async_(
    request: Request, tensors: List[torch.Tensor], process_set=None, cache_key=None
) -> int:
    """Start an in-place allreduce of `tensors` under a request built earlier (by
    parts_request, from tensors of these shapes and dtype): the training layer's path for a
    gradient bucket, which skips the per-tensor checks its first submission made."""
    target = member_of(process_set, "DistributedOptimizer")
    return submit(target, [Entry(request, tensors, tensors, None, cache_key)], first_result)
