"""OptimizerWrapper: a torch optimizer reached through a wrapper of a class built from its own."""

from typing import Dict, Tuple

import torch

_made: Dict[Tuple[type, type], type] = {}


def _forwarded(name: str) -> property:
    """An attribute of the wrapper that is the wrapped optimizer's (get, set and delete)."""
    return property(
        lambda self: getattr(self._opt, name),
        lambda self, value: setattr(self._opt, name, value),
        lambda self: delattr(self._opt, name),
    )


def mixed(cls: type, optimizer) -> type:
    """`cls` made a subclass of `optimizer`'s class too, as Horovod does: `isinstance(opt,
    torch.optim.SGD)` holds for a wrapped SGD and its class is named SGD. `cls` itself for
    anything else (not an optimizer, a wrapper already, or a class that cannot be mixed)."""
    base = type(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, OptimizerWrapper):
        return cls  # the wrapper's __init__ says what is wrong
    made = _made.get((cls, base))
    if made is None:
        try:
            made = type(
                base.__name__,
                (cls, base),
                {"__module__": cls.__module__, "__qualname__": base.__qualname__},
            )
        except TypeError:  # a metaclass or layout that does not mix: the plain wrapper
            made = cls
        _made[(cls, base)] = made
    return made


class OptimizerWrapper(torch.optim.Optimizer):
    """Holds a torch optimizer as `_opt` and reaches every attribute it does not define itself
    there (`param_groups`, `state`, `defaults`, ...), so LR schedulers and GradScaler work
    unchanged. torch.optim.Optimizer.__init__ is never called: the state lives in `_opt`."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.__dict__["_opt"] = optimizer

    def __getattr__(self, name):
        return getattr(self.__dict__["_opt"], name)

    param_groups = property(
        lambda self: self._opt.param_groups,
        lambda self, value: setattr(self._opt, "param_groups", value),
    )
    state = property(lambda self: self._opt.state)
    defaults = property(lambda self: self._opt.defaults)
    # GradScaler.step hands a fused optimizer (`_step_supports_amp_scaling`) its scale and inf
    # flag as attributes, which that optimizer's step() reads from itself.
    grad_scale = _forwarded("grad_scale")
    found_inf = _forwarded("found_inf")

    def state_dict(self):
        return self._opt.state_dict()

    def load_state_dict(self, state_dict):
        return self._opt.load_state_dict(state_dict)
