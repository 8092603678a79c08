"""ShardedOptimizer: each rank keeps the optimizer state of its shard of the parameters (ZeRO).

Per step, for each bucket of gradients (the same buckets, hooks and accumulation rules as
DistributedOptimizer, one bucket per parameter group, dtype and device):
1. when its gradients are ready, they are packed end to end and reduce-scattered (Average)
   through the engine, overlapping the rest of the backward pass: each rank gets the averaged
   gradient of its equal chunk of the bucket (shard_layout.Layout);
2. step() steps the wrapped optimizer on this rank's chunks only (its param_groups hold each
   chunk in pieces, buffers.py, in place of the parameters, so its state is 1/N of the
   unsharded one);
3. the updated chunks are allgathered in place into the parameters' buffers.
Reduce-scatter plus allgather move what one allreduce moves. stage=1 moves each gradient, as
soon as backward makes it, into a persistent buffer per bucket (its .grad becomes a view there);
stage=2 frees the parameters' gradients once they are packed and keeps only the reduced chunk.
"""

from typing import Optional

import torch

from .. import ops
from ..ops import Average, functions
from ..ops.eager import eager
from ..runtime import world
from ..runtime.process_sets import member_of
from ..training import grad_norm
from ..training.buckets import make_buckets
from ..training.optimizer import DistributedOptimizer
from . import join, state_forms
from .buffers import ShardBuffers
from .layout import Layout
from .pack_pool import PackPool

_NOT_ELEMENTWISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon")  # state not per element


