"""Lifecycle and topology: init() starts the engine on duplicated communicators, shutdown() stops it."""

import atexit
import os
import socket
import sys
import threading
import time
import traceback
from typing import Optional

from . import config as _config
from .engine.handles import HandleTable
from .errors import ConfigError, MpidpError, NotInitializedError
from .log import configure as _configure_log, logger


class _Member:
    """This rank's part in one process set: the set's world ranks, its engine, unnamed numbering."""

    def __init__(self, set_id: int, ranks, engine, world_rank: int):
        self.set_id = set_id
        self.ranks = tuple(ranks)
        self.engine = engine
        self.rank = self.ranks.index(world_rank)
        self.size = len(self.ranks)
        self._lock = threading.Lock()
        self._noname = 0

    def auto_name(self) -> str:
        """Unnamed ops match across ranks by submission order: the k-th unnamed op is 'noname.k'."""
        with self._lock:
            self._noname += 1
            return f"noname.{self._noname}"

    def unnamed_count(self) -> int:
        return self._noname

    def resume_names(self, count: int) -> None:
        """Continue unnamed numbering from `count` (after a join, the same on every rank)."""
        with self._lock:
            self._noname = max(self._noname, count)


class _State:
    """Everything one init() creates; replaced wholesale by the next init()."""

    def __init__(self, comms, engine, cfg, homogeneous: bool, admin):
        self.comms = comms
        self.engine = engine  # the global process set's engine
        self.config = cfg
        self.homogeneous = homogeneous
        self.handles = HandleTable()
        self.admin = admin  # user-thread collectives (process-set registration), apart from engines
        self.sets = {0: tuple(range(comms.size))}  # every registered set: id -> world ranks
        self.members = {0: _Member(0, self.sets[0], engine, comms.rank)}  # sets this rank is in
        self.next_set_id = 1
        self.set_lock = threading.Lock()
        self.thread_multiple = False  # MPI runs at MPI_THREAD_MULTIPLE (set by init())
        # Read once: a peer's shutdown() frees the communicators while this rank may still ask.
        self.local_rank, self.local_size = comms.local.Get_rank(), comms.local.Get_size()
        self.cross_rank, self.cross_size = comms.cross.Get_rank(), comms.cross.Get_size()

    @property
    def engines(self):
        """Engines of the process sets this rank belongs to, by set id (0: global)."""
        return {sid: m.engine for sid, m in self.members.items()}

    @property
    def _noname(self) -> int:
        return self.members[0].unnamed_count()

    def auto_name(self) -> str:
        return self.members[0].auto_name()

    def unnamed_count(self) -> int:
        return self.members[0].unnamed_count()

    def resume_names(self, count: int) -> None:
        self.members[0].resume_names(count)


_state: Optional[_State] = None
_atexit_registered = False
_init_lock = threading.Lock()

