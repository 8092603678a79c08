"""Blocking collectives, differentiable where Horovod's are (allreduce, allgather, broadcast, ...)."""

import functools

import torch

from . import ops, runtime
from .compression import Compression
from .ops import Average
from .process_sets import member_of


def _blocking(fn):
    """The call synchronizes what it submits: submissions leave the engine thread asleep and
    synchronize() runs the cycles on the caller's thread if the engine is idle."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with ops.blocking():
            return fn(*args, **kwargs)
    return call


def _wants_grad(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post, ps):
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, pre, post, ps
        return ops.synchronize(ops.allreduce_async(tensor, name=name, op=op,
                                                   prescale_factor=pre, postscale_factor=post,
                                                   process_set=ps))

    @staticmethod
    def backward(ctx, grad):
        # d(sum_r f_r)/dx is the same reduction of the incoming gradients.
        return ops.synchronize(ops.allreduce_async(
            grad, op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post,
            process_set=ctx.ps)), None, None, None, None, None


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, ps):
        ctx.dim0 = tensor.shape[0] if tensor.dim() else 1
        ctx.scalar = tensor.dim() == 0
        ctx.ps = ps
        return ops.synchronize(ops.allgather_async(tensor, name=name, process_set=ps))

    @staticmethod
    def backward(ctx, grad):
        # Horovod averages the gathered gradient, then each rank keeps its own rows.
        reduced = ops.synchronize(ops.allreduce_async(grad.contiguous(), op=Average,
                                                      process_set=ctx.ps))
        dims = ops.synchronize(ops.allgather_async(torch.tensor([ctx.dim0]), process_set=ctx.ps))
        offset = int(dims[: _rank(ctx.ps)].sum())
        part = reduced.narrow(0, offset, ctx.dim0)
        return (part.reshape(()) if ctx.scalar else part), None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, ps):
        ctx.root, ctx.ps = root_rank, ps
        return ops.synchronize(ops.broadcast_async(tensor, root_rank, name=name, process_set=ps))

    @staticmethod
    def backward(ctx, grad):
        reduced = ops.synchronize(ops.allreduce_async(grad.contiguous(), op=Average,
                                                      process_set=ctx.ps))
        if runtime.rank() != ctx.root:  # root_rank is a global rank
            reduced.zero_()
        return reduced, None, None, None


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, ps):
        ctx.dim0, ctx.ps = tensor.shape[0], ps
        out, received = ops.synchronize(ops.alltoall_async(
            tensor, splits=splits if splits is not None else _even_splits(tensor, ps), name=name,
            process_set=ps))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        back, _ = ops.synchronize(ops.alltoall_async(grad.contiguous(), splits=ctx.received,
                                                     process_set=ctx.ps))
        if back.shape[0] < ctx.dim0:  # rows this rank never sent get no gradient
            back = torch.cat([back, back.new_zeros((ctx.dim0 - back.shape[0],) + back.shape[1:])])
        return back, None, None, None


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post, ps):
        ctx.scale = pre * post / (_size(ps) if op == Average else 1)
        ctx.ps = ps
        return ops.synchronize(ops.reducescatter_async(tensor, name=name, op=op,
                                                       prescale_factor=pre,
                                                       postscale_factor=post, process_set=ps))

    @staticmethod
    def backward(ctx, grad):
        full = ops.synchronize(ops.allgather_async(grad.contiguous(), process_set=ctx.ps))
        return (full * ctx.scale if ctx.scale != 1 else full), None, None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, ps, *tensors):
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, pre, post, ps
        return tuple(ops.synchronize(ops.grouped_allreduce_async(
            tensors, name=name, op=op, prescale_factor=pre, postscale_factor=post,
            process_set=ps)))

    @staticmethod
    def backward(ctx, *grads):
        reduced = ops.synchronize(ops.grouped_allreduce_async(
            [g.contiguous() for g in grads], op=ctx.op, prescale_factor=ctx.pre,
            postscale_factor=ctx.post, process_set=ctx.ps))
        return (None, None, None, None, None) + tuple(reduced)


def _rank(ps) -> int:
    return member_of(ps, "collective")[1].rank


def _size(ps) -> int:
    return member_of(ps, "collective")[1].size


def _even_splits(tensor, ps):
    n = _size(ps)
    return [tensor.shape[0] // n] * n


@_blocking
def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """Reduce `tensor` across ranks into a new tensor; differentiable.
    Synchronization: blocks until every rank has submitted `name` and the reduction is done."""
    op = ops._resolve_op(average, op, "allreduce")
    wire, ctx = compression.compress(tensor)
    if _wants_grad(wire):
        out = _Allreduce.apply(wire, name, op, prescale_factor, postscale_factor, process_set)
    else:
        out = ops.synchronize(ops.allreduce_async(wire, name=name, op=op,
                                                  prescale_factor=prescale_factor,
                                                  postscale_factor=postscale_factor,
                                                  process_set=process_set))
    return compression.decompress(out, ctx)


@_blocking
def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None):
    """Reduce `tensor` in place across ranks; returns it. Synchronization: blocks (see allreduce)."""
    return ops.synchronize(ops.allreduce_async_(tensor, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


@_blocking
def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """Reduce a list of tensors, submitted atomically; returns new tensors; differentiable.
    Blocks until every rank has submitted the group."""
    wire = [compression.compress(t) for t in tensors]
    if any(_wants_grad(w) for w, _ in wire):
        op = ops._resolve_op(average, op, "grouped_allreduce")
        outs = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set,
                                       *[w for w, _ in wire])
    else:
        outs = ops.synchronize(ops.grouped_allreduce_async([w for w, _ in wire], average, name,
                                                           op, prescale_factor,
                                                           postscale_factor, process_set))
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, wire)]


@_blocking
def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=None):
    """In-place form of grouped_allreduce. Blocks."""
    return ops.synchronize(ops.grouped_allreduce_async_(tensors, average, name, op,
                                                        prescale_factor, postscale_factor,
                                                        process_set))


@_blocking
def allgather(tensor, name=None, process_set=None):
    """Concatenate every rank's tensor along dim 0 (dim 0 may differ); differentiable. Blocks."""
    if _wants_grad(tensor):
        return _Allgather.apply(tensor, name, process_set)
    return ops.synchronize(ops.allgather_async(tensor, name=name, process_set=process_set))


