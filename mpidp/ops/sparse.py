"""Sparse gradients as Horovod reduces them: every rank's indices and values gathered, summed."""

from typing import Dict

import torch

from ..engine import scaling
from ..engine.messages import OpType
from ..errors import ArgumentError
from ..runtime.process_sets import member_of
from . import allreduce_ops, op_args, submission
from .allreduce_ops import Average, Max, Sum
from .eager import eager
from .waits import CallableHandle, synchronize


@eager
def sparse_allreduce_async(tensor, name=None, op=Average, process_set=None) -> CallableHandle:
    """Start reducing a sparse COO tensor by gathering every rank's indices and values;
    synchronize(handle), or handle() as in Horovod, returns the coalesced sparse result (values
    divided by size for Average). Synchronization: none until the handle is waited for."""
    what = "sparse_allreduce"
    target = member_of(process_set, what)
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError(f"{what}: expected a sparse COO tensor; use allreduce for dense ones")
    reduce_op = op_args.resolve_op(None, op, what)
    if reduce_op not in (Average, Sum):
        raise ArgumentError(
            f"{what}: only Average and Sum are supported, not {reduce_op.name.capitalize()}"
        )
    base, cacheable = op_args.op_name(name, what)
    t = tensor.detach().coalesce()
    indices = t.indices().t().contiguous()  # (nnz, sparse_dims): gathered along dim 0
    values = t.values().contiguous()
    entries = [
        submission.new_entry(
            op_args.request(f"{base}.{part}", cacheable, OpType.ALLGATHER, t), t, None
        )
        for part, t in (("indices", indices), ("values", values))
    ]
    size, shape = target[1].size, t.shape

    def finish(results):
        idx, vals = results
        scaling.scale_(vals, scaling.after_factor(reduce_op, 1.0, size))  # gathered: ours
        return torch.sparse_coo_tensor(idx.t(), vals, shape, check_invariants=True).coalesce()

    return CallableHandle(submission.submit(target, entries, finish))


class SparseGradients:
    """Which parameters' gradients go as sparse ops, and, with sparse_as_dense, which go dense
    but are handed back to the wrapped optimizer sparse.

    A rank whose loss did not touch an embedding has no gradient for it, and cannot tell from
    that whether its peers will send theirs sparse: deciding alone, it would submit zeros in the
    dense bucket while they submit a sparse op, and both would wait for good. So each
    parameter's kind is agreed once, at the first synchronize (`agree`): sparse if any rank's
    gradient is sparse. From then on a rank without a gradient for a sparse parameter sends an
    empty sparse one, and a sparse gradient of a parameter agreed dense is densified.

    With sparse_as_dense every gradient goes dense, and the kinds are agreed the same way from
    the layouts the gradients had before `densify`: an optimizer such as SparseAdam takes only
    sparse ones, so `restore` turns the reduced gradient of a parameter agreed sparse back into
    one, on every rank alike (a rank without a gradient for it included).
    """

    def __init__(self, as_dense: bool):
        self.as_dense = as_dense
        self.pending = True  # kinds not agreed yet
        self._dims: Dict[torch.nn.Parameter, int] = {}  # agreed sparse: its sparse_dim
        self._densified: Dict[torch.nn.Parameter, int] = {}  # as_dense: this rank's, this step

    def agree(self, buckets, process_set) -> None:
        """Fix the kind of every parameter of `buckets` (as_dense: once every gradient went
        through densify). Synchronization: one small blocking allreduce (Max) over the set,
        named after the first bucket (unique among the live optimizers); every member calls it
        at its first synchronize(), with `buckets` alike."""
        params = [p for b in buckets for p in b.params]
        if params:
            tag = buckets[0].name
            if self.as_dense:
                local = [self._densified.get(p, 0) for p in params]
            else:
                local = [
                    p.grad.sparse_dim() if p.grad is not None and p.grad.is_sparse else 0
                    for p in params
                ]
            with submission.blocking():  # waited for right below
                handle = allreduce_ops.allreduce_async(
                    torch.tensor(local, dtype=torch.int32),
                    name=f"mpidp.sparse_kinds.{tag}",
                    op=Max,
                    process_set=process_set,
                )
            agreed = synchronize(handle).tolist()
            self._dims = {p: int(d) for p, d in zip(params, agreed) if d}
        self.pending = False

    def densify(self, p) -> None:
        """Make `p`'s sparse gradient dense for the dense path, noting its layout."""
        self._densified[p] = p.grad.sparse_dim()
        p.grad = p.grad.to_dense()

    def restore(self, p) -> None:
        """After the reduction: `p`'s gradient sparse again where its kind was agreed sparse
        (sparse_as_dense), in the layout the backward pass made."""
        self._densified.pop(p, None)
        dims = self._dims.get(p) if self.as_dense else None
        if dims is not None and p.grad is not None and not p.grad.is_sparse:
            p.grad = p.grad.to_sparse(dims)

    def __call__(self, p) -> bool:
        if self.as_dense:
            return False
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
                p.shape,
                check_invariants=True,
            )
        return True
