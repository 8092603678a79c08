"""Driving data-path backends directly: hand-built batches, exact-valued data, comparison."""

import torch

from mpidp.engine.messages import OpType, ReduceOp, Request, Response
from mpidp.engine.tensor_queue import Entry

REDUCE_OPS = [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]


def values(shape, dtype, rank, salt=0):
    """Small exact values that differ per rank and element; products of `size` of them stay
    exact in every dtype (magnitudes <= 3, so 3**4 = 81 fits int8 and bfloat16's mantissa)."""
    n = 1
    for d in shape:
        n *= d
    base = (torch.arange(n, dtype=torch.int64) * 7 + rank * 5 + salt) % 7 - 3  # -3..3
    if dtype == torch.bool:
        return (base > 0).reshape(shape)
    if dtype == torch.uint8:
        base = base + 3
    return base.to(dtype).reshape(shape)


def request(name, op, tensor, reduce_op=ReduceOp.SUM, prescale=1.0, postscale=1.0, root=-1,
            device="cpu"):
    return Request(name, op, str(tensor.dtype).replace("torch.", ""), tuple(tensor.shape),
                   device, reduce_op, prescale, postscale, root)


def single(name, op, tensor, output=None, extra=None, first_dims=(), **kw):
    """A one-response batch and its entry."""
    req = request(name, op, tensor, **kw)
    entry = Entry(req, tensor, tensor if output is None else output, None, extra)
    return [Response(name, op, req, first_dims=tuple(first_dims))], [entry]


def fused(prefix, tensors, joined_mask=None, **kw):
    """A fused allreduce batch over `tensors` (entries None where joined_mask is True)."""
    batch, entries = [], []
    for i, t in enumerate(tensors):
        req = request(f"{prefix}.{i}", OpType.ALLREDUCE, t, **kw)
        batch.append(Response(req.name, OpType.ALLREDUCE, req))
        joined = joined_mask is not None and joined_mask[i]
        entries.append(None if joined else Entry(req, t, t.clone(), None))
    return batch, entries


def clone_entries(entries):
    """Independent copies so two backends never share input or output memory."""
    out = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        t = e.tensor.clone()
        o = t if e.output is e.tensor else e.output.clone()
        out.append(Entry(e.request, t, o, None, e.extra))
    return out


def same(a, b) -> bool:
    """Exact equality of results (tensors, tuples of tensors, None), dtype and shape included."""
    if isinstance(a, tuple) or isinstance(b, tuple):
        return (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b)))
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def run_both(first, second, batch, entries):
    """Execute the same batch on two backends (each on its own copies); returns both results."""
    return (first.execute(batch, clone_entries(entries)),
            second.execute(batch, clone_entries(entries)))


ALLREDUCE, ALLGATHER, BROADCAST = OpType.ALLREDUCE, OpType.ALLGATHER, OpType.BROADCAST
ALLTOALL, REDUCESCATTER, BARRIER = OpType.ALLTOALL, OpType.REDUCESCATTER, OpType.BARRIER
