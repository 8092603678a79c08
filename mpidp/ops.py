"""Asynchronous collectives on torch tensors: validate, enqueue, return a handle; poll and synchronize."""

import contextlib
import threading
import warnings
from typing import List, Optional

import numpy as np
import torch

from . import runtime
from .process_sets import member_of
from .engine.messages import JOIN_NAME, OpType, ReduceOp, Request
from .engine.tensor_queue import Entry

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM

SUPPORTED_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool)
_DTYPE_NAMES = {d: str(d).replace("torch.", "") for d in SUPPORTED_DTYPES}


def _check_tensor(tensor, what: str, inplace: bool) -> torch.Tensor:
    """The tensor the engine may read (and write, if in place), or a clear TypeError/ValueError."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{what}: sparse tensors are not supported here; call "
                        f"tensor.to_dense() first")
    if tensor.dtype not in _DTYPE_NAMES:
        raise TypeError(f"{what}: dtype {tensor.dtype} is not supported; use one of "
                        f"{', '.join(_DTYPE_NAMES.values())}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what}: tensor is on {tensor.device}, but mpidp moves host memory "
                         f"and CUDA memory only; call .cpu() first")
    if not tensor.is_contiguous():
        if inplace:
            raise ValueError(f"{what}: in-place ops need a contiguous tensor (this one has "
                             f"strides {tensor.stride()}); call .contiguous() and use the result, "
                             f"or use the out-of-place form, which copies")
        tensor = tensor.contiguous()
    return tensor.detach()


def _same_device(tensors: List[torch.Tensor], what: str) -> None:
    """A grouped op runs on one data path: every tensor on the same kind of device (checked
    after each tensor passed _check_tensor, whose message names the tensor)."""
    kinds = [t.device.type for t in tensors]
    if len(set(kinds)) > 1:
        odd = next(i for i, k in enumerate(kinds) if k != kinds[0])
        raise ValueError(f"{what}: tensor {odd} is on {tensors[odd].device} but tensor 0 is on "
                         f"{tensors[0].device}; a grouped op needs all its tensors on one kind of "
                         f"device (move them with .cpu() or .cuda() first)")


def _resolve_op(average, op, what: str) -> ReduceOp:
    if average is not None and op is not None:
        raise ValueError(f"{what}: give either op= or the deprecated average=, not both")
    if average is not None:
        warnings.warn("average= is deprecated; use op=mpidp.Average or op=mpidp.Sum",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    if op is None:
        return Average
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"{what}: unknown reduce op {op!r}; use mpidp.Average, Sum, Min, Max "
                         f"or Product") from None
    if op == Adasum:
        raise ValueError(f"{what}: Adasum is not supported by mpidp; use mpidp.Average")
    return op


def _check_reduction(tensor: torch.Tensor, op: ReduceOp, pre: float, post: float, what: str):
    if tensor.dtype == torch.bool and op == Average:
        raise TypeError(f"{what}: Average is not defined for bool tensors; use Sum (logical or) "
                        f"or Min (logical and)")
    if (pre != 1.0 or post != 1.0) and tensor.dtype == torch.bool:
        raise TypeError(f"{what}: prescale/postscale factors are not defined for bool tensors")


_UNNAMED = "<unnamed>"  # stands in for the number an unnamed op draws once it is accepted


def _name(name: Optional[str], what: str):
    if name is None:
        return _UNNAMED, False
    if not isinstance(name, str) or not name:
        raise TypeError(f"{what}: name must be a non-empty string, got {name!r}")
    return name, True


def _request(name, cacheable, op, tensor, reduce_op=ReduceOp.SUM, pre=1.0, post=1.0, root=-1):
    return Request(name, int(op), _DTYPE_NAMES[tensor.dtype], tuple(tensor.shape),
                   str(tensor.device), int(reduce_op), float(pre), float(post), int(root),
                   cacheable)


_local = threading.local()


@contextlib.contextmanager
def blocking():
    """Inside, submissions do not wake the engine thread: the caller is about to synchronize()
    and will run the engine's cycles itself if it is idle (Engine.drive)."""
    before = getattr(_local, "blocking", False)
    _local.blocking = True
    try:
        yield
    finally:
        _local.blocking = before


def _submit(target, entries: List[Entry], finish) -> int:
    state, member = target
    first = entries[0].request if entries else None
    if first is not None and not first.cacheable and first.name.startswith(_UNNAMED):
        # Numbered only now, after validation: an op refused on one rank must not shift the
        # numbering that matches unnamed ops across ranks.
        number = member.auto_name()
        for entry in entries:
            entry.rename(entry.request.name.replace(_UNNAMED, number, 1))
    member.engine.submit(entries, notify=not getattr(_local, "blocking", False))
    return state.handles.register(entries, finish, member.engine)


