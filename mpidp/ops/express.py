"""The express lane: a blocking allreduce of a named tensor, on the caller's thread in one cycle."""

import torch

from ..engine.messages import OpType
from ..engine.tensor_queue import Entry
from ..runtime import world
from ..runtime.process_sets import member_of
from .op_args import check_reduction, check_tensor, request, resolve_op

# Validated requests by call signature, one table per init(); cleared when it grows past this
# (names made per step, such as f"loss.{step}", would otherwise grow it without end).
_MEMO_MAX = 4096
_memo: dict = {}
_memo_state = None


def _prepared(tensor, name, op, pre, post, process_set, inplace, key):
    """(engine, request, cache key, lane plan) for this call, validated as the general path
    validates; None where that path must run (it raises what is wrong)."""
    try:
        reduce_op = resolve_op(None, op, f"allreduce {name!r}")
        _, member = member_of(process_set, "allreduce")
        t = check_tensor(tensor, f"allreduce {name!r}", inplace)
        check_reduction(t, reduce_op, pre, post, f"allreduce {name!r}")
    except (TypeError, ValueError):
        return None
    req = request(name, True, OpType.ALLREDUCE, t, reduce_op, pre, post)
    if len(_memo) >= _MEMO_MAX:
        _memo.clear()
    engine = member.engine
    hit = _memo[key] = (engine, req, req.cache_key(), engine.lane(req, t))
    return hit


def allreduce(tensor, name: str, op, pre: float, post: float, process_set, inplace: bool):
    """The result of mpidp.allreduce (or allreduce_ when `inplace`) of `tensor` under `name`,
    or None when the general path must run it: first use of the signature, engine busy
    (another thread's ops, a backward pass), a name or tensor the general path refuses. `op`
    as the caller gave it (None: Average). The lane's latency is its Python calls: this is
    the whole route of a repeated call, kept short on purpose.
    Synchronization: the band and the allreduce with every rank of the process set.
    """
    global _memo_state
    if (
        not isinstance(tensor, torch.Tensor)
        or tensor.layout is not torch.strided
        or not tensor.is_contiguous()
    ):
        return None
    ps = None
    if process_set is not None:
        ps = getattr(process_set, "process_set_id", process_set)
        if ps is None:  # not registered: the general path says so
            return None
    state = world.current()
    if state is None or state.forked:  # the general path says what is wrong
        return None
    if state is not _memo_state:
        _memo.clear()
        _memo_state = state
    key = (name, op, pre, post, ps, inplace, tensor.dtype, tensor.shape, tensor.device)
    try:
        prepared = _memo.get(key)
    except TypeError:  # an unhashable op or factor: the general path says what is wrong
        return None
    if prepared is None:
        prepared = _prepared(tensor, name, op, pre, post, process_set, inplace, key)
        if prepared is None:
            return None
    engine, req, cache_key, plan = prepared
    src = tensor.detach() if tensor.requires_grad else tensor
    out = src if inplace else torch.empty_like(src)
    entry = Entry(req, [src], [out], cache_key=cache_key)
    if not engine.express(entry, plan):
        return None
    entry.wait()
    return tensor if inplace else out
