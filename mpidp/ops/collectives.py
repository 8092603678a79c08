"""Blocking collectives, differentiable where Horovod's are (allreduce, allgather, ...)."""

import functools

import torch

from . import allreduce_ops, autograd, express, gather_ops, op_args, submission
from .allreduce_ops import Average
from .compression import Compression, cast_wire
from .eager import eager
from .waits import synchronize


def _blocking(fn):
    """The call synchronizes what it submits: submissions leave the engine thread asleep and
    synchronize() runs the cycles on the caller's thread if the engine is idle."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        before = submission.set_blocking(True)
        try:
            return fn(*args, **kwargs)
        finally:
            submission.set_blocking(before)

    return eager(call)


def _wants_grad(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


def _compressed(rule, start, tensor, compression, name, op, pre, post, ps):
    """Compress, reduce (through the autograd `rule` when a gradient is wanted, else the async
    `start` and a wait), decompress."""
    wire, ctx = compression.compress(tensor)
    if _wants_grad(wire):
        out = rule.apply(wire, name, op, pre, post, ps)
    else:
        out = synchronize(
            start(
                wire, name=name, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps
            )
        )
    return compression.decompress(out, ctx)


def _cast_reduced(tensors, compression, name, op, pre, post, ps):
    """The reduced copies of `tensors` when `compression` is a cast the data path does itself
    (cast_wire): each 16-bit piece is made just before it travels and cast back as soon as it
    is reduced, on the engine thread, bitwise what compress, reduce and decompress give. None
    where compress and decompress must run. Synchronization: waits for the op."""
    wire = cast_wire(compression, tensors, op)
    if wire is None:
        return None
    outs = [torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t) for t in tensors]
    handle = allreduce_ops.cast_allreduce_async_(
        outs, wire, name=name, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps
    )
    return synchronize(handle)


@eager
def allreduce(
    tensor,
    average=None,
    name=None,
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
):
    """Reduce `tensor` across ranks into a new tensor; differentiable.
    Synchronization: blocks until every rank has submitted `name` and the reduction is done."""
    op = op_args.resolve_op(average, op, "allreduce")
    if name is not None and compression is Compression.none and not _wants_grad(tensor):
        out = express.allreduce(
            tensor, name, op, prescale_factor, postscale_factor, process_set, False
        )
        if out is not None:
            return out
    return _allreduce(tensor, compression, name, op, prescale_factor, postscale_factor, process_set)


@_blocking
def _allreduce(tensor, compression, name, op, prescale_factor, postscale_factor, process_set):
    if not _wants_grad(tensor):
        outs = _cast_reduced(
            [tensor], compression, name, op, prescale_factor, postscale_factor, process_set
        )
        if outs is not None:
            return outs[0]
    return _compressed(
        autograd.Allreduce,
        allreduce_ops.allreduce_async,
        tensor,
        compression,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
    )


@eager
def allreduce_(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
):
    """Reduce `tensor` in place across ranks; returns it. Synchronization: as allreduce."""
    if name is not None and average is None:
        out = express.allreduce(
            tensor, name, op, prescale_factor, postscale_factor, process_set, True
        )
        if out is not None:
            return out
    return _allreduce_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)


@_blocking
def _allreduce_(tensor, average, name, op, prescale_factor, postscale_factor, process_set):
    return synchronize(
        allreduce_ops.allreduce_async_(
            tensor, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )


@_blocking
def grouped_allreduce(
    tensors,
    average=None,
    name=None,
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
):
    """Reduce a list of tensors, submitted atomically; returns new tensors; differentiable.
    Blocks until every rank has submitted the group."""
    tensors = list(tensors)
    if not any(_wants_grad(t) for t in tensors):
        op = op_args.resolve_op(average, op, "grouped_allreduce")
        average = None
        outs = _cast_reduced(
            tensors, compression, name, op, prescale_factor, postscale_factor, process_set
        )
        if outs is not None:
            return outs
    wire = [compression.compress(t) for t in tensors]
    if any(_wants_grad(w) for w, _ in wire):
        op = op_args.resolve_op(average, op, "grouped_allreduce")
        outs = autograd.GroupedAllreduce.apply(
            name, op, prescale_factor, postscale_factor, process_set, *[w for w, _ in wire]
        )
    else:
        outs = synchronize(
            allreduce_ops.grouped_allreduce_async(
                [w for w, _ in wire],
                average,
                name,
                op,
                prescale_factor,
                postscale_factor,
                process_set,
            )
        )
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, wire)]


@_blocking
def grouped_allreduce_(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
):
    """In-place form of grouped_allreduce. Blocks."""
    return synchronize(
        allreduce_ops.grouped_allreduce_async_(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )


@_blocking
def allgather(tensor, name=None, process_set=None):
    """Concatenate every rank's tensor along dim 0 (dim 0 may differ); differentiable. Blocks."""
    if _wants_grad(tensor):
        return autograd.Allgather.apply(tensor, name, process_set)
    return synchronize(gather_ops.allgather_async(tensor, name=name, process_set=process_set))


