"""Arguments of the collectives: checked tensors, reduce ops, names, splits; the requests made."""

import math
import warnings
from typing import Dict, List, Optional

import numpy as np
import torch

from ..engine.dtypes import NAMES as _DTYPE_NAMES
from ..engine.messages import OpType, ReduceOp, Request
from ..engine.tensor_queue import is_block
from ..errors import ArgumentError

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def check_tensor(tensor, what: str, inplace: bool) -> torch.Tensor:
    """The tensor the engine may read (and write, if in place), or a clear TypeError/ValueError."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(
            f"{what}: sparse tensors are not supported here; call tensor.to_dense() first"
        )
    if tensor.dtype not in _DTYPE_NAMES:
        raise TypeError(
            f"{what}: dtype {tensor.dtype} is not supported; use one of "
            f"{', '.join(_DTYPE_NAMES.values())}"
        )
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"{what}: tensor is on {tensor.device}, but mpidp moves host memory "
            f"and CUDA memory only; call .cpu() first"
        )
    if not tensor.is_contiguous():
        if inplace:
            raise ValueError(
                f"{what}: in-place ops need a contiguous tensor (this one has "
                f"strides {tensor.stride()}); call .contiguous() and use the result, "
                f"or use the out-of-place form, which copies"
            )
        tensor = tensor.contiguous()
    # Only a tensor that requires grad needs the alias: in-place writes to it would be refused.
    return tensor.detach() if tensor.requires_grad else tensor


def check_tensors(tensors, what: str, label, inplace: bool) -> List[torch.Tensor]:
    """check_tensor() of each of `tensors`, `label(i)` naming tensor i in the message (made only
    for a tensor that fails). The common case, a contiguous tensor of a supported dtype on the
    host or a GPU, costs a few attribute reads: a bucket has many tensors."""
    checked = []
    for i, t in enumerate(tensors):
        if (
            isinstance(t, torch.Tensor)
            and t.layout == torch.strided
            and t.dtype in _DTYPE_NAMES
            and (t.is_cpu or t.is_cuda)
            and t.is_contiguous()
        ):
            checked.append(t.detach() if t.requires_grad else t)
        else:
            checked.append(check_tensor(t, f"{what} {label(i)!r}", inplace))
    return checked


def same_device(tensors: List[torch.Tensor], what: str) -> None:
    """A grouped op runs on one data path: every tensor on the same kind of device (checked
    after each tensor passed _check_tensor, whose message names the tensor)."""
    kinds = [t.device.type for t in tensors]
    if len(set(kinds)) > 1:
        odd = next(i for i, k in enumerate(kinds) if k != kinds[0])
        raise ArgumentError(
            f"{what}: tensor {odd} is on {tensors[odd].device} but tensor 0 is "
            f"on {tensors[0].device}; a grouped op needs all its tensors on one "
            f"kind of device (move them with .cpu() or .cuda() first)"
        )


def resolve_op(average, op, what: str, size: Optional[int] = None) -> ReduceOp:
    """The reduce op asked for (Average by default); `size`, the number of ranks the op runs
    on, where known: Adasum needs a power of 2 of them."""
    if average is not None and op is not None:
        raise ValueError(f"{what}: give either op= or the deprecated average=, not both")
    if average is not None:
        warnings.warn(
            "average= is deprecated; use op=mpidp.Average or op=mpidp.Sum",
            DeprecationWarning,
            stacklevel=3,
        )
        return Average if average else Sum
    if op is None:
        return Average
    if type(op) is not ReduceOp:
        try:
            op = ReduceOp(op)
        except ValueError:
            raise ValueError(
                f"{what}: unknown reduce op {op!r}; use mpidp.Average, Sum, Min, "
                f"Max, Product or Adasum"
            ) from None
    if op == Adasum and size is not None and size & (size - 1):
        # Horovod refuses this too (NotImplementedError): the pairwise tree of Adasum
        # (engine/adasum.py) has no partner for the ranks beyond the largest power of 2.
        raise NotImplementedError(
            f"{what}: Adasum needs a power-of-2 number of ranks, as in Horovod, and this op "
            f"runs on {size}; run with 1, 2, 4, 8, ... ranks, reduce over a process set of a "
            f"power-of-2 size, or use op=mpidp.Average"
        )
    return op


def check_reduction(tensor: torch.Tensor, op: ReduceOp, pre: float, post: float, what: str):
    if not (math.isfinite(pre) and math.isfinite(post)):  # NaN != NaN: a "mismatch" otherwise
        raise ValueError(
            f"{what}: prescale_factor and postscale_factor must be finite, got {pre} and {post}"
        )
    if tensor.dtype == torch.bool and op == Average:
        raise TypeError(
            f"{what}: Average is not defined for bool tensors; use Sum (logical or) "
            f"or Min (logical and)"
        )
    if (pre != 1.0 or post != 1.0) and tensor.dtype == torch.bool:
        raise TypeError(f"{what}: prescale/postscale factors are not defined for bool tensors")
    if op in BITWISE and (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(
            f"{what}: {ReduceOp(op).name} is a bitwise reduction, defined for "
            f"integer and bool tensors, not {tensor.dtype}"
        )
    if op == Adasum and not tensor.is_floating_point():
        raise TypeError(
            f"{what}: Adasum is defined for float16, bfloat16, float32 and float64 "
            f"tensors, not {tensor.dtype}; cast the tensor or use mpidp.Sum"
        )


def check_reductions(tensors, op: ReduceOp, pre: float, post: float, what: str, label) -> int:
    """check_reduction() for each dtype among `tensors` (the checks depend on nothing else),
    `label(i)` naming the first tensor of the dtype; returns the number of dtypes."""
    first: Dict[torch.dtype, int] = {}
    for i, t in enumerate(tensors):
        first.setdefault(t.dtype, i)
    for i in first.values():
        check_reduction(tensors[i], op, pre, post, f"{what} {label(i)!r}")
    return len(first)


UNNAMED = "<unnamed>"  # stands in for the number an unnamed op draws once it is accepted


def op_name(name: Optional[str], what: str):
    if name is None:
        return UNNAMED, False
    if not isinstance(name, str) or not name:
        raise TypeError(f"{what}: name must be a non-empty string, got {name!r}")
    return name, True


def request(
    name, cacheable, op, tensor, reduce_op=ReduceOp.SUM, pre=1.0, post=1.0, root=-1, wire=None
):
    """The request of an op on `tensor`; `wire`: the dtype it travels in, if not its own."""
    return Request(
        name,
        int(op),
        _DTYPE_NAMES[tensor.dtype if wire is None else wire],
        tuple(tensor.shape),
        str(tensor.device),
        int(reduce_op),
        float(pre),
        float(post),
        int(root),
        cacheable,
    )


def parts_request(name, cacheable, tensors, reduce_op, pre, post, wire=None) -> Request:
    """The request of one allreduce op over several tensors of one dtype and device (a plain
    single-tensor request for one, which may then be fused with other small ops); `wire`: the
    dtype they travel in, if not their own."""
    first = tensors[0]
    if len(tensors) == 1:
        return request(name, cacheable, OpType.ALLREDUCE, first, reduce_op, pre, post, wire=wire)
    return Request(
        name,
        int(OpType.ALLREDUCE),
        _DTYPE_NAMES[first.dtype if wire is None else wire],
        (sum(t.numel() for t in tensors),),
        str(first.device),
        int(reduce_op),
        float(pre),
        float(post),
        -1,
        cacheable,
        parts=tuple(tuple(t.shape) for t in tensors),
    )


def check_splits(splits, t: torch.Tensor, size: int, what: str) -> np.ndarray:
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype == torch.bool:
            # ValueError, as Horovod raises for non-integer splits (scripts catch that one).
            raise ValueError(f"{what}: splits must hold integers, not {splits.dtype}")
        arr = splits.detach().cpu().numpy().reshape(-1)
    elif isinstance(splits, (list, tuple, np.ndarray)):
        arr = np.asarray(splits)
        if arr.size == 0:
            arr = arr.astype(np.int64)  # numpy makes [] float; the count check below says more
        if arr.dtype.kind == "f":
            raise ValueError(f"{what}: splits must be integers, got {list(splits)!r}")
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{what}: splits must be integers, got {list(splits)!r}")
        arr = arr.reshape(-1)
    else:
        raise TypeError(
            f"{what}: splits must be a list or an integer tensor with one entry "
            f"per rank, not {type(splits).__name__}"
        )
    if arr.size != size:
        raise ValueError(
            f"{what}: splits has {arr.size} entries but there are {size} ranks; "
            f"give one count per rank"
        )
    if (arr < 0).any():
        raise ValueError(f"{what}: splits must be >= 0, got {arr.tolist()}")
    dim0 = t.shape[0] if t.dim() else 1
    if int(arr.sum()) > dim0:
        raise ValueError(
            f"{what}: splits sum to {int(arr.sum())} but the tensor has only "
            f"{dim0} rows along dim 0"
        )
    return arr.astype(np.int32)


def check_output(output, shape, t: torch.Tensor, label: str, block=None) -> None:
    """Refuse an output tensor (ops.*_into_async) that is not contiguous, of `shape` and of
    `t`'s dtype and device, or that overlaps the input `t` (unless `t` is exactly block number
    `block` of it: an allgather in place)."""
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"{label}: output must be a torch.Tensor, got {type(output).__name__}")
    if (
        tuple(output.shape) != tuple(shape)
        or output.dtype != t.dtype
        or output.device != t.device
        or not output.is_contiguous()
    ):
        raise ValueError(
            f"{label}: output must be a contiguous {t.dtype} tensor of shape "
            f"{list(shape)} on {t.device}; got {output.dtype} "
            f"{list(output.shape)} on {output.device}"
            f"{'' if output.is_contiguous() else ', not contiguous'}"
        )
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    out_lo = output.data_ptr()
    out_hi = out_lo + output.numel() * output.element_size()
    if lo < out_hi and out_lo < hi and (block is None or not is_block(t, output, block)):
        raise ValueError(
            f"{label}: the input overlaps the output; MPI needs them apart (or, "
            f"for an allgather, the input exactly this rank's block of the output)"
        )
