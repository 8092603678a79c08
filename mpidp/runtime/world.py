"""Lifecycle: init() starts the engines on duplicated communicators, shutdown() stops them."""

import atexit
import os
import sys
import threading
from typing import Any, Dict, Optional

from .. import config as _config
from ..engine import interrupts
from ..engine.handles import HandleTable
from ..errors import ConfigError, MpidpError, NotInitializedError
from ..log import configure as _configure_log
from ..log import logger
from . import malloc_reuse, set_registry, slurm_pmi, ucx_segment, uncaught, unknown_vars
from .member import Member


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
        self.members = {0: Member(0, self.sets[0], engine, comms.rank)}  # sets this rank is in
        self.parts: Dict[int, list] = {}  # set id -> ids of every part of a split communicator
        self.pid = os.getpid()  # a forked child (a DataLoader worker) has its parent's state
        self.forked = False  # set in such a child: its collectives would use the parent's MPI
        self.next_set_id = 1
        self.set_lock = threading.Lock()
        self.thread_multiple = False  # MPI runs at MPI_THREAD_MULTIPLE (set by init())
        # Set by the training layer (sharded/join.py): join() calls it for what this rank must
        # keep doing while joined (None, or an object with `prefixes` and `serve()`).
        self.join_hook: Any = None
        # Read once: a peer's shutdown() frees the communicators while this rank may still ask.
        self.local_rank, self.local_size = comms.local.Get_rank(), comms.local.Get_size()
        self.cross_rank, self.cross_size = comms.cross.Get_rank(), comms.cross.Get_size()

    def unnamed_count(self) -> int:
        return self.members[0].unnamed_count()

    def resume_names(self, count: int) -> None:
        self.members[0].resume_names(count)


_state: Optional[_State] = None


def _after_fork_in_child() -> None:
    if _state is not None:
        _state.forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)
_atexit_registered = False
_init_lock = threading.Lock()


def _warn_lonely_world(size: int) -> None:
    if size != 1:
        return
    for var in _config.LAUNCHER_SIZE_VARIABLES:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 1:
            hint = (
                (
                    " Under Slurm, start ranks with `srun --mpi=pmi2` (or MpiDefault=pmi2) so "
                    "MPI finds its peers."
                )
                if var.startswith("SLURM")
                else ""
            )
            logger.warning(
                "MPI reports a world of size 1, but %s=%s announced %s ranks: each "
                "process is running alone.%s",
                var,
                value,
                value,
                hint,
            )
            return


def _check_thread_level(MPI) -> None:
    level = MPI.Query_thread()
    if level < MPI.THREAD_SERIALIZED:
        names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled"}
        raise MpidpError(
            f"MPI was initialised with thread level {names.get(level, level)!r}; mpidp's engine "
            f"thread needs at least 'serialized'. Unset MPI4PY_RC_THREAD_LEVEL or set it to "
            f"'multiple' (or set mpi4py.rc.thread_level = 'multiple' before importing "
            f"mpi4py.MPI)."
        )


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
            raise ValueError(
                f"init(comm={comm!r}) was called on world rank {world.Get_rank()}, "
                f"which is not in the list; only listed ranks may call init()"
            )
        return world.Create_group(world.Get_group().Incl(ranks))
    raise TypeError(
        f"init(comm=...) takes an mpi4py communicator or a list of world ranks, "
        f"not {type(comm).__name__}"
    )


def add_set(obj) -> int:
    """Register a process set after init(); see mpidp.add_process_set. Collective over the world."""
    from mpi4py import MPI

    st = state()
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        raise MpidpError(
            "adding a process set after init() needs MPI_THREAD_MULTIPLE (mpidp's "
            "engine threads use MPI meanwhile); pass the set to "
            "init(process_sets=[...]) instead, or unset MPI4PY_RC_THREAD_LEVEL"
        )
    return set_registry.register(MPI, st, obj, start=True)