@_blocking
def grouped_allgather(tensors, name=None, process_set=None):
    """Allgather a list, submitted atomically; differentiable (each tensor as allgather).
    Blocks."""
    if any(_wants_grad(t) for t in tensors):
        return list(autograd.GroupedAllgather.apply(name, process_set, *tensors))
    return synchronize(
        gather_ops.grouped_allgather_async(tensors, name=name, process_set=process_set)
    )


@_blocking
def broadcast(tensor, root_rank, name=None, process_set=None):
    """Copy of global rank `root_rank`'s tensor on every rank; input untouched; differentiable.
    Synchronization: blocks until every rank (of the set) has submitted `name`."""
    if _wants_grad(tensor):
        return autograd.Broadcast.apply(tensor, root_rank, name, process_set)
    return synchronize(
        gather_ops.broadcast_async(tensor, root_rank, name=name, process_set=process_set)
    )


@_blocking
def broadcast_(tensor, root_rank, name=None, process_set=None):
    """Overwrite `tensor` with global rank `root_rank`'s; returns it. Blocks."""
    return synchronize(
        gather_ops.broadcast_async_(tensor, root_rank, name=name, process_set=process_set)
    )


@_blocking
def alltoall(tensor, splits=None, name=None, process_set=None):
    """Send splits[i] rows to rank i (of the set); returns the received rows, plus the received
    splits when `splits` is given; differentiable. Blocks."""
    if _wants_grad(tensor):
        out, received = autograd.Alltoall.apply(tensor, splits, name, process_set)
        return (out, received) if splits is not None else out
    return synchronize(
        gather_ops.alltoall_async(tensor, splits=splits, name=name, process_set=process_set)
    )


def _compressor(compression, what: str):
    """Horovod's third positional argument of reducescatter is compression=, not op=."""
    if not hasattr(compression, "compress"):
        raise TypeError(
            f"{what}: compression must be a compressor such as "
            f"Compression.fp16, not {compression!r}; the arguments follow Horovod's "
            f"order (tensor, name, compression, op, process_set, prescale_factor, "
            f"postscale_factor): pass op= by keyword"
        )
    return compression


@_blocking
def reducescatter(
    tensor,
    name=None,
    compression=Compression.none,
    op=Average,
    process_set=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """Reduce across ranks and keep this rank's rows of dim 0; differentiable. Arguments in
    Horovod's order. Blocks until every rank (of the set) has submitted `name`."""
    return _compressed(
        autograd.Reducescatter,
        gather_ops.reducescatter_async,
        tensor,
        _compressor(compression, "reducescatter"),
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
    )


@_blocking
def grouped_reducescatter(
    tensors,
    name=None,
    compression=Compression.none,
    op=Average,
    process_set=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """Reduce-scatter a list, submitted atomically; differentiable (each tensor as
    reducescatter). Arguments in Horovod's order. Blocks."""
    wire = [_compressor(compression, "grouped_reducescatter").compress(t) for t in tensors]
    if any(_wants_grad(w) for w, _ in wire):
        outs = list(
            autograd.GroupedReducescatter.apply(
                name, op, prescale_factor, postscale_factor, process_set, *[w for w, _ in wire]
            )
        )
    else:
        outs = synchronize(
            gather_ops.grouped_reducescatter_async(
                [w for w, _ in wire], name, op, prescale_factor, postscale_factor, process_set
            )
        )
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, wire)]
