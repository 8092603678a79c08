"""The process-set registry: the ranks of each set, agreed by every rank; members get an engine.

The caller (runtime) passes mpi4py's MPI module in: only the runtime and engine/mpi.py import it.
"""

from .log import logger
from .member import Member


def ranks_of(MPI, obj, world) -> tuple:
    """World ranks of a process set given as a list of ranks or (an object with) ranks/mpi_comm."""
    comm = getattr(obj, "mpi_comm", None)
    if comm is None and isinstance(obj, MPI.Comm):
        comm = obj
    if comm is not None:
        if comm == MPI.COMM_NULL:
            return None  # this rank is outside the set; the members say which ranks are in it
        group, world_group = comm.Get_group(), world.Get_group()
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world_group)
        group.Free()
        world_group.Free()
        if MPI.UNDEFINED in ranks:
            raise ValueError("the process set's communicator holds processes outside mpidp's "
                             "world; build it from the communicator given to init()")
    else:
        ranks = getattr(obj, "ranks", obj)
    try:
        ranks = [int(r) for r in ranks if not isinstance(r, bool)] if ranks is not None else []
    except (TypeError, ValueError):
        raise TypeError(f"a process set is a list of ranks or an mpi4py communicator, not "
                        f"{ranks!r}") from None
    size = world.Get_size()
    if not ranks or len(set(ranks)) != len(ranks) or min(ranks) < 0 or max(ranks) >= size:
        raise ValueError(f"process set ranks {ranks!r} must be distinct ranks in 0..{size - 1}, "
                         f"at least one")
    return tuple(sorted(ranks))


def register(MPI, st, obj, start: bool) -> int:
    """Register a process set on every rank; members get an engine. Returns the set id.

    Synchronization: collective over mpidp's world (allgather, then MPI_Comm_create).
    """
    from .engine.engine import Engine
    from .engine.mpi import Comms

    try:
        view, error = ranks_of(MPI, obj, st.admin), None
    except (TypeError, ValueError) as exc:
        view, error = None, f"{type(exc).__name__}: {exc}"
    views = st.admin.allgather((view, error))
    errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(views) if e]
    if errors:
        raise ValueError("process set refused: " + "; ".join(errors))
    distinct = sorted({v for v, _ in views if v is not None})
    if len(distinct) != 1:
        described = ", ".join(f"rank {r}: {list(v) if v else None}" for r, (v, _) in
                              enumerate(views))
        raise ValueError(f"process set refused: ranks disagree on its members ({described}); "
                         f"every rank must add the same set")
    ranks = distinct[0]
    for sid, existing in st.sets.items():
        if existing == ranks:
            raise ValueError(f"a process set with ranks {list(ranks)} already exists (id {sid}); "
                             f"use that one")
    group = st.admin.Get_group()
    sub = group.Incl(list(ranks))
    comm = st.admin.Create(sub)
    sub.Free()
    group.Free()
    with st.set_lock:
        sid = st.next_set_id
        st.next_set_id += 1
        st.sets[sid] = ranks
    if comm != MPI.COMM_NULL:
        comms = Comms(comm, st.config.simulated_local_size)
        comm.Free()
        engine = Engine(comms, st.config, sid)
        st.members[sid] = Member(sid, ranks, engine, st.comms.rank)
        if start:
            engine.start()
    return sid


def remove(st, set_id: int, timeout: float) -> None:
    """Forget set `set_id` on this rank and stop its engine if this rank is a member (see
    runtime.remove_set)."""
    if set_id == 0:
        raise ValueError("the global process set cannot be removed; call mpidp.shutdown()")
    with st.set_lock:
        if set_id not in st.sets:
            raise ValueError(f"process set {set_id} is not registered (removed already?)")
        del st.sets[set_id]
        member = st.members.pop(set_id, None)
    if member is not None and not member.engine.stop(timeout):
        logger.warning("remove_process_set: the engine of set %d did not stop within %.0f s "
                       "(a member rank is gone or did not call remove_process_set)", set_id,
                       timeout)