def add_member_set(ranks) -> int:
    """Register a process set on its members only; see set_registry.register_members.
    Synchronization: collective over the members."""
    from mpi4py import MPI

    st = state()
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        raise MpidpError(
            "creating a process group after init() needs MPI_THREAD_MULTIPLE "
            "(mpidp's engine threads use MPI meanwhile); unset "
            "MPI4PY_RC_THREAD_LEVEL"
        )
    return set_registry.register_members(MPI, st, ranks)


def remove_set(set_id: int, timeout: float = 60.0) -> None:
    """Stop a process set's engine on its members and forget the set on every rank.

    Synchronization: members stop their engine at a cycle they share (like shutdown()).
    """
    set_registry.remove(state(), set_id, timeout)


def init(comm=None, process_sets=None, **overrides) -> None:
    """Start mpidp on every rank of `comm` (default COMM_WORLD). Collective: all ranks must call it.

    `process_sets`: ProcessSet objects (or rank lists) registered now, on every rank, in order;
    "dynamic" is accepted for Horovod compatibility (sets may always be added later).
    Synchronization: blocking collectives on `comm` (knob agreement, communicator duplication,
    process-set communicators). Keyword overrides set knobs by field name (see mpidp.config).
    Registers shutdown() at exit.
    """
    global _state, _atexit_registered
    netmod_note = None
    if "mpi4py.MPI" not in sys.modules:  # MPI starts below: what it reads must be set now
        netmod_note = slurm_pmi.choose_netmod()
        ucx_segment.prepare()
    from mpi4py import MPI  # imported here: importing mpidp must not initialise MPI

    from ..engine.engine import Engine
    from ..engine.mpi import Comms

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
            raise uncaught.said_once(
                ConfigError("; ".join(f"rank {r}: {e}" for r, e in errors)), base.Get_rank()
            )
        assert cfg is not None  # no rank failed to load its Config, this one included
        for field, value in views[0][1]:
            differ = [r for r, (_, items) in enumerate(views) if dict(items)[field] != value]
            if differ:
                raise uncaught.said_once(
                    ConfigError(
                        f"knob {field} must be the same on every rank: rank 0 has {value!r}, ranks "
                        f"{differ} have {[dict(views[r][1])[field] for r in differ]}; set the "
                        f"variable the same way for the whole job"
                    ),
                    base.Get_rank(),
                )
        comms = Comms(base, cfg.simulated_local_size)
        admin = base.Dup()
        if comm is not None and base is not comm:
            base.Free()
        _configure_log(comms.rank, comms.size, cfg.log_level)
        if netmod_note and comms.rank == 0:
            logger.info("%s", netmod_note)
        failure, engine = None, None
        try:
            if cfg.keep_freed_memory:
                malloc_reuse.keep_freed_memory()
            _warn_lonely_world(MPI.COMM_WORLD.Get_size())  # not comm=: a sub-world may be alone
            if comms.rank == 0:  # once per job: the ranks of a job share their environment
                for var, what in unknown_vars.unknown_variables():
                    logger.warning("%s=%r is %s", var, os.environ[var], what)
            engine = Engine(comms, cfg)
        except Exception as exc:  # every rank must hear of it, or the others wait for good
            failure = exc
        _agree_setup(admin, comms, engine, failure)
        uncaught.install_abort_hook(cfg.abort_on_error, _engines)
        interrupts.install()
        homogeneous = len(set(comms.local_sizes)) == 1
        st = _State(comms, engine, cfg, homogeneous, admin)
        st.thread_multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        if process_sets == "dynamic":
            process_sets = []
        for obj in process_sets or []:
            # Registered before any engine thread runs, so MPI_THREAD_SERIALIZED suffices.
            sid = set_registry.register(MPI, st, obj, start=False)
            if hasattr(obj, "process_set_id"):
                obj.process_set_id = sid
        _state = st
        for member in st.members.values():
            member.engine.start()
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
        logger.debug("initialised: %d ranks, knobs %s", comms.size, cfg)