@_blocking
def grouped_allgather(tensors, name=None, process_set=None):
    """Allgather a list, submitted atomically. Blocks."""
    return ops.synchronize(ops.grouped_allgather_async(tensors, name=name,
                                                       process_set=process_set))


@_blocking
def broadcast(tensor, root_rank, name=None, process_set=None):
    """Copy of global rank `root_rank`'s tensor on every rank; input untouched; differentiable.
    Synchronization: blocks until every rank (of the set) has submitted `name`."""
    if _wants_grad(tensor):
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return ops.synchronize(ops.broadcast_async(tensor, root_rank, name=name,
                                               process_set=process_set))


@_blocking
def broadcast_(tensor, root_rank, name=None, process_set=None):
    """Overwrite `tensor` with global rank `root_rank`'s; returns it. Blocks."""
    return ops.synchronize(ops.broadcast_async_(tensor, root_rank, name=name,
                                                process_set=process_set))


@_blocking
def alltoall(tensor, splits=None, name=None, process_set=None):
    """Send splits[i] rows to rank i (of the set); returns the received rows, plus the received
    splits when `splits` is given; differentiable. Blocks."""
    if _wants_grad(tensor):
        out, received = _Alltoall.apply(tensor, splits, name, process_set)
        return (out, received) if splits is not None else out
    return ops.synchronize(ops.alltoall_async(tensor, splits=splits, name=name,
                                              process_set=process_set))


@_blocking
def reducescatter(tensor, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                  process_set=None):
    """Reduce across ranks and keep this rank's rows of dim 0; differentiable. Blocks."""
    if _wants_grad(tensor):
        return _Reducescatter.apply(tensor, name, op, prescale_factor, postscale_factor,
                                    process_set)
    return ops.synchronize(ops.reducescatter_async(tensor, name=name, op=op,
                                                   prescale_factor=prescale_factor,
                                                   postscale_factor=postscale_factor,
                                                   process_set=process_set))


@_blocking
def grouped_reducescatter(tensors, name=None, op=Average, prescale_factor=1.0,
                          postscale_factor=1.0, process_set=None):
    """Reduce-scatter a list, submitted atomically. Blocks."""
    return ops.synchronize(ops.grouped_reducescatter_async(tensors, name, op, prescale_factor,
                                                           postscale_factor, process_set))
