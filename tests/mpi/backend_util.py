"""Driving data-path backends directly: hand-built batches, exact-valued data, comparison."""

import torch

from mpidp import config as mpidp_config
from mpidp.engine.messages import OpType, ReduceOp, Request, Response
from mpidp.engine.tensor_queue import Entry

REDUCE_OPS = [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]


def host_config(**kw):
    """The flat MPI reference whatever the session's variables say, with small chunks (256 B)
    to cover chunking; `kw` overrides."""
    base = dict(backend="mpi", hierarchical_allreduce=0, simulated_local_size=0, chunk_bytes=256)
    base.update(kw)
    return mpidp_config.load(**base)


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


def request(
    name, op, tensor, reduce_op=ReduceOp.SUM, prescale=1.0, postscale=1.0, root=-1, device="cpu"
):
    return Request(
        name,
        op,
        str(tensor.dtype).replace("torch.", ""),
        tuple(tensor.shape),
        device,
        reduce_op,
        prescale,
        postscale,
        root,
    )


def entry(req, tensor, output, extra=None):
    """The engine's record for `req`: an allreduce carries lists of parts."""
    if req.op == OpType.ALLREDUCE:
        return Entry(req, [tensor], [output], extra)
    return Entry(req, tensor, output, extra)


def single(name, op, tensor, output=None, extra=None, first_dims=(), **kw):
    """A one-response batch and its entry."""
    req = request(name, op, tensor, **kw)
    if output is None and op in (OpType.ALLREDUCE, OpType.BROADCAST):
        output = tensor  # in place; the other ops make their output unless given one (mpidp/ops/)
    return (
        [Response(name, op, req, first_dims=tuple(first_dims))],
        [entry(req, tensor, output, extra)],
    )


def bucket(name, tensors, joined=False, **kw):
    """A one-response batch of one multi-tensor allreduce (a gradient bucket) and its entry."""
    first = tensors[0]
    req = Request(
        name,
        OpType.ALLREDUCE,
        str(first.dtype).replace("torch.", ""),
        (sum(t.numel() for t in tensors),),
        "cpu",
        parts=tuple(tuple(t.shape) for t in tensors),
        **kw,
    )
    return (
        [Response(name, OpType.ALLREDUCE, req)],
        [None if joined else Entry(req, list(tensors), [t.clone() for t in tensors])],
    )


def fused(prefix, tensors, joined_mask=None, **kw):
    """A fused allreduce batch over `tensors` (entries None where joined_mask is True)."""
    batch, entries = [], []
    for i, t in enumerate(tensors):
        req = request(f"{prefix}.{i}", OpType.ALLREDUCE, t, **kw)
        batch.append(Response(req.name, OpType.ALLREDUCE, req))
        joined = joined_mask is not None and joined_mask[i]
        entries.append(None if joined else entry(req, t, t.clone()))
    return batch, entries


def clone_entries(entries):
    """Independent copies so two backends never share input or output memory."""
    out = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        if isinstance(e.tensor, list):
            t = [x.clone() for x in e.tensor]
            o = t if e.output is e.tensor else [x.clone() for x in e.output]
        else:
            t = e.tensor.clone()
            o = t if e.output is e.tensor else None if e.output is None else e.output.clone()
        out.append(Entry(e.request, t, o, e.extra))
    return out


def same(a, b) -> bool:
    """Exact equality of results (tensors, tuples of tensors, None), dtype and shape included."""
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def run_both(first, second, batch, entries, *fusion_limits):
    """Execute the same batch on two backends (each on its own copies); returns both results."""
    return (
        first.execute(batch, clone_entries(entries), *fusion_limits),
        second.execute(batch, clone_entries(entries), *fusion_limits),
    )


ALLREDUCE, ALLGATHER, BROADCAST = OpType.ALLREDUCE, OpType.ALLGATHER, OpType.BROADCAST
ALLTOALL, REDUCESCATTER, BARRIER = OpType.ALLTOALL, OpType.REDUCESCATTER, OpType.BARRIER


class Counting:
    """A communicator whose Iallreduce calls are counted (mpi4py's own cannot be patched);
    everything else goes to the communicator it wraps."""

    def __init__(self, comm):
        self.comm, self.calls = comm, 0

    def Iallreduce(self, *args, **kw):  # noqa: N802 (mpi4py's name)
        self.calls += 1
        return self.comm.Iallreduce(*args, **kw)

    def __getattr__(self, name):
        return getattr(self.comm, name)