def _agree_setup(admin, comms, engine, failure: Optional[BaseException]) -> None:
    """Raise on every rank if init()'s set-up failed on any (an unwritable autotune log on rank
    0, MPIDP_BACKEND=nccl without a GPU on all), naming each error once with the ranks that saw
    it: a ConfigError if every failure was one, else an MpidpError. Uncaught, the lowest rank
    alone reports it (uncaught.said_once). Before this, a rank's failure aborted the job from
    that rank alone, or left its peers waiting for good. Synchronization: an allgather on
    `admin`."""
    said = None
    if failure is not None:  # mpidp's own errors say what they are
        said = (
            str(failure)
            if isinstance(failure, MpidpError)
            else f"{type(failure).__name__}: {failure}",
            isinstance(failure, ConfigError),
        )
    seen = admin.allgather(said)
    if not any(seen):
        return
    admin.Free()
    if engine is not None:
        engine.discard()  # frees the communicators too
    else:
        comms.free()
    ranks: dict = {}
    for r, got in enumerate(seen):
        if got:
            ranks.setdefault(got[0], []).append(r)
    message = "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {text}"
        for text, rs in ranks.items()
    )
    kind = ConfigError if all(got[1] for got in seen if got) else MpidpError
    error = kind(message)
    error.__cause__ = failure
    raise uncaught.said_once(error, comms.rank)


def shutdown(timeout: float = 60.0) -> None:
    """Stop the engine on every rank and free mpidp's communicators; idempotent.

    Synchronization: the engine stops at a cycle that all ranks share, so a rank that calls
    shutdown() ends the other ranks' engines too (their pending ops fail with a clear error).
    MPI itself stays initialised, so init() may be called again. If an engine of this rank failed
    in the middle of a cycle, the job is ended instead (MPI_Abort): its peers could otherwise wait
    forever in a collective it left.
    """
    global _state
    with _init_lock:
        state, _state = _state, None
    if state is None:
        return
    broken = [sid for sid, m in state.members.items() if not m.engine.clean]
    if broken and state.comms.size > 1:
        from ..engine import mpi  # imported late: importing it initialises MPI

        # Its peers may wait in a collective this rank left mid-cycle: they would wait forever.
        mpi.abort_job(
            f"shutdown: the engine of process set(s) {broken} failed in the middle "
            f"of a cycle on rank {state.comms.rank}; its peers may be waiting in a "
            f"collective it left, so every rank of the job is ended"
        )
    stopped = True
    for sid in sorted(state.members, reverse=True):  # process sets first, the global set last
        if not state.members[sid].engine.stop(timeout):
            stopped = False
            logger.warning(
                "shutdown: the engine of process set %d did not stop within %.0f s "
                "(a peer rank is gone or stuck); leaving it behind",
                sid,
                timeout,
            )
    if stopped:
        state.admin.Free()


def is_initialized() -> bool:
    """True between init() and shutdown() on this rank."""
    return _state is not None


def current() -> Optional[_State]:
    """The current init()'s state, or None before init() and after shutdown()."""
    return _state


def state() -> _State:
    """The current init()'s state; ValueError telling the user to call init() otherwise."""
    s = _state
    if s is None:
        raise NotInitializedError(
            "mpidp is not initialised: call mpidp.init() first (on every "
            "rank) before using it, and not after mpidp.shutdown()"
        )
    return s


def link_slow() -> bool:
    """Whether the global process set's ranks span hosts over a link they measured slow at
    init (engine/link.py); False before init. Synchronization: none (agreed at init)."""
    st = current()
    return st is not None and st.engine.backend.link_slow


def rank() -> int:
    """This process's rank in mpidp's world."""
    return state().comms.rank


def size() -> int:
    """Number of ranks in mpidp's world."""
    return state().comms.size


def _engines() -> list:
    """The engines of the current init() (the world's and every process set's); none outside it."""
    s = _state
    return [member.engine for member in s.members.values()] if s is not None else []