def _entry(request, tensor, output, extra=None) -> Entry:
    return Entry(request, tensor, output, extra)


def _first(results):
    return results[0]


def _only(results):
    return results[0][0]


# ---- allreduce ----

def _grouped_allreduce(tensors, average, name, op, prescale_factor, postscale_factor, inplace,
                       process_set, what="allreduce"):
    """One op for the whole list when its tensors share dtype and device (the data path packs
    the small ones and reduces large ones in place), else one op per tensor."""
    target = member_of(process_set, what)
    reduce_op = _resolve_op(average, op, what)
    base, cacheable = _name(name, what)
    checked, outs = [], []
    for i, tensor in enumerate(tensors):
        label = base if len(tensors) == 1 and what == "allreduce" else f"{base}.{i}"
        t = _check_tensor(tensor, f"{what} {label!r}", inplace)
        _check_reduction(t, reduce_op, prescale_factor, postscale_factor, f"{what} {label!r}")
        checked.append(t)
        outs.append(t if inplace else torch.empty_like(t))
    _same_device(checked, what)
    if not checked:
        return target, []
    if what == "allreduce" or len({t.dtype for t in checked}) > 1:
        entries = []
        for i, (t, out) in enumerate(zip(checked, outs)):
            label = base if what == "allreduce" else f"{base}.{i}"
            req = _request(label, cacheable, OpType.ALLREDUCE, t, reduce_op, prescale_factor,
                           postscale_factor)
            entries.append(_entry(req, [t], [out]))
        return target, entries
    req = _parts_request(base, cacheable, checked, reduce_op, prescale_factor, postscale_factor)
    return target, [_entry(req, checked, outs)]


def _parts_request(name, cacheable, tensors, reduce_op, pre, post) -> Request:
    """The request of one allreduce op over several tensors of one dtype and device (a plain
    single-tensor request for one, which may then be fused with other small ops)."""
    first = tensors[0]
    if len(tensors) == 1:
        return _request(name, cacheable, OpType.ALLREDUCE, first, reduce_op, pre, post)
    return Request(name, int(OpType.ALLREDUCE), _DTYPE_NAMES[first.dtype],
                   (sum(t.numel() for t in tensors),), str(first.device), int(reduce_op),
                   float(pre), float(post), -1, cacheable,
                   parts=tuple(tuple(t.shape) for t in tensors))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None) -> int:
    """Start an allreduce into a new tensor; returns a handle. No synchronization until
    synchronize(handle), which blocks until every rank has submitted the same name."""
    target, entries = _grouped_allreduce([tensor], average, name, op, prescale_factor,
                                        postscale_factor, False, process_set)
    return _submit(target, entries, _only)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None) -> int:
    """Start an in-place allreduce of `tensor`; returns a handle (see allreduce_async)."""
    target, entries = _grouped_allreduce([tensor], average, name, op, prescale_factor,
                                        postscale_factor, True, process_set)
    return _submit(target, entries, lambda results: tensor)


def _flatten(results):
    return [t for outs in results for t in outs]


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=None) -> int:
    """Start allreduces of a list, submitted atomically; synchronize() returns a list."""
    target, entries = _grouped_allreduce(list(tensors), average, name, op, prescale_factor,
                                        postscale_factor, False, process_set,
                                        "grouped_allreduce")
    return _submit(target, entries, _flatten)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=None) -> int:
    """In-place form of grouped_allreduce_async."""
    tensors = list(tensors)
    target, entries = _grouped_allreduce(tensors, average, name, op, prescale_factor,
                                        postscale_factor, True, process_set,
                                        "grouped_allreduce")
    return _submit(target, entries, lambda results: tensors)


def bucket_allreduce_async_(request: Request, tensors: List[torch.Tensor], process_set=None,
                            cache_key=None) -> int:
    """Start an in-place allreduce of `tensors` under a request built earlier (by
    _parts_request, from tensors of these shapes and dtype): the training layer's path for a
    gradient bucket, which skips the per-tensor checks its first submission made."""
    target = member_of(process_set, "DistributedOptimizer")
    return _submit(target, [Entry(request, tensors, tensors, None, cache_key)], _first)


# ---- allgather ----

def _allgather_entries(tensors, name, what, process_set):
    target = member_of(process_set, what)
    base, cacheable = _name(name, what)
    entries = []
    for i, tensor in enumerate(tensors):
        label = base if what == "allgather" else f"{base}.{i}"
        t = _check_tensor(tensor, f"{what} {label!r}", False)
        if t.dim() == 0:
            t = t.reshape(1)
        entries.append(_entry(_request(label, cacheable, OpType.ALLGATHER, t), t, None))
    _same_device([e.tensor for e in entries], what)
    return target, entries


