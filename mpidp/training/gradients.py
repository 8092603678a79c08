"""A bucket's gradients on their way: to the reduction ops, and back into each parameter's .grad."""

import torch

from .. import ops
from ..ops.compression import cast_wire
from ..ops.sparse import sparse_allreduce_async
from .buckets import Bucket


def grad_of(p, is_sparse) -> torch.Tensor:
    """What is reduced for parameter `p`: its gradient (zeros when it has none, dense where
    `is_sparse` (ops.sparse.SparseGradients) agreed so), complex as real pairs."""
    if p.grad is None:
        # Ranks whose loss did not touch p still contribute (zeros), so no rank waits.
        p.grad = torch.zeros_like(p)
    elif p.grad.is_sparse:
        is_sparse.densify(p)  # sparse_as_dense, or a parameter agreed dense
    # A complex gradient is reduced as its real and imaginary parts (a view, as DDP does).
    return torch.view_as_real(p.grad) if p.grad.is_complex() else p.grad


def submit(bucket: Bucket, names, is_sparse, compression, op, pre: float, post: float, ps) -> None:
    """Start the reduction of `bucket`'s gradients: one op for its dense ones (Bucket.start,
    compressed by `compression`, prescaled by `pre`, `post` after the sum) and one per sparse
    gradient (named from `names`), over process set `ps`. Synchronization: none (the ops are
    asynchronous; collect() waits)."""
    bucket.submitted = True
    sparse = [p for p in bucket.params if is_sparse(p)]
    if sparse:  # by identity: `in` on tensors would compare their values
        ids = {id(p) for p in sparse}
        dense = [p for p in bucket.params if id(p) not in ids]
    else:
        dense = bucket.params
    # Horovod reduces sparse gradients by gathering every rank's indices and values; the op is
    # Average or Sum as asked, with no compression (there is no dense buffer to cast).
    bucket.sparse = [
        (p, sparse_allreduce_async(p.grad, name=f"{names[p]}.sparse", op=op, process_set=ps))
        for p in sparse
    ]
    bucket.dense = dense
    if not dense:
        bucket.wires = bucket.ctxs = ()
        return
    grads = [grad_of(p, is_sparse) for p in dense]
    cast = cast_wire(compression, grads, op)
    # The data path casts them, piece by piece, while pieces travel.
    if cast is not None and all(g.is_contiguous() for g in grads):
        bucket.wires, bucket.ctxs = grads, [None] * len(grads)
        bucket.start(grads, op, pre, post, ps, keep=not sparse, wire=cast)
        return
    wires, ctxs = [], []
    for grad in grads:
        wire, ctx = compression.compress(grad)
        if not wire.is_contiguous():  # channels_last or transposed: reduce a packed copy
            wire = wire.contiguous()  # (collect() copies the result back into p.grad)
        wires.append(wire)
        ctxs.append(ctx)
    bucket.wires, bucket.ctxs = wires, ctxs
    # A bucket op covering only some parameters has no kept request.
    bucket.start(wires, op, pre, post, ps, keep=not sparse)


def collect(bucket: Bucket, compression, kinds) -> None:
    """Wait for `bucket`'s reductions and put the results in its parameters' .grad, in the
    layout the wrapped optimizer takes (`kinds`: ops.sparse.SparseGradients). Synchronization:
    waits for the bucket's ops (collectives with every rank of the set)."""
    handle, bucket.handle = bucket.handle, None
    if handle is not None:
        ops.synchronize(handle)
    into = getattr(compression, "decompress_into", None)  # Horovod's compressors lack it
    for p, wire, ctx in zip(bucket.dense, bucket.wires, bucket.ctxs):
        if ctx is not None or wire is not p.grad:
            assert p.grad is not None  # submitted: it has a gradient
            grad = torch.view_as_real(p.grad) if p.grad.is_complex() else p.grad
            if into is not None:
                into(wire, ctx, grad)
            else:
                grad.copy_(compression.decompress(wire, ctx))
        kinds.restore(p)
    for p, sparse_handle in bucket.sparse:
        p.grad = ops.synchronize(sparse_handle)
