"""barrier() and join(): the ops that take no tensor and hold ranks until all have called them."""

from ..engine.messages import JOIN_NAME, OpType, Request
from ..runtime.process_sets import member_of
from .eager import eager
from .submission import blocking, first_result, new_entry, set_blocking, submit
from .waits import synchronize


@eager
def barrier(process_set=None) -> None:
    """Block until every rank (of the set) has called barrier(). Synchronization: those ranks."""
    target = member_of(process_set, "barrier")
    req = Request(target[1].auto_name(), int(OpType.BARRIER), cacheable=False)
    with blocking():
        synchronize(submit(target, [new_entry(req, None, None)], first_result))


@eager
def join(device: int = -1) -> int:
    """Declare that this rank has no more data; until every rank has joined, its allreduces
    contribute zeros to the others', on the global set and on every process set it is in (a
    DistributedOptimizer on a set goes on without it). Blocks until all ranks joined; returns
    the last to join. Meanwhile a ShardedOptimizer's shard on this rank keeps being stepped
    (sharded/join.py). Synchronization: every rank (and, while serving, the optimizer's steps on
    the others)."""
    state, world = member_of(None, "join")
    server = state.join_hook() if state.join_hook is not None else None
    served = member_of(server.process_set, "join")[1] if server is not None else None
    with state.set_lock:
        members = [world] + [m for sid, m in sorted(state.members.items()) if sid != 0]
    # Blocking (the engine left asleep, run by this thread) only when this one JOIN is all
    # there is to wait for: a server's ops and the sets' JOINs need their engines awake.
    before = set_blocking(server is None and len(members) == 1)
    try:
        handles = []
        for member in members:
            req = Request(
                JOIN_NAME,
                int(OpType.JOIN),
                cacheable=False,
                serial=member.unnamed_count(),
                serves=server.prefixes if server and member is served else (),
            )
            handles.append(submit((state, member), [new_entry(req, None, None)], first_result))
        if server is not None:
            server.serve()
        results = [synchronize(handle) for handle in handles]
    finally:
        set_blocking(before)
    # Ranks that kept going numbered unnamed ops (barriers, allreduces) the joined ranks did not;
    # all continue from the highest count so later unnamed ops match again.
    for member, (_, serial) in zip(members, results):
        member.resume_names(serial)
    return results[0][0]
