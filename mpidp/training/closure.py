"""An optimizer's closure made to average what it computes: its gradients and the loss."""

import torch

from .. import ops


def reduced(closure, synchronize, stepped, process_set):
    """`closure` whose gradients (`synchronize()`) and returned loss are averaged over
    `process_set`, so that an optimizer calling it several times (LBFGS) decides alike on every
    rank; `stepped()` marks the step's own reduction done. Synchronization, at each call:
    synchronize()'s, then one allreduce of the loss."""

    def call():
        loss = closure()
        synchronize()
        stepped()  # the step's own: no "reduced a second time" warning later
        if loss is None:
            return None
        value = torch.as_tensor(loss).detach().to(torch.float64).reshape(1)
        avg = ops.synchronize(
            ops.allreduce_async(value, name="mpidp.closure_loss", process_set=process_set)
        )
        if isinstance(loss, torch.Tensor):
            return avg.to(loss.dtype).reshape(loss.shape)
        return avg.item()  # a float, whatever number type the closure returned

    return call
