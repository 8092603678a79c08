"""DistributedOptimizer's layout: names, buckets and hooks of the parameters it reduces now."""

from typing import Dict, List, Optional, Tuple

import torch

from . import pass_guard, wrapped
from ..runtime import world
from .step_state import Phase
from .buckets import claim, group_ids, make_buckets, named, release
from ..ops.sparse import SparseGradients


class ParamLayout(wrapped.OptimizerWrapper):
    """The part of DistributedOptimizer that follows the script's parameters: laid out at
    wrapping, and again between steps after add_param_group() or a change of requires_grad.
    The subclass sets what `_layout` reads (`_named_list`, `_grouping`, `_set_id`, `_outside`,
    `_sparse_ops`, `_hooks`, `_guards`, `_step`) and defines `_hook`, `in_flight`."""

    _hooks: list
    _named_list: Optional[List[Tuple[str, torch.nn.Parameter]]]

    def _layout(self) -> None:
        """Names, buckets and hooks for the optimizer's parameters that require a gradient now
        (frozen ones get no hook and no bucket, as in Horovod). Run at wrapping, and again
        between steps when the parameters or their requires_grad change (kept requests go)."""
        for handle in self._hooks:
            handle.remove()
        self._names = named(self._opt, self._named_list)
        if self._set_id is not None:
            release(self)  # its own earlier names do not collide with the new ones
            self._names = claim(self, self._set_id, self._names)
        self._is_sparse = SparseGradients(not self._sparse_ops)  # kinds agreed anew
        live = [] if self._outside else list(self._names)
        trained = self._trained = [p for p in live if p.requires_grad]
        self._frozen = [p for p in live if not p.requires_grad]
        groups = group_ids(self._names, *self._grouping)
        self._buckets = make_buckets(trained, self._names, groups,
                                     world.state().config.bucket_bytes)
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._hooks = [p.register_post_accumulate_grad_hook(pass_guard.weak(self._hook))
                       for p in trained]
        self._guards.reset(trained)

    @property
    def _overlap(self) -> bool:
        """Whether buckets are submitted during backward (the `overlap` knob)."""
        return self._overlapping

    @_overlap.setter
    def _overlap(self, flag: bool) -> None:
        self._overlapping = bool(flag)
        self._guards.set(self._overlapping)

    @property
    def _parameter_names(self) -> Dict[torch.nn.Parameter, str]:
        """Parameter -> the name its gradient is reduced under (Horovod's map; scripts read it)."""
        return self._names

    def add_param_group(self, param_group):
        """Add a parameter group to the wrapped optimizer, as torch's add_param_group does, and
        reduce its gradients from the next step on (progressive unfreezing). Between steps only;
        every rank of the set must add the same group in the same order. A new parameter
        without a name in `named_parameters` (a module added after wrapping) is named by its
        position, as Horovod names them all without `named_parameters`."""
        if self.in_flight() or self._step.phase is not Phase.IDLE:
            raise ValueError("DistributedOptimizer.add_param_group() was called during a step "
                             "(after backward, before step() or synchronize()); add parameter "
                             "groups between steps")
        self._opt.add_param_group(param_group)
        if self._named_list is not None:
            known = {p for _, p in self._named_list}
            index = len(self._opt.param_groups) - 1
            self._named_list += [(f"allreduce.noname.{index}.{j}", p) for j, p in
                                 enumerate(self._opt.param_groups[-1]["params"])
                                 if p not in known]
        self._layout()

    def _follow_requires_grad(self) -> None:
        """A new layout if, before any gradient of this step, the script has frozen or unfrozen
        parameters since the last (the same way on every rank, as the program is the same)."""
        if self._step.phase is Phase.IDLE and not self.in_flight() and (
                any(p.requires_grad for p in self._frozen)
                or not all(p.requires_grad for p in self._trained)):
            self._layout()
