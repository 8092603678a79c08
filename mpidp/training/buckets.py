"""DistributedOptimizer's parameters: their names, and the buckets their gradients go in."""

import gc
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import config as mpidp_config
from .. import ops
from ..runtime import world

# Live optimizers -> (process set id, the names their gradients are reduced under).
_claimed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def named(optimizer, named_parameters) -> Dict[torch.nn.Parameter, str]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        # Horovod's scheme: positions in the optimizer's groups, identical on every rank.
        return {
            p: f"allreduce.noname.{i}.{j}"
            for i, group in enumerate(optimizer.param_groups)
            for j, p in enumerate(group["params"])
        }
    named = list(named_parameters)
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(
            f"DistributedOptimizer: named_parameters has duplicate names {dups}; "
            f"names must be unique (pass model.named_parameters())"
        )
    by_param = {p: n for n, p in named}
    missing = [i for i, p in enumerate(params) if p not in by_param]
    if missing:
        raise ValueError(
            f"DistributedOptimizer: named_parameters does not cover every parameter "
            f"of the optimizer ({len(missing)} of {len(params)} have no name); pass "
            f"the named_parameters of the whole model the optimizer was built on"
        )
    return {p: by_param[p] for p in params}


def claim(
    owner, set_id: int, names: Dict[torch.nn.Parameter, str]
) -> Dict[torch.nn.Parameter, str]:
    """`names` for `owner`'s gradients, or, when another live optimizer on the same process set
    uses one of them, all prefixed `opt{k}.`: two optimizers' buckets may be in flight at once
    (one backward for both, as in a GAN), and names must differ among ops in flight. Horovod's
    automatic names, or two models both with a `0.weight`, collide so. Every member of the set
    wraps its optimizers in the same order, so the prefixes agree. Liveness must agree too: an
    optimizer dropped in a reference cycle lives until the cycle collector runs, at a moment of
    its own on each rank, so a collision is confirmed after collecting (this only costs when an
    optimizer with the same names is still around)."""
    taken = _taken(set_id)
    if taken.intersection(names.values()):
        gc.collect()
        taken = _taken(set_id)
    out, k = names, 0
    while taken.intersection(out.values()):
        k += 1
        out = {p: f"opt{k}.{n}" for p, n in names.items()}
    _claimed[owner] = (set_id, set(out.values()))
    return out


def release(owner) -> None:
    """`owner`'s names are free again (it is laid out anew)."""
    _claimed.pop(owner, None)


def _taken(set_id: int) -> set:
    """Every name a live optimizer on process set `set_id` reduces under."""
    taken = set()
    for other_set, other in list(_claimed.values()):
        if other_set == set_id:
            taken.update(other)
    return taken


class Bucket:
    """Parameters whose gradients are reduced as one op, the same on every rank."""

    __slots__ = (
        "name",
        "params",
        "ready",
        "handle",
        "wires",
        "ctxs",
        "request",
        "cache_key",
        "dtype",
        "wire",
        "shapes",
        "dense",
        "sparse",
        "submitted",
    )

    def __init__(self, name: str, params: List[torch.nn.Parameter]):
        self.name = name
        self.params = params
        self.ready = 0  # parameters whose gradient is ready this step
        self.handle: Optional[int] = None  # the dense op while in flight
        self.submitted = False  # this step's gradients were handed to the engine
        self.dense: List[torch.nn.Parameter] = []  # submitted as the bucket op (wires, ctxs)
        self.sparse: List[tuple] = []  # (parameter, handle): sparse gradients, one op each
        self.wires: Sequence = ()  # the dense gradients as submitted, and their contexts
        self.ctxs: Sequence = ()
        # Kept from the first submission, reused while the gradients still fit them.
        self.request = self.cache_key = self.dtype = self.wire = None
        self.shapes: Optional[list] = None

    def clear(self) -> None:
        """Nothing of this step left: no gradient ready, none submitted (the kept request
        stays)."""
        self.handle, self.ready, self.wires, self.ctxs = None, 0, (), ()
        self.submitted, self.dense, self.sparse = False, [], []

    def start(self, wires, op, pre: float, post: float, process_set, keep: bool, wire=None) -> None:
        """Hand the dense gradients `wires` to the engine as one op (`handle`), travelling as
        `wire` (a dtype the data path casts them to, ops.cast_allreduce_async_) if given. The
        first time it goes through the checked path, and with `keep` its request is kept and
        reused while the gradients still fit it (a parameter resized in place, as pruning does,
        needs a new one); a bucket of several dtypes always goes the checked way."""
        req = self.request
        if (
            keep
            and req is not None
            and self.wire is wire
            and all(
                w.dtype is self.dtype and w.shape == shape for w, shape in zip(wires, self.shapes)
            )
        ):
            self.handle = ops.bucket_allreduce_async_(req, wires, process_set, self.cache_key)
            return
        kw = dict(name=self.name, op=op, prescale_factor=pre, postscale_factor=post)
        if wire is not None:
            self.handle = ops.cast_allreduce_async_(wires, wire, process_set=process_set, **kw)
        else:
            self.handle = ops.grouped_allreduce_async_(wires, process_set=process_set, **kw)
        members = world.state().handles.members(self.handle)
        if keep and len(members) == 1:
            self.request, self.cache_key = members[0].request, members[0].cache_key
            self.dtype, self.shapes = wires[0].dtype, [w.shape for w in wires]
            self.wire = wire


