"""Clipping by the global norm of gradients that are spread over the ranks of a process set."""

import torch

from ..ops import Max, Sum, collectives


def clip_(
    grads, max_norm: float, norm_type: float, error_if_nonfinite: bool, process_set
) -> torch.Tensor:
    """Scale `grads` (this rank's part of the gradients) in place so that the norm of order
    `norm_type` over every rank's parts is at most `max_norm`, with the coefficient
    torch.nn.utils.clip_grad_norm_ uses; returns that norm (computed in float64).
    Synchronization: one allreduce of a scalar over the set."""
    if norm_type == float("inf"):
        local = max(
            (g.detach().abs().max().double() for g in grads),
            default=torch.zeros((), dtype=torch.float64),
        )
        total = collectives.allreduce(
            local.reshape(1), name="mpidp.grad_norm.clip", op=Max, process_set=process_set
        )[0]
    else:
        local = sum(
            (g.detach().double().abs().pow(norm_type).sum() for g in grads),
            torch.zeros((), dtype=torch.float64),
        )
        total = collectives.allreduce(
            local.reshape(1), name="mpidp.grad_norm.clip", op=Sum, process_set=process_set
        )[0].pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} of the "
            f"gradients is non-finite ({total.item()})"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total.to(grads[0].dtype if grads else torch.float32)
