"""barrier() and join(): the ops that take no tensor and hold ranks until all have called them."""

from .ops import blocking, first_result, new_entry, set_blocking, submit, synchronize
from .process_sets import member_of
from .engine.messages import JOIN_NAME, OpType, Request


def barrier(process_set=None) -> None:
    """Block until every rank (of the set) has called barrier(). Synchronization: those ranks."""
    target = member_of(process_set, "barrier")
    req = Request(target[1].auto_name(), int(OpType.BARRIER), cacheable=False)
    with blocking():
        synchronize(submit(target, [new_entry(req, None, None)], first_result))


def join(device: int = -1) -> int:
    """Declare that this rank has no more data; until every rank has joined, its allreduces
    contribute zeros to the others'. Blocks until all ranks joined; returns the last to join.
    Meanwhile a ShardedOptimizer's shard on this rank keeps being stepped (sharded_join.py).
    Synchronization: every rank (and, while serving, the optimizer's steps on the others)."""
    target = member_of(None, "join")
    state = target[0]
    server = state.join_hook() if state.join_hook is not None else None
    req = Request(JOIN_NAME, int(OpType.JOIN), cacheable=False, serial=state.unnamed_count(),
                  serves=server.prefixes if server is not None else ())
    before = set_blocking(server is None)  # a server's ops need the engine awake meanwhile
    try:
        handle = submit(target, [new_entry(req, None, None)], first_result)
        if server is not None:
            server.serve()
        last, serial = synchronize(handle)
    finally:
        set_blocking(before)
    # Ranks that kept going numbered unnamed ops (barriers, allreduces) the joined ranks did not;
    # all continue from the highest count so later unnamed ops match again.
    state.resume_names(serial)
    return last
