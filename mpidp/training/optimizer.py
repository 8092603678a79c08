"""DistributedOptimizer: wraps any torch optimizer; gradients are reduced in buckets when ready."""

import itertools
import warnings
from typing import Dict

import torch

from .. import ops
from ..log import logger
from ..ops import Average, op_args
from ..ops.compression import Compression
from ..ops.eager import eager
from ..ops.sparse import SparseGradients
from ..runtime import world
from ..runtime.process_sets import is_outside, member_of
from . import gradients, overlap, pass_guard, wrapped
from .buckets import Bucket, bucket_caps, claim, group_ids, make_buckets, named, release
from .closure import reduced as reduced_closure
from .step_state import Phase, StepState

_created = itertools.count()


class DistributedOptimizer(wrapped.OptimizerWrapper):
    """Wraps `optimizer`; averages gradients across ranks, overlapping the backward pass.

    As in Horovod, its class is built from the wrapped optimizer's: `isinstance(opt,
    torch.optim.SGD)` holds for a wrapped SGD. The state stays in the wrapped optimizer, reached
    through this one (wrapped.OptimizerWrapper), so LR schedulers and GradScaler work unchanged.
    """

    # Whether a backward pass that readies every gradient waits for their reduction (the
    # `reduce_in_backward` knob); the variants that reduce otherwise say no.
    completes_in_backward = True
    # Reduce ops whose optimizer works otherwise register their subclass here, so that this
    # module never imports it (op=Adasum reduces updates, not gradients: adasum_optimizer.py).
    variants: dict = {}

    def __new__(cls, *args, **kwargs):
        op = kwargs.get("op", args[4] if len(args) > 4 else None)
        if cls is DistributedOptimizer and isinstance(op, int):
            cls = DistributedOptimizer.variants.get(op, cls)
        return super().__new__(
            wrapped.mixed(cls, kwargs.get("optimizer", args[0] if args else None))
        )

    def __init__(
        self,
        optimizer,
        named_parameters=None,
        compression=Compression.none,
        backward_passes_per_step: int = 1,
        op=Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups=None,
        sparse_as_dense: bool = False,
        process_set=None,
    ):
        # torch.optim.Optimizer.__init__ is deliberately not called: the state lives in the
        # wrapped optimizer, and attribute access falls through to it.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"DistributedOptimizer wraps a torch.optim.Optimizer, not "
                f"{type(optimizer).__name__}"
            )
        if isinstance(optimizer, DistributedOptimizer):
            # Two wrappers would hook every parameter twice, and the second submission of a
            # gradient would be refused as "already in flight", which hides the real mistake.
            raise ValueError(
                "DistributedOptimizer: this optimizer is already a "
                "DistributedOptimizer; wrap the plain torch optimizer once (pass "
                "`opt` rather than `DistributedOptimizer(opt)`)"
            )
        # A rank outside the set does what Horovod does there: no hooks, synchronize() does
        # nothing, step() applies the local gradients. Any other bad set is refused here.
        self._outside = is_outside(process_set)
        member = None if self._outside else member_of(process_set, "DistributedOptimizer")[1]
        op = op_args.resolve_op(None, op, "DistributedOptimizer", member and member.size)
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor needs op=Average")
        if gradient_predivide_factor <= 0:
            raise ValueError("gradient_predivide_factor must be > 0")
        super().__init__(optimizer)
        self._process_set = process_set
        self._set_id = None if member is None else member.set_id
        # Kept whole: parameters added or unfrozen later are named from it too.
        self._named_list = None if named_parameters is None else list(named_parameters)
        self._grouping = (num_groups, groups)
        self._compression = compression
        self._op = op
        # Predivide: divide by the factor before the sum, multiply by it after (where the
        # engine also divides by size for Average).
        self._pre = 1.0 / gradient_predivide_factor
        self._post_factor = gradient_predivide_factor
        # Only this class's own submission reduces sparse gradients as sparse ops.
        self._sparse_ops = not (
            sparse_as_dense
            or self._outside
            or type(self)._submit is not DistributedOptimizer._submit
        )
        self._step = StepState()
        self.set_backward_passes_per_step(backward_passes_per_step)
        self._seq = next(_created)  # the same on every rank: they create optimizers alike
        self._in_backward = self.completes_in_backward and world.state().config.reduce_in_backward
        self._hooks: list = []
        self._said_held = False  # the warning that a later hook holds a bucket
        self._hook_id: Dict[torch.Tensor, int] = {}  # each trained parameter's hook handle id
        self._guards = pass_guard.Guards([], self._before_accumulation)
        self._layout()
        self._overlap = overlap.decide(world.state(), self._trained)
        # Timed through this class's step(); the variants that step otherwise keep decide()'s.
        own_step = type(self).step is DistributedOptimizer.step
        self._trial = (
            overlap.trial(
                world.state(),
                self._trained,
                process_set,
                f"mpidp.overlap_trial.{self._seq}",
            )
            if own_step and not self._outside
            else None
        )
        if self._trial is not None:
            self._set_overlap(self._trial.mode)

    def __repr__(self):
        return f"DistributedOptimizer({self._opt!r})"

    @property
    def step_state(self) -> StepState:
        """Where this optimizer's training step stands (its phase, passes and marks)."""
        return self._step

    @property
    def process_set(self):
        """The process set whose ranks the gradients are reduced over (None: every rank)."""
        return self._process_set

    @property
    def reduces_gradients(self) -> bool:
        """Whether step() applies gradients averaged over the set (not so for variants that
        reduce otherwise: updates, or shards of the gradients)."""
        return True

    def in_flight(self) -> bool:
        """A step has begun: some bucket is submitted, or has gradients waiting for step()."""
        return any(b.submitted or b.ready for b in self._buckets)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """How many backward passes accumulate before a gradient is reduced."""
        if not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be an int >= 1, got {passes!r}")
        self._step.passes_per_step = passes

    # ---- the parameters' layout ----

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
        config = world.state().config
        cap, last_cap = bucket_caps(config, world.link_slow())
        first_cap = config.first_bucket_bytes
        self._buckets = make_buckets(
            trained, self._names, groups, cap, first_cap=first_cap, last_cap=last_cap
        )
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._hooks = [
            p.register_post_accumulate_grad_hook(pass_guard.weak(self._hook)) for p in trained
        ]
        self._hook_id = {p: h.id for p, h in zip(trained, self._hooks)}
        self._guards.reset(trained)

    @property
    def _overlap(self) -> bool:
        """Whether buckets are submitted during backward (the `overlap` knob)."""
        return self._overlapping

    @_overlap.setter
    def _overlap(self, flag: bool) -> None:
        # Set from outside (a benchmark's or a test's forced mode), it ends `auto`'s trial.
        self._trial = None
        self._set_overlap(flag)

    def _set_overlap(self, flag: bool) -> None:
        self._overlapping = bool(flag)
        self._guards.set(self._overlapping)

    def overlap_settled(self) -> bool:
        """Whether the overlap mode is fixed: set by the knob or the core rule, or `auto`'s
        timing of both modes across hosts is over (overlap.Trial; the same step on every rank).
        Synchronization: none."""
        return self._trial is None or self._trial.choice is not None

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
            raise ValueError(
                "DistributedOptimizer.add_param_group() was called during a step "
                "(after backward, before step() or synchronize()); add parameter "
                "groups between steps"
            )
        self._opt.add_param_group(param_group)
        if self._named_list is not None:
            known = {p for _, p in self._named_list}
            index = len(self._opt.param_groups) - 1
            self._named_list += [
                (f"allreduce.noname.{index}.{j}", p)
                for j, p in enumerate(self._opt.param_groups[-1]["params"])
                if p not in known
            ]
        self._layout()

    def _follow_requires_grad(self) -> None:
        """A new layout if, before any gradient of this step, the script has frozen or unfrozen
        parameters since the last (the same way on every rank, as the program is the same)."""
        if (
            self._step.phase is Phase.IDLE
            and not self.in_flight()
            and (
                any(p.requires_grad for p in self._frozen)
                or not all(p.requires_grad for p in self._trained)
            )
        ):
            self._layout()

    # ---- during backward ----

    def _too_many_passes(self, p) -> RuntimeError:
        return pass_guard.too_many_passes(self._names[p], self._step.passes_per_step, self._overlap)

    def _before_accumulation(self, p, grad) -> None:
        # Nothing is in flight once the step completed (torch.autograd.grad after backward
        # passes here too, and accumulates nothing).
        if self._step.one_too_many(p):
            raise self._too_many_passes(p)

    def _hook(self, p) -> None:
        step = self._step
        if not step.counting:
            return
        if step.phase is Phase.REDUCED:
            # Another backward pass after the step was reduced in one: its gradients add to
            # the averaged ones, and are reduced in turn (linear: as DDP accumulates).
            self._end_step()
        if step.phase is Phase.IDLE:  # the step's first gradient
            self._follow_requires_grad()
        if self._in_backward and not step.end_queued:  # this backward pass's first
            step.end_queued = pass_guard.at_backward_end(
                self._seq, pass_guard.weak(self._backward_ended)
            )
        count = step.count(p)
        if count < step.passes_per_step:
            return
        bucket = self._bucket_of.get(p)
        if bucket is None:  # torch handed on another tensor: an earlier hook returned it
            raise RuntimeError(
                "a post-accumulate-grad hook registered before "
                "DistributedOptimizer's returned a value; such hooks must "
                "return None"
            )
        if count > step.passes_per_step or bucket.submitted:
            raise self._too_many_passes(p)
        bucket.ready += 1
        if bucket.ready == len(bucket.params) and self._overlap:
            if not pass_guard.hooked_after(p, self._hook_id.get(p)):
                self._submit(bucket)
            elif not self._said_held:  # once: the same hooks hold the same buckets each step
                self._said_held = True
                logger.warning(pass_guard.held_by_a_later_hook(self._names[p]))

    def _submit(self, bucket: Bucket) -> None:
        """Start the reduction of `bucket` (gradients.submit); variants override it."""
        gradients.submit(
            bucket,
            self._names,
            self._is_sparse,
            self._compression,
            self._op,
            self._pre,
            self._post_factor,  # Average's 1/size is applied by the engine (scaling.py)
            self._process_set,
        )

    def _backward_ended(self) -> None:
        """A backward pass that reached this optimizer's parameters ended: the step's
        `backward_passes_per_step`-th reduces every gradient (zeros for parameters it did not
        reach) before backward() returns, as DDP does; the count is the same on every rank
        whatever parameters each one's loss reached. A backward nested in another (reentrant
        checkpointing) is part of the outer one, whose end counts."""
        step = self._step
        step.end_queued = pass_guard.after_outer_node(
            self._seq, pass_guard.weak(self._backward_ended)
        )
        if step.end_queued:  # nested: the outer pass's end counts
            return
        if step.backward_ended():
            self._reduce()
            step.reduced()

    # ---- user-facing steps ----

    @eager
    def synchronize(self) -> None:
        """Wait until every gradient is reduced; submit any bucket that was not (zeros for
        parameters without a gradient). Synchronization: blocks until every rank has
        submitted the same buckets (nothing more when the backward pass already did)."""
        if self._step.phase is not Phase.REDUCED:
            self._reduce()
        self._end_step()
        self._step.synchronize_done()

    def _reduce(self) -> None:
        """Submit what is left, wait for every bucket, put the results in .grad."""
        self._follow_requires_grad()  # first: a new layout has its sparse kinds agreed anew
        kinds = self._is_sparse
        if kinds.pending and not kinds.as_dense:  # they decide how buckets are submitted
            kinds.agree(self._buckets, self._process_set)
        with ops.blocking():  # waited for right below: run here, not handed to the engine
            self._submit_rest()
        if kinds.pending:  # sparse_as_dense: from the layouts every gradient had before
            kinds.agree(self._buckets, self._process_set)
        try:
            for bucket in self._buckets:
                gradients.collect(bucket, self._compression, kinds)
        except BaseException:
            self._end_step()
            raise

    def _submit_rest(self) -> None:
        """Submit every bucket the hooks have not."""
        self._follow_requires_grad()
        for bucket in self._buckets:
            if not bucket.submitted:
                self._submit(bucket)

    def _end_step(self) -> None:
        """Every bucket empty and every pass count zero again: the next step may start."""
        self._step.end(self._buckets)

    def skip_synchronize(self):
        """Inside, step() does not synchronize (use after an explicit synchronize())."""
        return self._step.skip_synchronize()

    def no_sync(self):
        """Inside, backward passes accumulate gradients locally without counting or reducing."""
        return self._step.no_sync()

    def step(self, closure=None):
        """Synchronize gradients (unless inside skip_synchronize()), then step the optimizer.
        A closure is reduced at each call: the gradients it makes are averaged, and so is the
        loss it returns (detached), so that LBFGS decides alike on every rank. Synchronization:
        synchronize()'s, one allreduce of the loss per call of the closure, and at the last step
        of `auto` overlap's trial one allreduce of its medians (overlap.Trial)."""
        if self._step.should_sync:
            if self._step.warn_double_sync(self.in_flight()):
                # Horovod's words first: scripts and tests match on them.
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() "
                    "after optimizer.synchronize(): gradients are reduced a second "
                    "time; step inside `with optimizer.skip_synchronize():`",
                    UserWarning,
                    stacklevel=2,
                )
            if closure is None or self.in_flight():
                self.synchronize()
            if closure is not None:
                closure = reduced_closure(
                    closure, self.synchronize, self._step.stepped, self._process_set
                )
        self._step.stepped()
        result = self._opt.step(closure)
        if self._trial is not None and self._trial.choice is None:
            self._set_overlap(self._trial.step_ended())
        return result

    def zero_grad(self, set_to_none: bool = True):
        """Clear gradients; refuses while reductions are in flight (call step() first); the
        gradients of a step the backward pass already reduced are dropped (a skipped step)."""
        if self._step.phase is Phase.REDUCED:
            self._end_step()
        if self.in_flight():
            raise ValueError(
                "optimizer.zero_grad() was called after loss.backward() but "
                "before optimizer.step() or optimizer.synchronize(); gradients "
                "are being reduced. Call step() (or synchronize()) first. "
                + pass_guard.OTHER_BACKWARD
            )
        return self._opt.zero_grad(set_to_none=set_to_none)
