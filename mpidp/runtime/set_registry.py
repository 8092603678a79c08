"""The process-set registry: the ranks of each set, agreed by every rank; members get an engine.

The caller (runtime) passes mpi4py's MPI module in: only the runtime and engine/mpi/ import it.
"""

import zlib
from typing import Optional

from ..log import logger
from .member import Member


def ranks_of(MPI, obj, world) -> Optional[tuple]:
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
            raise ValueError(
                "the process set's communicator holds processes outside mpidp's "
                "world; build it from the communicator given to init()"
            )
    else:
        ranks = getattr(obj, "ranks", obj)
    try:
        ranks = [int(r) for r in ranks if not isinstance(r, bool)] if ranks is not None else []
    except (TypeError, ValueError):
        raise TypeError(
            f"a process set is a list of ranks or an mpi4py communicator, not {ranks!r}"
        ) from None
    size = world.Get_size()
    if not ranks or len(set(ranks)) != len(ranks) or min(ranks) < 0 or max(ranks) >= size:
        raise ValueError(
            f"process set ranks {ranks!r} must be distinct ranks in 0..{size - 1}, at least one"
        )
    return tuple(sorted(ranks))


def _from_comm(MPI, obj) -> bool:
    """Whether `obj` names its members through an mpi4py communicator."""
    return getattr(obj, "mpi_comm", None) is not None or isinstance(obj, MPI.Comm)


def _agreed(views) -> list:
    """The member tuples to register, from every rank's (view, error, from_comm).

    Ranks lists must be alike on every rank. Communicators may differ (Horovod's example splits
    COMM_WORLD by parity: one set per distinct communicator), as long as every member of a view
    reported that same view.
    """
    errors = [f"rank {r}: {e}" for r, (_, e, _) in enumerate(views) if e]
    if errors:
        raise ValueError("process set refused: " + "; ".join(errors))
    distinct = sorted({v for v, _, _ in views if v is not None})
    split = (
        len(distinct) > 1
        and all(c for _, _, c in views)
        and all(views[m][0] == v for v in distinct for m in v)
    )
    if len(distinct) != 1 and not split:
        described = ", ".join(
            f"rank {r}: {list(v) if v else None}" for r, (v, _, _) in enumerate(views)
        )
        raise ValueError(
            f"process set refused: ranks disagree on its members ({described}); "
            f"every rank must add the same set, or a communicator that every "
            f"member of it passes too"
        )
    return distinct


def register(MPI, st, obj, start: bool) -> int:
    """Register a process set on every rank; members get an engine. Returns the set id (for a
    communicator split several ways, one set per part: the id of this rank's part).

    Synchronization: collective over mpidp's world (allgather, then MPI_Comm_create per set).
    """
    try:
        view, error = ranks_of(MPI, obj, st.admin), None
    except (TypeError, ValueError) as exc:
        view, error = None, f"{type(exc).__name__}: {exc}"
    parts = _agreed(st.admin.allgather((view, error, _from_comm(MPI, obj))))
    for ranks in parts:
        for sid, existing in st.sets.items():
            if existing == ranks:
                raise ValueError(
                    f"a process set with ranks {list(ranks)} already exists (id "
                    f"{sid}); use that one"
                )
    ids = [_create(MPI, st, ranks, start) for ranks in parts]
    if len(ids) > 1:  # removing the set on every rank removes every part
        st.parts.update({sid: tuple(ids) for sid in ids})
    return next((sid for sid, ranks in zip(ids, parts) if st.comms.rank in ranks), ids[0])


def register_members(MPI, st, ranks) -> int:
    """Register a process set of `ranks` on its members only (torch.distributed's new_group
    creates a group on its members alone); returns its id, which is this rank's own: ranks
    outside the set never learn of it. Synchronization: collective over the members
    (MPI_Comm_create_group), which must create their common sets in the same order.
    """
    ranks = ranks_of(MPI, list(ranks), st.admin)
    if st.comms.rank not in ranks:
        raise ValueError(
            f"rank {st.comms.rank} is not in {list(ranks)}: only the members of "
            f"a set created by its members alone may create it"
        )
    # Sets created at once by disjoint groups of ranks must not match each other's messages.
    tag = zlib.crc32(repr(ranks).encode()) & 0x7FFF
    return _create(MPI, st, ranks, True, tag)


def _create(MPI, st, ranks: tuple, start: bool, members_only_tag: int = -1) -> int:
    """Give `ranks` an id and, on its members, a communicator and an engine (collective over
    the world, or over the members alone with `members_only_tag` >= 0)."""
    from ..engine.engine import Engine
    from ..engine.mpi import Comms

    group = st.admin.Get_group()
    sub = group.Incl(list(ranks))
    if members_only_tag >= 0:
        comm = st.admin.Create_group(sub, tag=members_only_tag)
    else:
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
        # The world's store, where its engine has one: no new connections (torchdist.open_group).
        world = st.members.get(0)
        engine = Engine(
            comms, st.config, sid, world.engine.backend.group_store() if world else None
        )
        st.members[sid] = Member(sid, ranks, engine, st.comms.rank)
        if start:
            engine.start()
    return sid


def remove(st, set_id: int, timeout: float) -> None:
    """Forget set `set_id` (with the other parts of a communicator split with it) on this rank
    and stop its engine if this rank is a member (see runtime.remove_set)."""
    if set_id == 0:
        raise ValueError("the global process set cannot be removed; call mpidp.shutdown()")
    with st.set_lock:
        if set_id not in st.sets:
            raise ValueError(f"process set {set_id} is not registered (removed already?)")
        members = []
        for sid in st.parts.get(set_id, (set_id,)):
            st.parts.pop(sid, None)
            st.sets.pop(sid, None)
            members.append(st.members.pop(sid, None))
    for member in members:
        if member is not None and not member.engine.stop(timeout):
            logger.warning(
                "remove_process_set: the engine of set %d did not stop within %.0f "
                "s (a member rank is gone or did not call remove_process_set)",
                member.set_id,
                timeout,
            )