def allgather_async(tensor, name=None, process_set=None) -> int:
    """Start gathering every rank's tensor along dim 0 (dim 0 may differ); returns a handle."""
    target, entries = _allgather_entries([tensor], name, "allgather", process_set)
    return _submit(target, entries, _first)


def grouped_allgather_async(tensors, name=None, process_set=None) -> int:
    """Start allgathers of a list, submitted atomically; synchronize() returns a list."""
    target, entries = _allgather_entries(list(tensors), name, "grouped_allgather", process_set)
    return _submit(target, entries, list)


# ---- broadcast ----

def _broadcast(tensor, root_rank, name, inplace, process_set) -> int:
    what = "broadcast"
    target = member_of(process_set, what)
    member = target[1]
    base, cacheable = _name(name, what)
    t = _check_tensor(tensor, f"{what} {base!r}", inplace)
    size = target[0].comms.size
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise TypeError(f"{what} {base!r}: root_rank must be an int, got {root_rank!r}")
    if not 0 <= root_rank < size:
        raise ValueError(f"{what} {base!r}: root_rank {root_rank} is out of range; the world "
                         f"has ranks 0..{size - 1}")
    if root_rank not in member.ranks:
        raise ValueError(f"{what} {base!r}: root_rank {root_rank} is not in process set "
                         f"{member.set_id} (ranks {list(member.ranks)}); root_rank is a global "
                         f"rank and must be a member")
    out = t if inplace else torch.empty_like(t)
    req = _request(base, cacheable, OpType.BROADCAST, t, root=member.ranks.index(root_rank))
    return _submit(target, [_entry(req, t, out)], (lambda results: tensor) if inplace else _first)


def broadcast_async(tensor, root_rank, name=None, process_set=None) -> int:
    """Start a broadcast from global rank `root_rank` into a new tensor (input untouched)."""
    return _broadcast(tensor, root_rank, name, False, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=None) -> int:
    """Start an in-place broadcast from global rank `root_rank`."""
    return _broadcast(tensor, root_rank, name, True, process_set)


# ---- alltoall ----

def _check_splits(splits, t: torch.Tensor, size: int, what: str) -> np.ndarray:
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype == torch.bool:
            # ValueError, as Horovod raises for non-integer splits (scripts catch that one).
            raise ValueError(f"{what}: splits must hold integers, not {splits.dtype}")
        arr = splits.detach().cpu().numpy().reshape(-1)
    elif isinstance(splits, (list, tuple, np.ndarray)):
        arr = np.asarray(splits)
        if arr.size == 0:
            arr = arr.astype(np.int64)  # numpy makes [] float; the count check below says more
        if arr.dtype.kind == "f":
            raise ValueError(f"{what}: splits must be integers, got {list(splits)!r}")
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{what}: splits must be integers, got {list(splits)!r}")
        arr = arr.reshape(-1)
    else:
        raise TypeError(f"{what}: splits must be a list or an integer tensor with one entry "
                        f"per rank, not {type(splits).__name__}")
    if arr.size != size:
        raise ValueError(f"{what}: splits has {arr.size} entries but there are {size} ranks; "
                         f"give one count per rank")
    if (arr < 0).any():
        raise ValueError(f"{what}: splits must be >= 0, got {arr.tolist()}")
    dim0 = t.shape[0] if t.dim() else 1
    if int(arr.sum()) > dim0:
        raise ValueError(f"{what}: splits sum to {int(arr.sum())} but the tensor has only "
                         f"{dim0} rows along dim 0")
    return arr.astype(np.int32)


def alltoall_async(tensor, splits=None, name=None, process_set=None) -> int:
    """Start an alltoall: rows splits[i] go to rank i (of the set). synchronize() returns the
    output, or (output, received_splits) when `splits` was given."""
    what = "alltoall"
    target = member_of(process_set, what)
    base, cacheable = _name(name, what)
    t = _check_tensor(tensor, f"{what} {base!r}", False)
    if t.dim() == 0:
        raise ValueError(f"{what} {base!r}: needs at least one dimension to split")
    size = target[1].size
    arr = None
    if splits is not None:
        arr = _check_splits(splits, t, size, f"{what} {base!r}")
    elif t.shape[0] % size:
        raise ValueError(f"{what} {base!r}: dim 0 ({t.shape[0]}) does not divide evenly among "
                         f"{size} ranks; pass splits=")
    req = _request(base, cacheable, OpType.ALLTOALL, t)
    finish = _first if splits is not None else (lambda results: results[0][0])
    return _submit(target, [_entry(req, t, None, arr)], finish)


# ---- reducescatter ----

