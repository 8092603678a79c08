"""Training helpers: broadcast parameters, optimizer state, objects; gather objects; replicas."""

import pickle
import zlib
from typing import Any, List, Optional

import numpy as np
import torch

try:
    import cloudpickle
except ImportError:  # optional: plain pickle then (no lambdas or local classes)
    cloudpickle = None

from ..errors import MpidpError
from ..runtime import world
from ..runtime.process_sets import member_of
from . import gather_ops
from .eager import eager
from .waits import synchronize


@eager
def broadcast_parameters(params, root_rank: int = 0, process_set=None) -> None:
    """Overwrite parameters on every rank with global rank `root_rank`'s, in place.

    `params`: a state_dict (processed in sorted key order), a list of parameters, or a list of
    (name, tensor) pairs. Synchronization: blocks until every rank has submitted every tensor.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = list(params)
        if items and not isinstance(items[0], tuple):
            items = [(f"param.{i}", p) for i, p in enumerate(items)]
    handles = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"broadcast_parameters: {name!r} is a {type(tensor).__name__}, not a tensor"
            )
        # channels_last or transposed tensors go through a packed copy (written back below).
        data = tensor.data
        packed = data if data.is_contiguous() else data.contiguous()
        handles.append(
            (
                gather_ops.broadcast_async_(
                    _real(packed),
                    root_rank,
                    name=f"broadcast_parameters.{name}",
                    process_set=process_set,
                ),
                data,
                packed,
            )
        )
    for handle, data, packed in handles:
        synchronize(handle)
        if packed is not data:
            data.copy_(packed)


def _real(tensor: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real and imaginary parts (a view, as DDP does); others as is."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def _dumps(obj: Any) -> tuple:
    """(bytes, failed): `obj` pickled with cloudpickle, as Horovod does (lambdas and local
    classes too), or with pickle where it is missing; if that fails, the reason as bytes."""
    try:
        return (cloudpickle or pickle).dumps(obj), 0
    except Exception as exc:  # noqa: BLE001 - every rank raises it below
        return f"{type(exc).__name__}: {exc}".encode(), 1


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(bytearray(data), dtype=np.uint8))


@eager
def broadcast_object(
    obj: Any, root_rank: int = 0, name: Optional[str] = None, process_set=None
) -> Any:
    """Return global rank `root_rank`'s `obj` (pickled) on every rank (of the set); if the root
    cannot pickle it, every rank raises MpidpError with the reason. Synchronization: blocks
    until every rank of the set has called it."""
    name = name or "broadcast_object"
    rank = world.rank()
    data, failed = _dumps(obj) if rank == root_rank else (b"", 0)
    payload = _bytes_tensor(data)
    header = synchronize(
        gather_ops.broadcast_async(
            torch.tensor([payload.numel(), failed]),
            root_rank,
            name=f"{name}.length",
            process_set=process_set,
        )
    )
    if rank != root_rank:
        payload = torch.empty(int(header[0]), dtype=torch.uint8)
    synchronize(
        gather_ops.broadcast_async_(
            payload, root_rank, name=f"{name}.bytes", process_set=process_set
        )
    )
    if int(header[1]):
        raise MpidpError(
            f"{name}: rank {root_rank} could not pickle the object: "
            f"{payload.numpy().tobytes().decode(errors='replace')}"
        )
    return obj if rank == root_rank else pickle.loads(payload.numpy().tobytes())


@eager
def allgather_object(obj: Any, name: Optional[str] = None, process_set=None) -> List[Any]:
    """Every rank's `obj` (of the set), in rank order, on every rank of the set; if a rank
    cannot pickle its object, every rank raises MpidpError naming it and the reason.
    Synchronization: blocks until every rank of the set has called it."""
    name = name or "allgather_object"
    raw, failed = _dumps(obj)
    data = _bytes_tensor(raw)
    heads = synchronize(
        gather_ops.allgather_async(
            torch.tensor([[data.numel(), failed]]), name=f"{name}.length", process_set=process_set
        )
    )
    gathered = synchronize(
        gather_ops.allgather_async(data, name=f"{name}.bytes", process_set=process_set)
    ).numpy()
    offsets = np.concatenate(([0], np.cumsum(heads[:, 0].numpy())))
    parts = [gathered[offsets[i] : offsets[i + 1]].tobytes() for i in range(len(heads))]
    bad = [i for i in range(len(heads)) if int(heads[i, 1])]
    if bad:
        ranks = [member_of(process_set, name)[1].ranks[i] for i in bad]
        raise MpidpError(
            f"{name}: rank(s) {ranks} could not pickle their object: "
            + "; ".join(parts[i].decode(errors="replace") for i in bad)
        )
    return [pickle.loads(part) for part in parts]


def _param_names(optimizer, model) -> List[str]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if model is None:
        return [f"param.{i}" for i in range(len(params))]
    by_param = {p: n for n, p in model.named_parameters()}
    return [by_param.get(p, f"param.{i}") for i, p in enumerate(params)]


@eager
def broadcast_optimizer_state(optimizer, root_rank: int = 0, model=None, process_set=None) -> None:
    """Make every rank's optimizer state equal to global rank `root_rank`'s.

    Broadcasts the state itself, never a dummy step (which would move weights under weight
    decay and advance Adam's step count): tensor state travels as tensors, scalar state and
    every param-group option keep their Python types. `model`, if given, names the tensors
    after its parameters (clearer errors). On a fresh optimizer (no state yet on this rank) the
    parameters that require a gradient and have none get zeros, as Horovod's step leaves them.
    For a ShardedOptimizer, whose state is each rank's own shard, only the param groups'
    options are copied. `process_set` (default: global) holds the ranks that take part;
    `root_rank` is a global rank. Synchronization: blocks on every rank of that set.
    """
    if getattr(optimizer, "is_sharded", False):
        # A ShardedOptimizer's state is each rank's own part: only the options are copied.
        groups = broadcast_object(
            [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            root_rank,
            name="broadcast_optimizer_state.options",
            process_set=process_set,
        )
        for group, options in zip(optimizer.param_groups, groups):
            group.update(options)
        return
    names = _param_names(optimizer, model)
    state = optimizer.state_dict()
    fresh = not state["state"]
    rank = world.rank()
    layout = None
    if rank == root_rank:
        # Everything but tensor contents: shapes and dtypes, scalars, group options.
        layout = {
            "param_groups": state["param_groups"],
            "state": {
                idx: {
                    k: (
                        ("tensor", tuple(v.shape), str(v.dtype).split(".")[1])
                        if isinstance(v, torch.Tensor)
                        else ("value", v)
                    )
                    for k, v in entry.items()
                }
                for idx, entry in state["state"].items()
            },
        }
    layout = broadcast_object(
        layout, root_rank, name="broadcast_optimizer_state.layout", process_set=process_set
    )
    new_state = {}
    handles = []
    for idx in sorted(layout["state"]):
        entry = {}
        for key in sorted(layout["state"][idx]):
            kind, *rest = layout["state"][idx][key]
            if kind == "value":
                entry[key] = rest[0]
                continue
            shape, dtype = rest
            if rank == root_rank:
                tensor = (
                    state["state"][idx][key]
                    .detach()
                    .cpu()
                    .clone(memory_format=torch.contiguous_format)
                )  # channels_last state too
            else:
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            label = names[idx] if idx < len(names) else f"param.{idx}"
            handles.append(
                gather_ops.broadcast_async_(
                    _real(tensor),
                    root_rank,
                    name=f"broadcast_optimizer_state.{label}.{key}",
                    process_set=process_set,
                )
            )
            entry[key] = tensor
        new_state[idx] = entry
    for handle in handles:
        synchronize(handle)
    optimizer.load_state_dict({"state": new_state, "param_groups": layout["param_groups"]})
    if fresh:
        _zero_missing_grads(optimizer)


def _zero_missing_grads(opt) -> None:
    """Give a zero gradient to each parameter of `opt` that requires one and has none: Horovod
    initialises a fresh optimizer's state with a step on zero gradients and leaves them, and
    scripts read them before their first backward pass. SparseAdam takes only sparse ones (in
    dim 0, as nn.Embedding makes them, so that a backward pass adds to them)."""
    sparse = isinstance(opt, torch.optim.SparseAdam)
    for group in opt.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                zeros = torch.zeros_like(p)
                p.grad = zeros.to_sparse(1) if sparse else zeros


@eager
def check_replicas(model, name: Optional[str] = None) -> None:
    """Raise MpidpError naming the ranks and parameters that differ from rank 0's, bitwise.

    Cheap: one CRC32 per parameter, one allgather. Synchronization: blocks on every rank.
    """
    items = list(model.named_parameters()) + list(model.named_buffers())
    sums = [
        zlib.crc32(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
        if t.numel()
        else 0
        for _, t in items
    ]
    table = synchronize(
        gather_ops.allgather_async(
            torch.tensor([sums], dtype=torch.int64), name=name or "check_replicas"
        )
    )
    bad = {}
    for r in range(1, table.shape[0]):
        diff = [items[i][0] for i in np.flatnonzero((table[r] != table[0]).numpy())]
        if diff:
            bad[r] = diff
    if bad:
        parts = [
            f"rank {r}: {', '.join(d[:5])}{' ...' if len(d) > 5 else ''}"
            for r, d in sorted(bad.items())
        ]
        raise MpidpError("check_replicas: parameters differ from rank 0's on " + "; ".join(parts))
