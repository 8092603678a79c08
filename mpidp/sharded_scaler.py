"""ShardedGradScaler: torch's GradScaler, agreeing across ranks on whether to skip a step."""

import torch

from . import collectives
from .ops import Max


class ShardedGradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler for ShardedOptimizer (what FSDP's ShardedGradScaler is to FSDP).

    With sharded gradients each rank sees only its shard, so an inf or NaN shows on one rank
    only; with the plain GradScaler that rank would skip step() while the others block in its
    allgather. unscale_() here first waits for the reduced gradients (optimizer.synchronize())
    and then takes the maximum of the inf/NaN flags over the optimizer's process set, so every
    rank skips or steps alike and update() changes the scale alike. Use it as GradScaler:
    scaler.scale(loss).backward(); scaler.step(opt); scaler.update(). Works with any optimizer
    (for a DistributedOptimizer the flags already agree: it costs one scalar allreduce).
    Synchronization: unscale_() (called by step() if the script did not) waits for the
    reduction and runs one scalar allreduce.
    """

    def unscale_(self, optimizer) -> None:
        """GradScaler.unscale_, after the optimizer's reduction, with the inf/NaN flag agreed
        over its process set. Synchronization: the reduction, then one scalar allreduce."""
        if not self._enabled:
            return
        if getattr(optimizer, "is_sharded", False):
            optimizer.synchronize()
        super().unscale_(optimizer)
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        local = sum((v.double().sum() for v in found.values()),
                    torch.zeros((), dtype=torch.float64))
        agreed = collectives.allreduce(local.reshape(1), name="mpidp.grad_scaler.found_inf",
                                       op=Max,
                                       process_set=getattr(optimizer, "_process_set", None))
        flag = (agreed[0] > 0).float()
        if not found:
            found[self._scale.device] = flag.to(self._scale.device)
        for device, value in found.items():
            value.copy_(flag.to(value.device))