_LAUNCHER_SIZE_VARS = ("SLURM_NTASKS", "SLURM_NPROCS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                       "PMIX_SIZE", "MPI_LOCALNRANKS")


def _warn_lonely_world(size: int) -> None:
    if size != 1:
        return
    for var in _LAUNCHER_SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 1:
            hint = (" Under Slurm, start ranks with `srun --mpi=pmi2` (or MpiDefault=pmi2) so "
                    "MPI finds its peers.") if var.startswith("SLURM") else ""
            logger.warning("MPI reports a world of size 1, but %s=%s announced %s ranks: each "
                           "process is running alone.%s", var, value, value, hint)
            return


_previous_excepthook = None
_ABORT_GRACE_S = 0.3
_INTERRUPT_QUIET_S = 1.0  # how long a rank other than 0 lets rank 0 report a Ctrl-C first


def _abort_on_uncaught(exc_type, exc, tb) -> None:
    """sys.excepthook while abort_on_error is on: log who failed and why, then end every rank."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if world.Get_size() == 1 or MPI.Is_finalized():  # nobody else can be left waiting
        (_previous_excepthook or sys.__excepthook__)(exc_type, exc, tb)
        return
    rank = world.Get_rank()
    if issubclass(exc_type, KeyboardInterrupt):
        # Ctrl-C reaches every rank at once: a traceback per rank says nothing. Rank 0 says it
        # in one line and ends the job; another rank speaks only if it was interrupted alone
        # (the job is still there after rank 0 had its chance).
        if rank != 0:
            time.sleep(_INTERRUPT_QUIET_S)
        logger.critical("interrupted (KeyboardInterrupt) on rank %d (host %s); ending all %d "
                        "ranks of the job", rank, socket.gethostname(), world.Get_size())
    else:
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        logger.critical("uncaught %s on rank %d (host %s); aborting all %d ranks of the job "
                        "(MPIDP_ABORT_ON_ERROR=0 turns this off):\n%s", exc_type.__name__,
                        rank, socket.gethostname(), world.Get_size(), text.rstrip())
    previous = _previous_excepthook
    if previous is not None and previous is not sys.__excepthook__:
        previous(exc_type, exc, tb)  # the user's own hook still runs; the default would repeat ours
    # Without this, the other ranks would wait in their next collective for this one forever.
    from .engine.mpi import end_job
    end_job(_ABORT_GRACE_S)


def _said_once(error: BaseException, rank: int) -> BaseException:
    """`error`, raised on every rank alike; if no one catches it, rank 0 alone reports it (one
    line, no traceback) instead of a traceback per rank. Returns it for `raise`."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if exc is not error:
            previous(exc_type, exc, tb)
            return
        if rank == 0:  # the message already names the ranks concerned
            sys.stderr.write(f"mpidp: init() failed on every rank: {exc_type.__name__}: "
                             f"{exc}\n")
            sys.stderr.flush()

    sys.excepthook = hook
    return error


def _install_abort_hook(enabled: bool) -> None:
    global _previous_excepthook
    if enabled and sys.excepthook is not _abort_on_uncaught:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _abort_on_uncaught
    elif not enabled and sys.excepthook is _abort_on_uncaught:
        sys.excepthook = _previous_excepthook or sys.__excepthook__


def _check_thread_level(MPI) -> None:
    level = MPI.Query_thread()
    if level < MPI.THREAD_SERIALIZED:
        names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled"}
        raise MpidpError(
            f"MPI was initialised with thread level {names.get(level, level)!r}; mpidp's engine "
            f"thread needs at least 'serialized'. Unset MPI4PY_RC_THREAD_LEVEL or set it to "
            f"'multiple' (or set mpi4py.rc.thread_level = 'multiple' before importing "
            f"mpi4py.MPI).")


def _base_comm(MPI, comm):
    if comm is None:
        return MPI.COMM_WORLD
    if isinstance(comm, MPI.Comm):
        return comm
    if isinstance(comm, (list, tuple)):
        ranks = sorted(set(int(r) for r in comm))
        world = MPI.COMM_WORLD
        if len(ranks) != len(comm):
            raise ValueError(f"init(comm={comm!r}): a rank is listed twice")
        if not ranks or ranks[0] < 0 or ranks[-1] >= world.Get_size():
            raise ValueError(f"init(comm={comm!r}): ranks must lie in 0..{world.Get_size() - 1}")
        if world.Get_rank() not in ranks:
            raise ValueError(f"init(comm={comm!r}) was called on world rank {world.Get_rank()}, "
                             f"which is not in the list; only listed ranks may call init()")
        return world.Create_group(world.Get_group().Incl(ranks))
    raise TypeError(f"init(comm=...) takes an mpi4py communicator or a list of world ranks, "
                    f"not {type(comm).__name__}")


def _set_ranks(MPI, obj, world) -> tuple:
    """World ranks of a process set given as a list of ranks or as (an object with) ranks/mpi_comm."""
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


def _register_set(MPI, st: "_State", obj, start: bool):
    """Register a process set on every rank; members get an engine. Returns the set id.

    Synchronization: collective over mpidp's world (allgather, then MPI_Comm_create).
    """
    from .engine.engine import Engine
    from .engine.mpi import Comms

    try:
        view, error = _set_ranks(MPI, obj, st.admin), None
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
        comms = _comms(Comms, comm, st.config)
        comm.Free()
        engine = Engine(comms, st.config, sid)
        st.members[sid] = _Member(sid, ranks, engine, st.comms.rank)
        if start:
            engine.start()
    return sid


def _comms(Comms, base, cfg):
    return Comms(base, cfg.simulated_local_size)


def add_set(obj) -> int:
    """Register a process set after init(); see mpidp.add_process_set. Collective over the world."""
    from mpi4py import MPI
    st = state()
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        raise MpidpError("adding a process set after init() needs MPI_THREAD_MULTIPLE (mpidp's "
                         "engine threads use MPI meanwhile); pass the set to "
                         "init(process_sets=[...]) instead, or unset MPI4PY_RC_THREAD_LEVEL")
    return _register_set(MPI, st, obj, start=True)


def remove_set(set_id: int, timeout: float = 60.0) -> None:
    """Stop a process set's engine on its members and forget the set on every rank.

    Synchronization: members stop their engine at a cycle they share (like shutdown()).
    """
    st = state()
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


def init(comm=None, process_sets=None, **overrides) -> None:
    """Start mpidp on every rank of `comm` (default COMM_WORLD). Collective: all ranks must call it.

    `process_sets`: ProcessSet objects (or rank lists) registered now, on every rank, in order;
    "dynamic" is accepted for Horovod compatibility (sets may always be added later).
    Synchronization: blocking collectives on `comm` (knob agreement, communicator duplication,
    process-set communicators). Keyword overrides set knobs by field name (see mpidp.config).
    Registers shutdown() at exit.
    """
    global _state, _atexit_registered
    from mpi4py import MPI  # imported here: importing mpidp must not initialise MPI

    from .engine.engine import Engine
    from .engine.mpi import Comms

    with _init_lock:
        if _state is not None:
            return
        _check_thread_level(MPI)
        base = _base_comm(MPI, comm)
        error = None
        try:
            cfg = _config.load(**overrides)
        except ConfigError as exc:
            error, cfg = str(exc), None
        # Agree before duplicating, so one rank's bad variable fails every rank instead of a hang.
        views = base.allgather((error, cfg.agreed_items() if cfg else None))
        errors = [(r, e) for r, (e, _) in enumerate(views) if e]
        if errors:
            raise _said_once(ConfigError("; ".join(f"rank {r}: {e}" for r, e in errors)),
                             base.Get_rank())
        for field, value in views[0][1]:
            differ = [r for r, (_, items) in enumerate(views) if dict(items)[field] != value]
            if differ:
                raise _said_once(ConfigError(
                    f"knob {field} must be the same on every rank: rank 0 has {value!r}, ranks "
                    f"{differ} have {[dict(views[r][1])[field] for r in differ]}; set the "
                    f"variable the same way for the whole job"), base.Get_rank())
        comms = _comms(Comms, base, cfg)
        admin = base.Dup()
        if comm is not None and base is not comm:
            base.Free()
        _configure_log(comms.rank, comms.size, cfg.log_level)
        _install_abort_hook(cfg.abort_on_error)
        _warn_lonely_world(comms.size)
        if comms.rank == 0:  # once per job: the ranks of a job share their environment
            for var, what in _config.unknown_variables():
                logger.warning("%s=%r is %s", var, os.environ[var], what)
        homogeneous = len(set(comms.local_sizes)) == 1
        engine = Engine(comms, cfg)
        st = _State(comms, engine, cfg, homogeneous, admin)
        st.thread_multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        if process_sets == "dynamic":
            process_sets = []
        for obj in process_sets or []:
            # Registered before any engine thread runs, so MPI_THREAD_SERIALIZED suffices.
            sid = _register_set(MPI, st, obj, start=False)
            if hasattr(obj, "process_set_id"):
                obj.process_set_id = sid
        _state = st
        for member in st.members.values():
            member.engine.start()
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
        logger.debug("initialised: %d ranks, knobs %s", comms.size, cfg)


def shutdown(timeout: float = 60.0) -> None:
    """Stop the engine on every rank and free mpidp's communicators; idempotent.

    Synchronization: the engine stops at a cycle that all ranks share, so a rank that calls
    shutdown() ends the other ranks' engines too (their pending ops fail with a clear error).
    MPI itself stays initialised, so init() may be called again.
    """
    global _state
    with _init_lock:
        state, _state = _state, None
    if state is None:
        return
    stopped = True
    for sid in sorted(state.members, reverse=True):  # process sets first, the global set last
        if not state.members[sid].engine.stop(timeout):
            stopped = False
            logger.warning("shutdown: the engine of process set %d did not stop within %.0f s "
                           "(a peer rank is gone or stuck); leaving it behind", sid, timeout)
    if stopped:
        state.admin.Free()


def is_initialized() -> bool:
    """True between init() and shutdown() on this rank."""
    return _state is not None


def state() -> _State:
    """The current init()'s state; ValueError telling the user to call init() otherwise."""
    s = _state
    if s is None:
        raise NotInitializedError("mpidp is not initialised: call mpidp.init() first (on every "
                                  "rank) before using it, and not after mpidp.shutdown()")
    return s


def rank() -> int:
    """This process's rank in mpidp's world."""
    return state().comms.rank


def size() -> int:
    """Number of ranks in mpidp's world."""
    return state().comms.size
