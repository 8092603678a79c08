"""Blocking collectives, differentiable where Horovod's are (allreduce, allgather, broadcast, ...)."""

import torch

from . import ops, runtime
from .compression import Compression
from .ops import Average


def _wants_grad(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post):
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return ops.synchronize(ops.allreduce_async(tensor, name=name, op=op,
                                                   prescale_factor=pre, postscale_factor=post))

    @staticmethod
    def backward(ctx, grad):
        # d(sum_r f_r)/dx is the same reduction of the incoming gradients.
        return ops.synchronize(ops.allreduce_async(grad, op=ctx.op, prescale_factor=ctx.pre,
                                                   postscale_factor=ctx.post)), None, None, None, None


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name):
        ctx.dim0 = tensor.shape[0] if tensor.dim() else 1
        ctx.scalar = tensor.dim() == 0
        return ops.synchronize(ops.allgather_async(tensor, name=name))

    @staticmethod
    def backward(ctx, grad):
        # Horovod averages the gathered gradient, then each rank keeps its own rows.
        reduced = ops.synchronize(ops.allreduce_async(grad.contiguous(), op=Average))
        dims = ops.synchronize(ops.allgather_async(torch.tensor([ctx.dim0])))
        offset = int(dims[: _rank()].sum())
        part = reduced.narrow(0, offset, ctx.dim0)
        return (part.reshape(()) if ctx.scalar else part), None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root = root_rank
        return ops.synchronize(ops.broadcast_async(tensor, root_rank, name=name))

    @staticmethod
    def backward(ctx, grad):
        reduced = ops.synchronize(ops.allreduce_async(grad.contiguous(), op=Average))
        if _rank() != ctx.root:
            reduced.zero_()
        return reduced, None, None


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name):
        ctx.dim0 = tensor.shape[0]
        out, received = ops.synchronize(ops.alltoall_async(
            tensor, splits=splits if splits is not None else _even_splits(tensor), name=name))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        back, _ = ops.synchronize(ops.alltoall_async(grad.contiguous(), splits=ctx.received))
        if back.shape[0] < ctx.dim0:  # rows this rank never sent get no gradient
            back = torch.cat([back, back.new_zeros((ctx.dim0 - back.shape[0],) + back.shape[1:])])
        return back, None, None


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post):
        ctx.scale = pre * post / (_size() if op == Average else 1)
        return ops.synchronize(ops.reducescatter_async(tensor, name=name, op=op,
                                                       prescale_factor=pre,
                                                       postscale_factor=post))

    @staticmethod
    def backward(ctx, grad):
        full = ops.synchronize(ops.allgather_async(grad.contiguous()))
        return (full * ctx.scale if ctx.scale != 1 else full), None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, *tensors):
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return tuple(ops.synchronize(ops.grouped_allreduce_async(
            tensors, name=name, op=op, prescale_factor=pre, postscale_factor=post)))

    @staticmethod
    def backward(ctx, *grads):
        reduced = ops.synchronize(ops.grouped_allreduce_async(
            [g.contiguous() for g in grads], op=ctx.op, prescale_factor=ctx.pre,
            postscale_factor=ctx.post))
        return (None, None, None, None) + tuple(reduced)


_rank = runtime.rank
_size = runtime.size


def _even_splits(tensor):
    n = _size()
    return [tensor.shape[0] // n] * n


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0):
    """Reduce `tensor` across ranks into a new tensor; differentiable.
    Synchronization: blocks until every rank has submitted `name` and the reduction is done."""
    op = ops._resolve_op(average, op, "allreduce")
    wire, ctx = compression.compress(tensor)
    if _wants_grad(wire):
        out = _Allreduce.apply(wire, name, op, prescale_factor, postscale_factor)
    else:
        out = ops.synchronize(ops.allreduce_async(wire, name=name, op=op,
                                                  prescale_factor=prescale_factor,
                                                  postscale_factor=postscale_factor))
    return compression.decompress(out, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0):
    """Reduce `tensor` in place across ranks; returns it. Synchronization: blocks (see allreduce)."""
    return ops.synchronize(ops.allreduce_async_(tensor, average, name, op, prescale_factor,
                                                postscale_factor))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0):
    """Reduce a list of tensors, submitted atomically; returns new tensors; differentiable.
    Blocks until every rank has submitted the group."""
    wire = [compression.compress(t) for t in tensors]
    if any(_wants_grad(w) for w, _ in wire):
        op = ops._resolve_op(average, op, "grouped_allreduce")
        outs = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor,
                                       *[w for w, _ in wire])
    else:
        outs = ops.synchronize(ops.grouped_allreduce_async([w for w, _ in wire], average, name,
                                                           op, prescale_factor,
                                                           postscale_factor))
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, wire)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0):
    """In-place form of grouped_allreduce. Blocks."""
    return ops.synchronize(ops.grouped_allreduce_async_(tensors, average, name, op,
                                                        prescale_factor, postscale_factor))


def allgather(tensor, name=None):
    """Concatenate every rank's tensor along dim 0 (dim 0 may differ); differentiable. Blocks."""
    if _wants_grad(tensor):
        return _Allgather.apply(tensor, name)
    return ops.synchronize(ops.allgather_async(tensor, name=name))


def grouped_allgather(tensors, name=None):
    """Allgather a list, submitted atomically. Blocks."""
    return ops.synchronize(ops.grouped_allgather_async(tensors, name=name))


def broadcast(tensor, root_rank, name=None):
    """Copy of global rank `root_rank`'s tensor on every rank; input untouched; differentiable.
    Synchronization: blocks until every rank has submitted `name`."""
    if _wants_grad(tensor):
        return _Broadcast.apply(tensor, root_rank, name)
    return ops.synchronize(ops.broadcast_async(tensor, root_rank, name=name))


def broadcast_(tensor, root_rank, name=None):
    """Overwrite `tensor` with global rank `root_rank`'s; returns it. Blocks."""
    return ops.synchronize(ops.broadcast_async_(tensor, root_rank, name=name))


def alltoall(tensor, splits=None, name=None):
    """Send splits[i] rows to rank i; returns the received rows, plus the received splits when
    `splits` is given; differentiable. Blocks."""
    if _wants_grad(tensor):
        out, received = _Alltoall.apply(tensor, splits, name)
        return (out, received) if splits is not None else out
    return ops.synchronize(ops.alltoall_async(tensor, splits=splits, name=name))


def reducescatter(tensor, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce across ranks and keep this rank's rows of dim 0; differentiable. Blocks."""
    if _wants_grad(tensor):
        return _Reducescatter.apply(tensor, name, op, prescale_factor, postscale_factor)
    return ops.synchronize(ops.reducescatter_async(tensor, name=name, op=op,
                                                   prescale_factor=prescale_factor,
                                                   postscale_factor=postscale_factor))


def grouped_reducescatter(tensors, name=None, op=Average, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Reduce-scatter a list, submitted atomically. Blocks."""
    return ops.synchronize(ops.grouped_reducescatter_async(tensors, name, op, prescale_factor,
                                                           postscale_factor))