def bucket_caps(config, link_slow: bool) -> Tuple[int, int]:
    """(bucket_bytes, last_bucket_bytes) for make_buckets: the knobs as set, else the finer
    config.SLOW_LINK_* caps where the ranks found the link between hosts slow (there the
    network waits for each bucket: ResNet-18's fp16 step at 1 Gbit/s 0.82-0.95 of the 25 MiB
    layout's; at 10 Gbit/s the finer one took 1.04-1.14x)."""
    cap, last = config.bucket_bytes, config.last_bucket_bytes
    if link_slow and "bucket_bytes" not in config.explicit:
        cap = mpidp_config.SLOW_LINK_BUCKET_BYTES
    if link_slow and "last_bucket_bytes" not in config.explicit:
        last = mpidp_config.SLOW_LINK_LAST_BUCKET_BYTES
    return cap, last


def make_buckets(
    trained, names, groups, cap: int, apart=None, first_cap: int = 0, last_cap: int = 0
) -> List["Bucket"]:
    """Buckets of `trained` parameters: the user's groups as they are; the rest in reverse
    order (gradients become ready roughly from the last layer back, as in DDP), one bucket per
    dtype and device (and value of `apart`, a parameter -> key map, if given) filled up to
    `cap` bytes (0: one parameter per bucket). With `first_cap`, the first bucket of each
    kind closes as soon as it holds `first_cap` bytes (the parameter that reached the mark
    stays in it). With `last_cap`, each kind's first parameters, up to the one that reaches
    `last_cap` bytes, make its last bucket of their own: the gradients the backward pass
    produces last, whose reduction is all that is left to wait for once it ends."""
    out, loose = [], []
    by_group: Dict[int, List[torch.nn.Parameter]] = {}
    for p in trained:
        gid = groups.get(p)
        if gid is None:
            loose.append(p)
        else:
            by_group.setdefault(gid, []).append(p)
    for grouped in by_group.values():
        out.append(grouped)

    def kind(p) -> tuple:
        return (p.dtype, p.device, None if apart is None else apart[p])

    tails: Dict[tuple, List] = {}  # each kind's last bucket, with last_cap
    if cap and last_cap:
        held: Dict[tuple, int] = {}
        count: Dict[tuple, int] = {}
        for p in loose:
            key = kind(p)
            count[key] = count.get(key, 0) + 1
            if held.get(key, 0) < last_cap:
                tails.setdefault(key, []).append(p)
                held[key] = held.get(key, 0) + p.numel() * p.element_size()
        # A kind whose tail would hold all of it keeps its usual buckets.
        tails = {k: v for k, v in tails.items() if len(v) < count[k]}
    in_tail = {id(p) for members in tails.values() for p in members}
    open_: Dict[tuple, List] = {}
    firsts: Dict[tuple, List] = {}  # each kind's first bucket
    size: Dict[tuple, int] = {}
    for p in reversed(loose):
        if id(p) in in_tail:
            continue
        key = kind(p)
        nbytes = p.numel() * p.element_size()
        members = open_.get(key)
        if (
            members is None
            or not cap
            or size[key] + nbytes > cap
            or (first_cap and members is firsts[key] and size[key] >= first_cap)
        ):
            members = open_[key] = []
            firsts.setdefault(key, members)
            size[key] = 0
            out.append(members)
        members.append(p)
        size[key] += nbytes
    for key, members in tails.items():
        tail = list(reversed(members))
        left = open_.get(key)
        if left is not None and left is not firsts[key] and size[key] < last_cap:
            # A scrap between the buckets before it and it (a bias): joins it.
            left.extend(tail)
        else:
            out.append(tail)
    buckets = []
    for members in out:
        first = names[members[0]]
        name = first if len(members) == 1 else f"{first}+{len(members) - 1}"
        buckets.append(Bucket(name, members))
    return buckets


def group_ids(names, num_groups, groups) -> Dict[torch.nn.Parameter, int]:
    """Parameter -> the group its gradients must share a bucket with, as `groups` (lists of
    parameters) or `num_groups` (that many runs of consecutive parameters) ask; {} for none."""
    params = list(names)
    if groups is not None and num_groups:
        raise ValueError("DistributedOptimizer: give num_groups or groups, not both")
    if groups is not None:
        mapping = {}
        for gid, group in enumerate(groups):
            for p in group:
                if p not in names:
                    raise ValueError(
                        "DistributedOptimizer: groups holds a parameter the optimizer does not have"
                    )
                mapping[p] = gid
        return mapping
    if num_groups and num_groups > 0:
        per = -(-len(params) // num_groups)
        return {p: i // per for i, p in enumerate(params)}
    return {}
