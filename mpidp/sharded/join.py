"""join() with a ShardedOptimizer: a joined rank keeps stepping its shard until all ranks joined.

A joined rank owns part of the optimizer state and of every allgather, so it cannot sit out the
others' steps. Each step ("round") every rank of the optimizer's set allreduces one flag per rank
(1: joined), submitted with the step's first bucket, so it overlaps the backward pass like the
buckets. A joined rank, inside join(), runs rounds of its own: flag 1 and zero gradients for every
bucket under the same names (the engine counts it as joined for other names, whose allreduces get
its zeros as usual, but waits for it under the optimizer's tag, under which all its ops are named,
and under SHARED). While some rank is joined, the lowest rank still training announces each action
of the step that the joined ranks must take part in (a broadcast of (code, arguments)): "clip"
(clip_grad_norm_), "unscale" (ShardedGradScaler), then "step" (with the param groups' options, so
that a local LR schedule applies to the joined ranks' shards too) or "skip" (the scaler found an
inf). A round in which every flag is 1 ends the serving on every rank at once; join() then completes
as without it. With nobody joined nothing is announced: the flag is the whole cost.

join() serves one ShardedOptimizer: with several alive on a rank at once (a GAN's generator and
discriminator stepped in turn) it refuses on the joining rank, naming them, rather than serve one
and leave the training ranks waiting in the others' steps.
"""

import weakref
from typing import Optional

import torch

from .. import ops
from ..errors import MpidpError
from ..log import logger
from ..ops import Sum, functions
from ..runtime import world
from . import scaler

# Name prefixes of the scalar allreduces that clipping and the grad scaler share among optimizers.
SHARED = ("mpidp.grad_norm.", "mpidp.grad_scaler.")


class Rounds:
    """One ShardedOptimizer's per-step exchange of who has joined, and its announcements."""

    def __init__(self, opt, ranks, me: int, tag: str):
        self.ranks, self.me, self.tag, self.name = tuple(ranks), me, tag, tag + "joined"
        self.process_set = opt.process_set
        self.flags = torch.zeros(len(self.ranks), dtype=torch.int32)
        self.handle: Optional[int] = None
        self.request = self.cache_key = None
        self.current: Optional[list] = None  # this round's flags once collected (set order)
        self.joined = ()  # global ranks joined in the last round collected
        self.serving = False  # this rank is joined and runs rounds inside join()
        self.ref, self.registry = weakref.ref(opt), _registry()
        self.registry.latest = self.ref
        self.registry.alive.add(opt)

    def submit(self) -> None:
        """Start this round's flag allreduce unless it is in flight (no synchronization)."""
        if self.handle is not None:
            return
        self.flags.zero_()
        self.flags[self.me] = int(self.serving)
        if self.request is None:  # the checked path once; its request is reused after
            self.handle = ops.grouped_allreduce_async_(
                [self.flags], name=self.name, op=Sum, process_set=self.process_set
            )
            member = world.state().handles.members(self.handle)[0]
            self.request, self.cache_key = member.request, member.cache_key
        else:
            self.handle = ops.bucket_allreduce_async_(
                self.request, [self.flags], self.process_set, self.cache_key
            )

    def collect(self) -> None:
        """Wait for this round's flags. Synchronization: every rank of the set submitted them."""
        handle, self.handle = self.handle, None
        if handle is None:
            return
        ops.synchronize(handle)
        self.registry.latest = self.ref
        self.current = self.flags.tolist()
        self.joined = tuple(r for r, f in zip(self.ranks, self.current) if f)

    def settle(self) -> None:
        """After a failed step: wait for this round's flags, if submitted, and drop them, so
        that the next step starts a round of its own (collecting this one there put every rank
        a round behind, and a rank joining then waited for an announcement nobody made).
        Synchronization: the flag allreduce, which every rank of the set submitted with the
        step's first bucket. Its own error is logged, not raised: the step's is the one."""
        handle, self.handle = self.handle, None
        if handle is None:
            return
        try:
            ops.synchronize(handle)
        except Exception as exc:  # noqa: BLE001 - the step's failure is the one raised
            logger.debug("join flags of a failed step: %s", exc)

    def announce(self, code: str, *args) -> None:
        """On the ranks still training, while some rank is joined: tell the joined ranks the
        step's next action. Synchronization: a broadcast over the set."""
        if self.joined and not self.serving:
            self._exchange((code, args))

    def _exchange(self, message):
        assert self.current is not None  # some rank joined in a round collected before
        leader = next(r for r, f in zip(self.ranks, self.current) if not f)
        return functions.broadcast_object(
            message, root_rank=leader, name=self.tag + "next", process_set=self.process_set
        )

    def receive(self):
        """On a joined rank: the next action the training ranks announce (code, args)."""
        return self._exchange(None)


class _Server:
    """What join() runs on a rank holding a ShardedOptimizer (see the module doc)."""

    def __init__(self, opt):
        self.opt = opt
        self.process_set = opt.process_set  # where its JOIN carries `prefixes`
        self.prefixes = (opt.join_rounds.tag,) + SHARED

    def serve(self) -> None:
        """Run rounds until one in which every rank of the set has joined. Synchronization:
        each round's ops with the ranks still training, then with every rank of the set."""
        opt, rounds = self.opt, self.opt.join_rounds
        if opt.in_flight():
            # Its gradients are already out with the others' (as DistributedOptimizer's would
            # be): finish that step as a training rank.
            opt.step()
        rounds.serving = True
        try:
            while True:
                opt.zero_grad()
                opt.synchronize()  # zeros for every bucket, flag 1
                if all(rounds.current):
                    return
                self._mirror(opt, rounds)
        finally:
            rounds.serving, rounds.joined = False, ()

    @staticmethod
    def _mirror(opt, rounds) -> None:
        while True:
            code, args = rounds.receive()
            if code == "clip":
                opt.clip_grad_norm_(*args)
            elif code == "unscale":
                scaler.unscale_joined(opt, *args)
            elif code == "step":
                for group, options in zip(opt.param_groups, args[0]):
                    group.update(options)
                opt.step()
                return
            elif code == "skip":
                return
            else:
                raise MpidpError(
                    f"join(): ShardedOptimizer announced {code!r}, which this "
                    f"rank does not know (different mpidp versions?)"
                )


class _Registry:
    """The runtime's join_hook: which ShardedOptimizer join() serves on this rank."""

    def __init__(self):
        self.latest = None  # a weak reference to the optimizer created or stepped last
        # Held weakly: an optimizer the script has dropped is gone (its hooks hold it weakly,
        # pass_guard.weak), and serving it would wait for peers that left it behind.
        self.alive: "weakref.WeakSet" = weakref.WeakSet()

    def __call__(self):
        """The server join() runs on this rank, or None; MpidpError if there are several
        ShardedOptimizers to serve (join() can follow one optimizer's steps)."""
        alive = [o for o in self.alive if o.is_sharded]
        if len(alive) > 1:
            raise MpidpError(
                f"join(): {len(alive)} ShardedOptimizers are alive on rank {world.rank()}, and "
                f"join() can keep stepping the shards of one only: the training ranks would "
                f"wait in the others' steps. Use join() with a single ShardedOptimizer (drop "
                f"the others first, or give every rank the same number of batches and skip "
                f"join()), or use DistributedOptimizer for the other models"
            )
        opt = self.latest() if self.latest is not None else None
        return _Server(opt) if opt is not None and opt.is_sharded else None


def _registry() -> _Registry:
    state = world.state()
    if state.join_hook is None:
        state.join_hook = _Registry()
    return state.join_hook
