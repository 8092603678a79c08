"""Scale factors, written once: prescale before the reduction, Average's 1/size and postscale after.

Every data path and the sparse allreduce scale through these. Integers follow Horovod's rule:
multiplied by the double factor and cast back, so truncated toward zero (-3 averaged over 2
ranks is -1). Average is a sum whose postscale is divided by the number of ranks.
"""

import torch

from .messages import ReduceOp


def scale_(t: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply `t` by `factor` in place (integers: Horovod's rule); returns `t`."""
    if t.is_floating_point():
        t.mul_(factor)
    else:
        t.copy_(t.to(torch.float64).mul_(factor))
    return t


def after_factor(reduce_op: int, postscale: float, size: int) -> float:
    """What a reduced sum is multiplied by: the postscale, over `size` for Average."""
    return postscale / size if reduce_op == ReduceOp.AVERAGE else postscale


def scale_after(out: torch.Tensor, req, size: int) -> None:
    """Apply `req`'s Average and postscale to a reduced tensor, in place."""
    post = after_factor(req.reduce_op, req.postscale, size)
    if post != 1.0:
        scale_(out, post)


def work_copy(src: torch.Tensor, dtype: torch.dtype, req) -> torch.Tensor:
    """The buffer a reduction runs on: `src` itself when neither a dtype change nor `req`'s
    prescale is needed, else a copy in `dtype` with the prescale applied."""
    if dtype is src.dtype and req.prescale == 1.0:
        return src
    work = src.to(dtype, copy=True)
    if req.prescale != 1.0:
        scale_(work, req.prescale)
    return work