def _reducescatter_entries(tensors, name, op, prescale_factor, postscale_factor, what,
                           process_set):
    target = member_of(process_set, what)
    reduce_op = _resolve_op(None, op, what)
    if reduce_op not in (Average, Sum):
        raise ValueError(f"{what}: reduce op {reduce_op.name.capitalize()} is not supported; "
                         f"use mpidp.Average or mpidp.Sum")
    base, cacheable = _name(name, what)
    entries = []
    for i, tensor in enumerate(tensors):
        label = base if what == "reducescatter" else f"{base}.{i}"
        t = _check_tensor(tensor, f"{what} {label!r}", False)
        if t.dim() == 0:
            raise ValueError(f"{what} {label!r}: cannot scatter a scalar; give a tensor with "
                             f"at least one dimension")
        _check_reduction(t, reduce_op, prescale_factor, postscale_factor, f"{what} {label!r}")
        req = _request(label, cacheable, OpType.REDUCESCATTER, t, reduce_op, prescale_factor,
                       postscale_factor)
        entries.append(_entry(req, t, None))
    _same_device([e.tensor for e in entries], what)
    return target, entries


def reducescatter_async(tensor, name=None, op=Average, prescale_factor=1.0,
                        postscale_factor=1.0, process_set=None) -> int:
    """Start a reduce-scatter along dim 0; the first dim0 % size ranks get one extra row."""
    target, entries = _reducescatter_entries([tensor], name, op, prescale_factor,
                                            postscale_factor, "reducescatter", process_set)
    return _submit(target, entries, _first)


def grouped_reducescatter_async(tensors, name=None, op=Average, prescale_factor=1.0,
                                postscale_factor=1.0, process_set=None) -> int:
    """Reduce-scatter a list, submitted atomically; synchronize() returns a list."""
    target, entries = _reducescatter_entries(list(tensors), name, op, prescale_factor,
                                            postscale_factor, "grouped_reducescatter",
                                            process_set)
    return _submit(target, entries, list)


# ---- barrier, join, handles ----

def barrier(process_set=None) -> None:
    """Block until every rank (of the set) has called barrier(). Synchronization: those ranks."""
    target = member_of(process_set, "barrier")
    req = Request(target[1].auto_name(), int(OpType.BARRIER), cacheable=False)
    with blocking():
        synchronize(_submit(target, [_entry(req, None, None)], _first))


def join(device: int = -1) -> int:
    """Declare that this rank has no more data; until every rank has joined, its allreduces
    contribute zeros to the others'. Blocks until all ranks joined; returns the last to join."""
    target = member_of(None, "join")
    state = target[0]
    req = Request(JOIN_NAME, int(OpType.JOIN), cacheable=False, serial=state.unnamed_count())
    with blocking():
        last, serial = synchronize(_submit(target, [_entry(req, None, None)], _first))
    # Ranks that kept going numbered unnamed ops (barriers, allreduces) the joined ranks did not;
    # all continue from the highest count so later unnamed ops match again.
    state.resume_names(serial)
    return last


def poll(handle: int) -> bool:
    """True once the op behind `handle` has completed (synchronize() will not block)."""
    return runtime.state().handles.poll(handle)


def synchronize(handle: int, timeout: Optional[float] = None):
    """Wait for the op behind `handle` and return its output (a tuple for alltoall with splits,
    a list for grouped ops). Raises the op's error, the same one on every rank. With `timeout`
    (seconds), raises OpTimeoutError and keeps the handle valid if the op is still pending."""
    state = runtime.state()
    if state.handles.poll(handle):
        return state.handles.wait(handle)
    engine = state.handles.owner(handle) or state.engine
    with engine.user_waiting():
        if timeout is None:  # a driving thread cannot give up half-way through a cycle
            engine.drive(state.handles.members(handle))
        return state.handles.wait(handle, timeout)


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=None) -> int:
    """Start reducing a sparse COO tensor by gathering every rank's indices and values;
    synchronize() returns the coalesced sparse result (values divided by size for Average)."""
    what = "sparse_allreduce"
    target = member_of(process_set, what)
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError(f"{what}: expected a sparse COO tensor; use allreduce for dense ones")
    reduce_op = _resolve_op(None, op, what)
    if reduce_op not in (Average, Sum):
        raise ValueError(f"{what}: only Average and Sum are supported, not "
                         f"{reduce_op.name.capitalize()}")
    base, cacheable = _name(name, what)
    t = tensor.detach().coalesce()
    indices = t.indices().t().contiguous()   # (nnz, sparse_dims): gathered along dim 0
    values = t.values().contiguous()
    entries = [_entry(_request(f"{base}.indices", cacheable, OpType.ALLGATHER, indices),
                      indices, None),
               _entry(_request(f"{base}.values", cacheable, OpType.ALLGATHER, values),
                      values, None)]
    size, shape = target[1].size, t.shape

    def finish(results):
        idx, vals = results
        if reduce_op == Average:
            vals = vals / size
        return torch.sparse_coo_tensor(idx.t(), vals, shape, check_invariants=True).coalesce()

    return _submit(target, entries, finish)
