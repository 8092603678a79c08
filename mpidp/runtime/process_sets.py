"""Process sets: subsets of ranks that run collectives among themselves, each on its own engine."""

from typing import List, Optional

from ..errors import MpidpError
from . import world


class ProcessSet:
    """A set of ranks (global ranks of mpidp's world), given as a list or an mpi4py communicator.

    Register it by passing it to init(process_sets=[...]) or add_process_set(); it then has a
    `process_set_id` and may be passed as `process_set=` to every collective. Its members
    negotiate on their own communicator, so ranks outside the set are never involved. A
    communicator may differ by rank (COMM_WORLD split by parity, say): one set is registered per
    distinct communicator, and the object is the set of this rank's part on each rank.
    """

    def __init__(self, ranks_or_comm):
        self.process_set_id: Optional[int] = None
        self.mpi_comm = None
        self._ranks: Optional[List[int]] = None
        if hasattr(ranks_or_comm, "Get_group"):  # an mpi4py communicator
            self.mpi_comm = ranks_or_comm
        else:
            try:
                self._ranks = sorted(int(r) for r in ranks_or_comm)
            except (TypeError, ValueError):
                raise TypeError(
                    f"ProcessSet takes a list of ranks or an mpi4py communicator, "
                    f"not {ranks_or_comm!r}"
                ) from None

    @property
    def ranks(self) -> Optional[List[int]]:
        """The member ranks (sorted); known once registered when built from a communicator."""
        if self.process_set_id is not None and world.is_initialized():
            known = world.state().sets.get(self.process_set_id)
            if known is not None:
                return list(known)
        return None if self._ranks is None else list(self._ranks)

    def _member(self):
        st = world.state()
        if self.process_set_id is None or self.process_set_id not in st.sets:
            raise ValueError(
                f"{self!r} is not registered: pass it to mpidp.init(process_sets="
                f"[...]) or mpidp.add_process_set() on every rank first"
            )
        return st, st.members.get(self.process_set_id)

    def included(self) -> bool:
        """Whether this rank belongs to the set."""
        return self._member()[1] is not None

    def size(self) -> int:
        """Number of ranks in the set."""
        st, _ = self._member()
        return len(st.sets[self.process_set_id])

    def rank(self) -> int:
        """This rank's index within the set; ValueError if it is not a member."""
        _, member = self._member()
        if member is None:
            raise ValueError(
                f"rank {world.rank()} is not in process set "
                f"{self.process_set_id} (ranks {self.ranks})"
            )
        return member.rank

    def __repr__(self) -> str:
        what = f"ranks={self.ranks}" if self.ranks is not None else "mpi_comm"
        return f"ProcessSet(process_set_id={self.process_set_id}, {what})"


class _GlobalProcessSet(ProcessSet):
    """Every rank of mpidp's world; the default `process_set=` of every op."""

    def __init__(self):
        super().__init__([])
        self.process_set_id = 0

    @property
    def ranks(self) -> Optional[List[int]]:
        return list(range(world.size())) if world.is_initialized() else None


global_process_set = _GlobalProcessSet()


def add_process_set(process_set) -> ProcessSet:
    """Register a ProcessSet (or a list of ranks) after init(); returns the registered set.

    Synchronization: collective over every rank of mpidp's world (all must call it with the same
    ranks, in the same order relative to other add/remove calls). Needs MPI_THREAD_MULTIPLE.
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set!r} is registered already")
    process_set.process_set_id = world.add_set(process_set)
    return process_set


def add_member_process_set(ranks) -> ProcessSet:
    """Register a set of `ranks` on its members only, as torch.distributed's new_group creates
    a group: ranks outside it do not call this and never learn of the set. Its id is local to
    this rank. Synchronization: collective over the members, which must create their common
    sets in the same order.
    """
    process_set = ProcessSet(ranks)
    process_set.process_set_id = world.add_member_set(process_set.ranks)
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set: members stop its engine (pending ops on it fail); returns True.

    Synchronization: every rank calls it; members stop the set's engine at a cycle they share.
    """
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"remove_process_set takes a ProcessSet, not {process_set!r}")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set!r} is not registered")
    world.remove_set(process_set.process_set_id)
    process_set.process_set_id = None
    return True


def is_outside(process_set) -> bool:
    """Whether `process_set` is registered and this rank is not one of its members."""
    if process_set is None or not world.is_initialized():
        return False
    st = world.state()
    sid = getattr(process_set, "process_set_id", process_set)
    return (
        isinstance(sid, int)
        and not isinstance(sid, bool)
        and sid in st.sets
        and sid not in st.members
    )


def member_of(process_set, what: str):
    """(state, member) for an op on `process_set` (None: global); clear errors otherwise."""
    st = world.state()
    if st.forked:
        raise MpidpError(
            f"{what}: this process was forked from the one that called init() "
            f"(pid {st.pid}), as a DataLoader worker is; its MPI state is that "
            f"process's, so collectives run only there (rank() and size() work "
            f"here)"
        )
    if isinstance(process_set, ProcessSet) and process_set.process_set_id is None:
        raise ValueError(
            f"{what}: {process_set!r} is not registered; add it with "
            f"mpidp.add_process_set() (or init(process_sets=...)) on every rank "
            f"first"
        )
    sid = 0 if process_set is None else getattr(process_set, "process_set_id", process_set)
    if not isinstance(sid, int) or isinstance(sid, bool):
        raise TypeError(f"{what}: process_set must be a ProcessSet, not {process_set!r}")
    member = st.members.get(sid)
    if member is None:
        if sid not in st.sets:
            raise ValueError(
                f"{what}: process set {process_set!r} is not registered; add it "
                f"with mpidp.add_process_set() (or init(process_sets=...)) first"
            )
        raise ValueError(
            f"{what}: rank {st.comms.rank} is not in process set {sid} (ranks "
            f"{list(st.sets[sid])}); only its members may run collectives on it"
        )
    return st, member