class ShardedOptimizer(DistributedOptimizer):
    """Wraps `optimizer`; each rank of the process set holds the optimizer state of 1/N of
    every bucket of parameters (see the module docstring). stage=1: optimizer state sharded;
    stage=2: gradients too. Works with optimizers that are elementwise per parameter (SGD,
    Adam, AdamW, RMSprop, ...), param groups, LR schedulers, backward_passes_per_step.
    Synchronization: step() waits for every bucket's reduce-scatter, then allgathers the
    updated parameters (every rank of the set must call it)."""

    completes_in_backward = False  # its synchronize() is a reduce-scatter for step()

    def __init__(
        self,
        optimizer,
        named_parameters=None,
        process_set=None,
        stage: int = 1,
        backward_passes_per_step: int = 1,
    ):
        if stage not in (1, 2) or isinstance(stage, bool):
            raise ValueError(
                f"ShardedOptimizer: stage must be 1 (optimizer state sharded) or "
                f"2 (gradients too), not {stage!r}"
            )
        if type(optimizer).__name__ in _NOT_ELEMENTWISE:
            raise ValueError(
                f"ShardedOptimizer: {type(optimizer).__name__} is not elementwise "
                f"per parameter, so its state cannot be cut into shards; use "
                f"DistributedOptimizer"
            )
        super().__init__(
            optimizer,
            named_parameters,
            backward_passes_per_step=backward_passes_per_step,
            process_set=process_set,
        )
        self._stage = stage
        self._consolidated: Optional[dict] = None
        self._reduced = False
        if self._outside:
            return
        member = member_of(process_set, "ShardedOptimizer")[1]
        self._size, self._rank = member.size, member.rank
        self._ranks = member.ranks
        full = self._opt.state_dict() if self._opt.state else None
        groups = self._opt.param_groups
        position: dict = {}
        group_of: dict = {}
        for gi, group in enumerate(groups):
            for p in group["params"]:
                position[p] = len(position)
                group_of[p] = gi
        self._group_indices = [[position[p] for p in g["params"]] for g in groups]
        trained = [p for p in self._names if p.requires_grad]
        self._buckets = make_buckets(
            trained, self._names, {}, world.state().config.bucket_bytes, group_of
        )
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._slot = {id(b): i for i, b in enumerate(self._buckets)}
        self._place = {
            p: (i, j) for i, b in enumerate(self._buckets) for j, p in enumerate(b.params)
        }
        self._layouts = [
            Layout(b.params, [position[p] for p in b.params], self._size, self._rank)
            for b in self._buckets
        ]
        # Every op of this optimizer is named under one tag: a joined rank serves the tag.
        self._tag = f"mpidp.sharded.{self._buckets[0].name if self._buckets else ''}/"
        self._join = join.Rounds(self, self._ranks, self._rank, self._tag)
        # The parameters move into one buffer per bucket (each a view of its place), so this
        # rank's shard is a view of them: stepped in place, and the allgather lands in place.
        self._bufs = [
            ShardBuffers(lay, b.params[0]) for lay, b in zip(self._layouts, self._buckets)
        ]
        self._shards = [buf.shard for buf in self._bufs]
        self._pool = PackPool(self._layouts, [b.params[0] for b in self._buckets])  # stage 2
        for gi, group in enumerate(groups):
            group["params"] = [
                piece
                for buf, b in zip(self._bufs, self._buckets)
                if group_of[b.params[0]] == gi
                for piece in buf.pieces
            ]
        if full is not None:
            state_forms.load_full(self._opt, self._layouts, self._pieces(), full)

    @property
    def is_sharded(self) -> bool:
        """Whether this rank's optimizer holds shards (False outside the process set)."""
        return not self._outside

    @property
    def reduces_gradients(self) -> bool:
        """False on the ranks of the set: each gets its shard of the gradients reduced."""
        return self._outside

    @property
    def shards(self):
        """This rank's shard of each bucket (its .grad the reduced gradient once synchronized);
        empty outside the process set."""
        return [] if self._outside else list(self._shards)

    @property
    def join_rounds(self):
        """The per-step exchange of who has joined (join.Rounds); None outside the set."""
        return None if self._outside else self._join

    def __repr__(self):
        return f"ShardedOptimizer({self._opt!r}, stage={self._stage})"

    def add_param_group(self, param_group):
        raise ValueError("ShardedOptimizer: add parameter groups before wrapping the optimizer")

    def _follow_requires_grad(self) -> None:
        changed = [
            self._names[p]
            for p in self._frozen + self._trained
            if p.requires_grad != (p in self._bucket_of)
        ]
        if changed and not self._outside:
            raise RuntimeError(
                f"ShardedOptimizer: parameters {changed[:5]} changed requires_grad "
                f"after wrapping; its shards are laid out once. Wrap it after "
                f"(un)freezing them (DistributedOptimizer follows such changes)"
            )

    def _hook(self, p) -> None:
        if self._stage == 1 and not self._outside:
            i, j = self._place[p]
            self._bufs[i].move_grad(p, j)
        super()._hook(p)

    def _pieces(self):
        """What the wrapped optimizer steps: each bucket's shard as a list of pieces."""
        return [buf.pieces for buf in self._bufs]

    def _submit(self, bucket) -> None:
        """Pack the bucket's gradients and start their reduce-scatter."""
        if self._outside:
            return super()._submit(bucket)
        bucket.submitted = True
        self._reduced = False
        self._join.submit()  # who has joined: with the step's first bucket, overlapping backward
        i = self._slot[id(bucket)]
        layout, first = self._layouts[i], bucket.params[0]
        grads = [
            None if p.grad is None else (p.grad.to_dense() if p.grad.is_sparse else p.grad)
            for p in bucket.params
        ]
        if self._stage == 1:
            flat = self._bufs[i].fill(bucket.params, grads)
        else:
            flat = layout.pack(grads, self._pool.take(i, first, layout.padded, self._collect))
            for p in bucket.params:
                p.grad = None
        bucket.handle = ops.reducescatter_into_async(
            flat,
            self._bufs[i].reduced_buffer(),
            name=self._tag + bucket.name,
            op=Average,
            process_set=self._process_set,
        )

    def _collect(self, i: int) -> None:
        """Wait for bucket i's reduce-scatter: its chunk's averaged gradient."""
        bucket = self._buckets[i]
        handle, bucket.handle = bucket.handle, None
        self._bufs[i].set_grad(ops.synchronize(handle))

    @eager
    def synchronize(self) -> None:
        """Submit what the hooks have not (zeros for parameters without a gradient), then wait
        for every bucket's reduce-scatter: each shard's .grad is then its averaged gradient.
        Calling it again before step() does nothing. Synchronization: blocks until every rank
        of the set has submitted the same buckets."""
        if self._outside:
            return super().synchronize()
        if self._reduced and not self.in_flight():
            return
        with ops.blocking():  # waited for right below: run here, not handed to the engine
            self._join.submit()
            self._submit_rest()
        try:
            for i, bucket in enumerate(self._buckets):
                if bucket.handle is not None:
                    self._collect(i)
            self._join.collect()
        finally:
            self._join.settle()  # a failed step's flags: now, not as the next step's round
            self._end_step()
            self._pool.release_all()
        self._reduced = True
        self.step_state.synchronize_done()

    def step(self, closure=None):
        """Reduce-scatter what is left, step the wrapped optimizer on this rank's shards,
        allgather the updated parameters; returns the closure's loss. Synchronization: every
        rank of the set (the reduce-scatters, then one allgather per bucket)."""
        if self._outside:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.step_state.should_sync:
            self.synchronize()
        elif not self._reduced:
            raise RuntimeError(
                "ShardedOptimizer.step() inside skip_synchronize() needs "
                "optimizer.synchronize() first: the shards have no reduced "
                "gradients yet"
            )
        self._join.announce("step", state_forms.options(self._opt.param_groups))
        self._consolidated = None
        for buf in self._bufs:
            buf.rehome()
        self._opt.step()
        self._reduced = False
        self.step_state.stepped()
        # In place: each shard is its rank's block of the home the others' blocks land in.
        with ops.blocking():
            handles = [
                ops.allgather_into_async(
                    buf.shard.detach(),
                    buf.home,
                    name=f"{self._tag}{b.name}.params",
                    process_set=self._process_set,
                )
                for buf, b in zip(self._bufs, self._buckets)
            ]
        for handle in handles:
            ops.synchronize(handle)
        return loss

    def zero_grad(self, set_to_none: bool = True):
        """Clear gradients: the shards' always; the parameters' as torch does (None, or zeros
        with set_to_none=False; stage 1's buffer is kept either way, and backward's next
        gradients are moved into it). Refuses while reductions are in flight (call step()
        first)."""
        if self._outside or self.in_flight():
            return super().zero_grad(set_to_none)
        for buf, bucket in zip(self._bufs, self._buckets):
            buf.set_grad(None)
            views = buf.views
            if views is not None and not set_to_none:
                assert buf.flat is not None  # made with the views
                buf.flat.zero_()
            for j, p in enumerate(bucket.params):
                if set_to_none or p.grad is None:
                    p.grad = None
                elif views is None or p.grad is not views[j]:
                    p.grad.zero_()
        self._reduced = False

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Scale the reduced gradients so that their global norm (over every parameter of every
        rank's shard) is at most `max_norm`, as torch.nn.utils.clip_grad_norm_ does for a whole
        model; returns the norm before clipping. Synchronizes first if step() has not.
        Synchronization: one allreduce of a scalar over the set."""
        norm_type = float(norm_type)
        if self._outside:
            params = [p for g in self._opt.param_groups for p in g["params"]]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
        self.synchronize()
        self._join.announce("clip", max_norm, norm_type, error_if_nonfinite)
        grads = [s.grad for s in self._shards if s.grad is not None]
        return grad_norm.clip_(grads, max_norm, norm_type, error_if_nonfinite, self._process_set)

    def _groups(self):
        return [
            dict(options, params=list(indices))
            for options, indices in zip(
                state_forms.options(self._opt.param_groups), self._group_indices
            )
        ]

    def sharded_state_dict(self) -> dict:
        """This rank's part of the state (state_forms.SHARDED_FORMAT); every rank's together
        load at any world size. No collective."""
        if self._outside:
            return self._opt.state_dict()
        return state_forms.local(
            self._opt, self._layouts, self._pieces(), self._groups(), self._size, self._rank
        )

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole state, in the wrapped optimizer's own per-parameter form, on global
        rank `to`, whose state_dict() then returns it (until the next step()).
        Synchronization: an allgather over the set; every rank of it must call this."""
        if self._outside:
            return
        if to not in self._ranks:
            raise ValueError(
                f"ShardedOptimizer.consolidate_state_dict: rank {to} is not in the "
                f"optimizer's process set (ranks {list(self._ranks)})"
            )
        parts = functions.allgather_object(
            self.sharded_state_dict(), name="mpidp.consolidate", process_set=self._process_set
        )
        self._consolidated = state_forms.assemble(parts) if world.rank() == to else None

    def state_dict(self):
        """The whole state in the wrapped optimizer's own form (loadable by it, by
        DistributedOptimizer, by ShardedOptimizer at any size), after
        consolidate_state_dict(to=this rank). No collective."""
        if self._outside:
            return self._opt.state_dict()
        if self._consolidated is None:
            raise RuntimeError(
                "ShardedOptimizer.state_dict(): each rank holds only its shard "
                "of the state; call optimizer.consolidate_state_dict(to=R) on "
                "every rank first, then state_dict() on rank R (or "
                "sharded_state_dict() on every rank, or save with "
                "mpidp.checkpoint.save / save_sharded)"
            )
        return self._consolidated

    def load_state_dict(self, state_dict) -> None:
        """Load the full form (from state_dict(), or the plain optimizer's), or every rank's
        sharded forms as a list, at any world size. No collective."""
        if self._outside:
            return self._opt.load_state_dict(state_dict)
        if isinstance(state_dict, (list, tuple)):
            state_dict = state_forms.assemble(list(state_dict))
        elif (
            isinstance(state_dict, dict) and state_dict.get("format") == state_forms.SHARDED_FORMAT
        ):
            raise ValueError(
                "ShardedOptimizer.load_state_dict: this is one rank's shard; pass "
                "the list of every rank's sharded_state_dict()"
            )
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
            raise ValueError(
                "ShardedOptimizer.load_state_dict: expected an optimizer state "
                "dict ('state' and 'param_groups') or a list of sharded ones"
            )
        sizes = [len(g.get("params", ())) for g in state_dict["param_groups"]]
        if sizes != [len(g) for g in self._group_indices]:
            raise ValueError(
                f"ShardedOptimizer.load_state_dict: the state's parameter groups "
                f"hold {sizes} parameters, the optimizer's "
                f"{[len(g) for g in self._group_indices]}"
            )
        state_forms.load_full(self._opt, self._layouts, self._pieces(), state_dict)
