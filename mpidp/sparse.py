"""Sparse gradients as Horovod reduces them: every rank's indices and values gathered, summed."""

from typing import Dict

import torch

from . import op_args, ops
from .engine import scaling
from .engine.messages import OpType
from .ops import Average, Sum
from .process_sets import member_of


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=None) -> int:
    """Start reducing a sparse COO tensor by gathering every rank's indices and values;
    synchronize() returns the coalesced sparse result (values divided by size for Average)."""
    what = "sparse_allreduce"
    target = member_of(process_set, what)
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError(f"{what}: expected a sparse COO tensor; use allreduce for dense ones")
    reduce_op = op_args.resolve_op(None, op, what)
    if reduce_op not in (Average, Sum):
        raise ValueError(f"{what}: only Average and Sum are supported, not "
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
    """Which parameters' gradients go as sparse ops (none with sparse_as_dense). Once seen
    sparse, a parameter stays so: a rank whose loss did not touch it then sends an empty sparse
    gradient, as its peers do."""

    def __init__(self, as_dense: bool):
        self.as_dense = as_dense
        self._dims: Dict[torch.nn.Parameter, int] = {}  # seen sparse: its sparse_dim

    def __call__(self, p) -> bool:
        if self.as_dense:
            return False
        if p.grad is not None and p.grad.is_sparse:
            self._dims[p] = p.grad.sparse_dim()
            return True
        dims = self._dims.get(p)
        if dims is not None and p.grad is None:
            # Same layout as the peers' (an embedding's gradient is sparse in dim 0 only).
            p.grad = torch.sparse_coo_tensor(
                torch.zeros((dims, 0), dtype=torch.long, device=p.device),
                torch.zeros((0,) + tuple(p.shape[dims:]), dtype=p.dtype, device=p.device),
                p.shape, check_invariants=True)
        return dims is not None
