"""DistributedOptimizer(op=Adasum): local steps on each rank's gradients, updates Adasum-reduced.

Horovod's `_DistributedAdasumOptimizer` (horovod/torch/optimizer.py), built the way the rest of
mpidp's optimizer is (gradient buckets, hooks after accumulation):

- When a bucket's gradients are ready (after `backward_passes_per_step` passes), the wrapped
  optimizer steps on that bucket's parameters alone, with this rank's own accumulated gradients
  (neither reduced nor averaged); parameters without a gradient are skipped by it and so have
  an update of zero. The update (new value minus old) replaces each parameter's value, as in
  Horovod, and is reduced in place with op=Adasum, one op per bucket, each parameter with its
  own dot products (as Horovod's one op per parameter, fused). The old values wait in a buffer
  as large as the parameters.
- step() waits for the reductions and sets each parameter to its old value plus the reduced
  update: the same bits on every rank.
- The learning rate is the wrapped optimizer's, untouched: Horovod's guide advises the best
  single-worker learning rate, possibly times 2-2.5, not times the number of ranks.
- synchronize() does nothing (there is no reduced gradient to wait for) and skip_synchronize()
  is refused, as in Horovod; so gradient clipping of reduced gradients has no place here.
- On one rank (or a rank outside the process set) it is the plain optimizer, whose gradients
  Adasum over one rank leaves as they are, as Horovod does there.
"""

import torch

from .. import ops
from ..runtime.process_sets import member_of
from .optimizer import DistributedOptimizer


class AdasumOptimizer(DistributedOptimizer):
    """What DistributedOptimizer(optimizer, op=mpidp.Adasum, ...) is (see the module docstring)."""

    completes_in_backward = False  # the updates are reduced in step()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._deltas = (
            not self._outside and member_of(self._process_set, "DistributedOptimizer")[1].size > 1
        )
        self._starts = {}  # parameter -> its value before the local step (Horovod's "start")

    def _start(self, p) -> torch.Tensor:
        start = self._starts.get(p)
        if start is None:
            start = self._starts[p] = torch.empty_like(
                p, memory_format=torch.contiguous_format, requires_grad=False
            )
        return start

    def _local_step(self, params) -> None:
        """The wrapped optimizer's step on `params` alone: the others are hidden from it."""
        chosen = {id(p) for p in params}
        groups = self._opt.param_groups
        kept = [group["params"] for group in groups]
        try:
            for group in groups:
                group["params"] = [p for p in group["params"] if id(p) in chosen]
            self._opt.step()
        finally:
            for group, params_of in zip(groups, kept):
                group["params"] = params_of

    def _submit(self, bucket) -> None:
        """Step the bucket's parameters locally and start the Adasum of their updates."""
        if not self._deltas:
            super()._submit(bucket)
            return
        bucket.submitted = True
        params = bucket.params
        with torch.no_grad():
            starts = [self._start(p) for p in params]
            for start, p in zip(starts, params):
                start.copy_(p)
            self._local_step(params)
            for start, p in zip(starts, params):
                p.sub_(start)
        wires, ctxs = [], []
        for p in params:
            wire, ctx = self._compression.compress(p.detach())
            wires.append(wire)
            ctxs.append(ctx)
        bucket.dense, bucket.sparse, bucket.wires, bucket.ctxs = params, [], wires, ctxs
        bucket.handle = ops.grouped_allreduce_async_(
            wires, name=bucket.name, op=self._op, process_set=self._process_set
        )

    @property
    def reduces_gradients(self) -> bool:
        """False with Adasum on more than one rank: the updates are reduced, not gradients."""
        return not self._deltas

    def synchronize(self) -> None:
        """A no-op with Adasum on more than one rank, as in Horovod: step() waits for the
        reduced updates. Otherwise DistributedOptimizer.synchronize()."""
        if not self._deltas:
            super().synchronize()

    def skip_synchronize(self):
        """Refused with Adasum on more than one rank, as in Horovod (the step has already run
        on the local gradients when they were ready); otherwise as DistributedOptimizer's."""
        if self._deltas:
            raise RuntimeError(
                "DistributedOptimizer(op=Adasum): skip_synchronize() is not "
                "supported, as in Horovod: the wrapped optimizer steps on each "
                "rank's own gradients as soon as they are ready and the updates "
                "are reduced, so there is no reduced gradient to modify before "
                "step(); call step() alone"
            )
        return super().skip_synchronize()

    def step(self, closure=None):
        """Submit what the hooks have not (local steps included), wait for every bucket's
        Adasum, set each parameter to its old value plus the reduced update; returns the
        closure's loss. Synchronization: blocks until every rank of the set has submitted the
        same buckets."""
        if not self._deltas:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with ops.blocking():  # waited for right below: run here, not handed to the engine
            self._submit_rest()
        try:
            for bucket in self._buckets:
                handle, bucket.handle = bucket.handle, None
                ops.synchronize(handle)
                with torch.no_grad():
                    for p, wire, ctx in zip(bucket.dense, bucket.wires, bucket.ctxs):
                        start = self._starts[p]
                        start.add_(self._compression.decompress(wire, ctx))
                        p.copy_(start)
        finally:
            self._end_step()
        return loss


DistributedOptimizer.variants[ops.Adasum] = AdasumOptimizer
