"""Sparse gradients as Horovod reduces them: every rank's indices and values gathered, summed."""

from typing import Dict

import torch

from .eager import eager
from . import op_args, ops
from .engine import scaling
from .engine.messages import OpType
from .errors import ArgumentError
from .ops import Average, Max, Sum
from .process_sets import member_of


@eager
def sparse_allreduce_async(tensor, name=None, op=Average, process_set=None) -> int:
    """Start reducing a sparse COO tensor by gathering every rank's indices and values;
    synchronize() returns the coalesced sparse result (values divided by size for Average)."""
    what = "sparse_allreduce"
    target = member_of(process_set, what)
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError(f"{what}: expected a sparse COO tensor; use allreduce for dense ones")
    reduce_op = op_args.resolve_op(None, op, what)
    if reduce_op not in (Average, Sum):
        raise ArgumentError(f"{what}: only Average and Sum are supported, not "
                            f"{reduce_op.name.capitalize()}")
    base, cacheable = op_args.op_name(name, what)
    t = tensor.detach().coalesce()
    indices = t.indices().t().contiguous()   # (nnz, sparse_dims): gathered along dim 0
    values = t.values().contiguous()
    entries = [ops.new_entry(op_args.request(f"{base}.{part}", cacheable, OpType.ALLGATHER, t),
                             t, None) for part, t in (("indices", indices), ("values", values))]
    size, shape = target[1].size, t.shape

    def finish(results):
        idx, vals = results
        scaling.scale_(vals, scaling.after_factor(reduce_op, 1.0, size))  # gathered: ours
        return torch.sparse_coo_tensor(idx.t(), vals, shape, check_invariants=True).coalesce()

    return ops.submit(target, entries, finish)


class SparseGradients:
    """Which parameters' gradients go as sparse ops (none with sparse_as_dense).

    A rank whose loss did not touch an embedding has no gradient for it, and cannot tell from
    that whether its peers will send theirs sparse: deciding alone, it would submit zeros in the
    dense bucket while they submit a sparse op, and both would wait for good. So each
    parameter's kind is agreed once, at the first synchronize (`agree`): sparse if any rank's
    gradient is sparse. From then on a rank without a gradient for a sparse parameter sends an
    empty sparse one, and a sparse gradient of a parameter agreed dense is densified.
    """

    def __init__(self, as_dense: bool):
        self.as_dense = as_dense
        self.pending = not as_dense  # kinds not agreed yet
        self._dims: Dict[torch.nn.Parameter, int] = {}  # agreed sparse: its sparse_dim

    def agree(self, buckets, process_set) -> None:
        """Fix the kind of every parameter of `buckets`. Synchronization: one small blocking
        allreduce (Max) over the set, named after the first bucket (unique among the live
        optimizers); every member calls it at its first synchronize(), with `buckets` alike."""
        params = [p for b in buckets for p in b.params]
        if params:
            tag = buckets[0].name
            local = torch.tensor([p.grad.sparse_dim() if p.grad is not None and p.grad.is_sparse
                                  else 0 for p in params], dtype=torch.int32)
            with ops.blocking():  # waited for right below
                handle = ops.allreduce_async(local, name=f"mpidp.sparse_kinds.{tag}", op=Max,
                                             process_set=process_set)
            agreed = ops.synchronize(handle).tolist()
            self._dims = {p: int(d) for p, d in zip(params, agreed) if d}
        self.pending = False

    def __call__(self, p) -> bool:
        if self.pending:
            # Before the agreement only buckets whose every gradient is here go (from the
            # backward hooks): a gradient's own layout is then the same on every rank.
            return p.grad is not None and p.grad.is_sparse
        dims = self._dims.get(p)
        if dims is None:  # dense (a sparse gradient is densified on the dense path)
            return False
        if p.grad is None:
            # Same layout as the peers' (an embedding's gradient is sparse in dim 0 only).
            p.grad = torch.sparse_coo_tensor(
                torch.zeros((dims, 0), dtype=torch.long, device=p.device),
                torch.zeros((0,) + tuple(p.shape[dims:]), dtype=p.dtype, device=p.device),
                p.shape, check_invariants=True)
        return True
