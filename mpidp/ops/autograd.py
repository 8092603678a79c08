"""Autograd rules of the differentiable collectives, as Horovod defines them."""

import torch

from ..runtime import world
from ..runtime.process_sets import member_of
from . import allreduce_ops, gather_ops
from .allreduce_ops import Average, Sum
from .waits import synchronize


class Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post, ps):
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, pre, post, ps
        return synchronize(
            allreduce_ops.allreduce_async(
                tensor, name=name, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps
            )
        )

    @staticmethod
    def backward(ctx, grad):
        # d(sum_r f_r)/dx is the same reduction of the incoming gradients.
        return (
            synchronize(
                allreduce_ops.allreduce_async(
                    grad,
                    op=ctx.op,
                    prescale_factor=ctx.pre,
                    postscale_factor=ctx.post,
                    process_set=ctx.ps,
                )
            ),
            None,
            None,
            None,
            None,
            None,
        )


class Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, ps):
        ctx.dim0 = tensor.shape[0] if tensor.dim() else 1
        ctx.scalar = tensor.dim() == 0
        ctx.ps = ps
        return synchronize(gather_ops.allgather_async(tensor, name=name, process_set=ps))

    @staticmethod
    def backward(ctx, grad):
        # Horovod averages the gathered gradient, then each rank keeps its own rows.
        reduced = synchronize(
            allreduce_ops.allreduce_async(grad.contiguous(), op=Average, process_set=ctx.ps)
        )
        dims = synchronize(gather_ops.allgather_async(torch.tensor([ctx.dim0]), process_set=ctx.ps))
        offset = int(dims[: _rank(ctx.ps)].sum())
        part = reduced.narrow(0, offset, ctx.dim0)
        return (part.reshape(()) if ctx.scalar else part), None, None


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, ps):
        ctx.root, ctx.ps = root_rank, ps
        return synchronize(gather_ops.broadcast_async(tensor, root_rank, name=name, process_set=ps))

    @staticmethod
    def backward(ctx, grad):
        reduced = synchronize(
            allreduce_ops.allreduce_async(grad.contiguous(), op=Average, process_set=ctx.ps)
        )
        if world.rank() != ctx.root:  # root_rank is a global rank
            reduced.zero_()
        return reduced, None, None, None


class Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, ps):
        ctx.dim0, ctx.ps = tensor.shape[0], ps
        # Without splits too, what each rank received (its peers' dim 0 / size each, which
        # differ when ranks hold different row counts) is what the gradient sends back.
        out, received = synchronize(
            gather_ops.alltoall_received_async(tensor, splits=splits, name=name, process_set=ps)
        )
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        back, _ = synchronize(
            gather_ops.alltoall_async(grad.contiguous(), splits=ctx.received, process_set=ctx.ps)
        )
        if back.shape[0] < ctx.dim0:  # rows this rank never sent get no gradient
            back = torch.cat([back, back.new_zeros((ctx.dim0 - back.shape[0],) + back.shape[1:])])
        return back, None, None, None


def _reducescatter_grad_scale(op, pre, post, ps) -> float:
    """Horovod's rule: every rank's output gradient gathered, times size for Sum (1 for
    Average), times the scale factors. That is size times the gradient of the sum of the ranks'
    losses; kept so that a script moved from Horovod gets the same numbers (docs/collectives.md)."""
    return pre * post * (_size(ps) if op == Sum else 1)


class Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post, ps):
        ctx.scale = _reducescatter_grad_scale(op, pre, post, ps)
        ctx.ps = ps
        return synchronize(
            gather_ops.reducescatter_async(
                tensor, name=name, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps
            )
        )

    @staticmethod
    def backward(ctx, grad):
        full = synchronize(gather_ops.allgather_async(grad.contiguous(), process_set=ctx.ps))
        return (full * ctx.scale if ctx.scale != 1 else full), None, None, None, None, None


class GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, ps, *tensors):
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, pre, post, ps
        return tuple(
            synchronize(
                allreduce_ops.grouped_allreduce_async(
                    tensors,
                    name=name,
                    op=op,
                    prescale_factor=pre,
                    postscale_factor=post,
                    process_set=ps,
                )
            )
        )

    @staticmethod
    def backward(ctx, *grads):
        reduced = synchronize(
            allreduce_ops.grouped_allreduce_async(
                [g.contiguous() for g in grads],
                op=ctx.op,
                prescale_factor=ctx.pre,
                postscale_factor=ctx.post,
                process_set=ctx.ps,
            )
        )
        return (None, None, None, None, None) + tuple(reduced)


def _rank(ps) -> int:
    return member_of(ps, "collective")[1].rank


def _size(ps) -> int:
    return member_of(ps, "collective")[1].size


class GroupedAllgather(torch.autograd.Function):
    """Allgather's rule for each tensor of the group: the gradients averaged over the ranks
    (one grouped op), each rank keeping its own rows."""

    @staticmethod
    def forward(ctx, name, ps, *tensors):
        ctx.dim0s = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.scalars = [t.dim() == 0 for t in tensors]
        ctx.ps = ps
        return tuple(
            synchronize(
                gather_ops.grouped_allgather_async(list(tensors), name=name, process_set=ps)
            )
        )

    @staticmethod
    def backward(ctx, *grads):
        reduced = synchronize(
            allreduce_ops.grouped_allreduce_async(
                [g.contiguous() for g in grads], op=Average, process_set=ctx.ps
            )
        )
        k = len(ctx.dim0s)
        dims = synchronize(
            gather_ops.allgather_async(torch.tensor(ctx.dim0s), process_set=ctx.ps)
        ).reshape(-1, k)
        offsets = dims[: _rank(ctx.ps)].sum(0)
        parts = []
        for j, (full, dim0) in enumerate(zip(reduced, ctx.dim0s)):
            part = full.narrow(0, int(offsets[j]), dim0)
            parts.append(part.reshape(()) if ctx.scalars[j] else part)
        return (None, None) + tuple(parts)


class GroupedReducescatter(torch.autograd.Function):
    """Reducescatter's rule for each tensor of the group: every rank's gradient gathered (one
    grouped op), scaled as the forward scaled."""

    @staticmethod
    def forward(ctx, name, op, pre, post, ps, *tensors):
        ctx.scale = _reducescatter_grad_scale(op, pre, post, ps)
        ctx.ps = ps
        return tuple(
            synchronize(
                gather_ops.grouped_reducescatter_async(list(tensors), name, op, pre, post, ps)
            )
        )

    @staticmethod
    def backward(ctx, *grads):
        full = synchronize(
            gather_ops.grouped_allgather_async([g.contiguous() for g in grads], process_set=ctx.ps)
        )
        if ctx.scale != 1:
            full = [f * ctx.scale for f in full]
        return (None, None, None, None, None) + tuple(full)
