"""How torch's tensors and reduce ops reach mpidp's engine: flat views, bytes, complex pairs."""

import torch
import torch.distributed as dist

from ..engine.dtypes import SUPPORTED
from ..engine.messages import ReduceOp

_RedOp = dist.ReduceOp  # its RedOpType members, where torch's stubs declare them
OPS = {
    _RedOp.SUM: ReduceOp.SUM,
    _RedOp.AVG: ReduceOp.AVERAGE,
    _RedOp.PRODUCT: ReduceOp.PRODUCT,
    _RedOp.MIN: ReduceOp.MIN,
    _RedOp.MAX: ReduceOp.MAX,
    _RedOp.BAND: ReduceOp.BAND,
    _RedOp.BOR: ReduceOp.BOR,
    _RedOp.BXOR: ReduceOp.BXOR,
}
_BYTE = torch.uint8


def engine_op(red) -> tuple:
    """(mpidp ReduceOp, prescale factor) of a torch ReduceOp (PREMUL_SUM: Sum after scaling)."""
    kind = red.op if hasattr(red, "op") else red
    if kind == _RedOp.PREMUL_SUM:
        factor = red.factor
        if isinstance(factor, torch.Tensor):
            factor = float(factor.item())
        return ReduceOp.SUM, float(factor)
    try:
        return OPS[kind], 1.0
    except KeyError:
        raise ValueError(f"mpidp backend: reduce op {kind} is not supported") from None


def flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of contiguous `t` (a copy if not contiguous), as bytes if the engine does not
    know its dtype (complex, unsigned wider than 8 bits, 8-bit floats): moving bytes is exact."""
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    return flat if flat.dtype in SUPPORTED else flat.view(_BYTE)


def reducible(t: torch.Tensor, op: ReduceOp, what: str) -> torch.Tensor:
    """The tensor the engine reduces for `t`: complex numbers as their real pairs (a sum or an
    average is the same on both parts); a TypeError for a dtype no reduction is defined on."""
    if t.is_complex():
        if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
            raise TypeError(
                f"{what}: {op.name} is not defined for complex tensors; only SUM, "
                f"AVG and PREMUL_SUM are"
            )
        return torch.view_as_real(t)
    if t.dtype not in SUPPORTED:
        raise TypeError(
            f"{what}: the mpidp backend does not reduce {t.dtype} tensors; it "
            f"reduces {', '.join(str(d).replace('torch.', '') for d in SUPPORTED)} "
            f"and complex"
        )
    return t


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` (bytes or values, flat) into the caller's tensor `dst` unless it is `dst`."""
    if (
        src.data_ptr() == dst.data_ptr()
        and src.numel() * src.element_size() == dst.numel() * dst.element_size()
    ):
        return
    flat = dst.reshape(-1) if dst.is_contiguous() else None
    if flat is not None and flat.dtype not in SUPPORTED:
        flat = flat.view(_BYTE)
    if flat is not None and flat.data_ptr() == dst.data_ptr():
        flat.copy_(src.reshape(flat.shape))
    else:
        dst.copy_(
            src.view(dst.dtype).reshape(dst.shape)
            if src.dtype != dst.dtype
            else src.reshape(dst.shape)
        )


def filled(dst: torch.Tensor, src: torch.Tensor, result):
    """`result`, once `src` is in `dst` (copy_into): a Work's finish."""
    copy_into(dst, src)
    return result
