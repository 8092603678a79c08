"""ShardedGradScaler: torch's GradScaler, agreeing across ranks on whether to skip a step."""

import torch
from torch.amp.grad_scaler import OptState

from ..ops import Max, collectives


class ShardedGradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler for ShardedOptimizer (what FSDP's ShardedGradScaler is to FSDP).

    With sharded gradients each rank sees only its shard, so an inf or NaN shows on one rank
    only; with the plain GradScaler that rank would skip step() while the others block in its
    allgather. unscale_() here first waits for the reduced gradients (optimizer.synchronize())
    and then takes the maximum of the inf/NaN flags over the optimizer's process set, so every
    rank skips or steps alike and update() changes the scale alike. Use it as GradScaler:
    scaler.scale(loss).backward(); scaler.step(opt); scaler.update(). With a DistributedOptimizer
    the same holds: torch's GradScaler there decides on each rank's own unreduced gradients, so
    a rank that alone overflowed skipped step() and left its peers waiting in the reduction
    (Horovod's remedy is synchronize(), unscale_(), then step() in skip_synchronize(); this
    scaler does that itself). Synchronization: unscale_() (called by step() if the script did
    not) waits for the reduction and runs one scalar allreduce.
    """

    def unscale_(self, optimizer) -> None:
        """GradScaler.unscale_, after the optimizer's reduction, with the inf/NaN flag agreed
        over its process set. Synchronization: the reduction, then one scalar allreduce."""
        if not self._enabled:
            return
        if getattr(optimizer, "is_sharded", False) or _unsynchronized(optimizer):
            optimizer.synchronize()
        super().unscale_(optimizer)
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        local = sum(
            (v.double().sum() for v in found.values()), torch.zeros((), dtype=torch.float64)
        )
        rounds = getattr(optimizer, "join_rounds", None)  # a ShardedOptimizer's (join.py)
        assert self._scale is not None  # unscale_ follows scale(), which made it
        if rounds is not None:
            rounds.announce("unscale", self._scale.double().reciprocal().float().item())
        flag = (_agree(local, getattr(optimizer, "process_set", None)) > 0).float()
        if not found:
            found[self._scale.device] = flag.to(self._scale.device)
        for device, value in found.items():
            value.copy_(flag.to(value.device))

    def step(self, optimizer, *args, **kwargs):
        """GradScaler.step; a step skipped for an inf or NaN is announced to joined ranks.
        Synchronization: unscale_()'s (if not called yet), then the optimizer's step()."""
        if not _reduces_gradients(optimizer) or not self._enabled:  # disabled: a plain step
            result = super().step(optimizer, *args, **kwargs)
        else:
            # Unscaled here even for a fused optimizer, which GradScaler.step would hand the
            # scale and a flag from this rank's own unreduced gradients.
            if (
                self._enabled
                and self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY
            ):
                self.unscale_(optimizer)
            with optimizer.skip_synchronize():  # unscale_() reduced the gradients already
                result = super().step(optimizer, *args, **kwargs)
            optimizer.step_state.stepped()  # also after a skipped step: the next one reduces
        rounds = getattr(optimizer, "join_rounds", None)
        if rounds is not None and self._enabled:
            found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            if sum(v.item() for v in found.values()):
                rounds.announce("skip")
        return result


def _reduces_gradients(optimizer) -> bool:
    """A DistributedOptimizer that reduces whole gradients (not a ShardedOptimizer, nor
    Adasum's, which reduces updates)."""
    return getattr(optimizer, "reduces_gradients", False)


def _unsynchronized(optimizer) -> bool:
    """Such an optimizer whose gradients are not reduced yet this step."""
    return _reduces_gradients(optimizer) and not optimizer.step_state.synchronized


def _agree(local: torch.Tensor, process_set) -> torch.Tensor:
    """Whether any rank of the set found an inf or NaN (> 0). Synchronization: one allreduce."""
    return collectives.allreduce(
        local.reshape(1), name="mpidp.grad_scaler.found_inf", op=Max, process_set=process_set
    )[0]


def unscale_joined(optimizer, inv_scale: float) -> None:
    """unscale_() on a joined rank serving a ShardedOptimizer (join.py): unscale this
    rank's chunks of the reduced gradients by the training ranks' `inv_scale` and take part in
    agreeing on the inf/NaN flag. Synchronization: one scalar allreduce over the set."""
    grads = [s.grad for s in optimizer.shards if s.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    found = torch.zeros(1, device=device)
    inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
    for g in grads:  # the kernel GradScaler.unscale_ runs, so the products are the same
        torch._amp_foreach_non_finite_check_and_unscale_([g], found, inv)
    _agree(found.double().sum(), optimizer.process_set)
