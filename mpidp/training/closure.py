"""step(closure) of a DistributedOptimizer: each call of the closure reduced, loss included."""

import torch

from .. import ops


def reduced(opt, closure):
    """`closure` whose gradients (opt.synchronize()) and returned loss are averaged over the
    optimizer's set, so that an optimizer calling it several times (LBFGS) decides alike on
    every rank. Synchronization: opt.synchronize()'s, then one allreduce of the loss."""
    def call():
        loss = closure()
        opt.synchronize()
        opt.step_state.stepped()  # the step's own: no "reduced a second time" warning later
        if loss is None:
            return None
        value = torch.as_tensor(loss).detach().to(torch.float64).reshape(1)
        avg = ops.synchronize(ops.allreduce_async(value, name="mpidp.closure_loss",
                                                  process_set=opt.process_set))
        if isinstance(loss, torch.Tensor):
            return avg.to(loss.dtype).reshape(loss.shape)
        return avg.item()  # a float, whatever number type the closure returned
    return call
