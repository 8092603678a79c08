"""Every knob of mpidp, defined once (variables, parser, default, why); the launcher variables."""

import dataclasses
import os
from typing import Any, Callable, Dict, FrozenSet, Mapping, Optional, Tuple, TypeVar

from .errors import ConfigError

MiB = 1024 * 1024
TIMELINE_DYNAMIC = "DYNAMIC"  # timeline_path meaning "no file until start_timeline()"
# The bucket knobs' values across a link the ranks measured slow, where unset (training/buckets.py
# bucket_caps; BENCHMARKS.md, "Finer buckets across a slow link").
SLOW_LINK_BUCKET_BYTES = 4 * MiB
SLOW_LINK_LAST_BUCKET_BYTES = 1 * MiB


@dataclasses.dataclass(frozen=True)
class Knob:
    """One knob: its Config field, variables, parser, default (its type is the field's), doc;
    KNOBS reads them from Config's fields."""

    field: str
    env: str
    parse: Callable[[str], object]
    default: object
    doc: str
    horovod: Optional[str] = None
    must_agree: bool = True  # all ranks must hold the same value (checked by init())


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def _int(text: str) -> int:
    try:
        return int(text.strip(), 0)
    except ValueError:
        raise ValueError("expected an integer (decimal, or hex with 0x)") from None


def _nonneg_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def _pos_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise ValueError("must be > 0")
    return value


def _nonneg_float(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError("expected a number") from None
    if not 0.0 <= value < float("inf"):  # also rejects nan and inf
        raise ValueError("must be a finite number >= 0")
    return value


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        low = text.strip().lower()
        if low not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return low

    parse.__name__ = "choice"
    return parse


def _path(text: str) -> str:
    return text.strip()


_log_level = _choice("trace", "debug", "info", "warning", "error", "fatal")


_T = TypeVar("_T")
_KNOB = "mpidp.knob"  # the metadata key of a knob's variables, parser and doc


def _knob(
    env: str,
    parse: Callable[[str], _T],
    default: _T,
    doc: str,
    *,
    horovod: Optional[str] = None,
    must_agree: bool = True,
) -> _T:
    """A Config field that is a knob: its default, and in its metadata the rest of its Knob."""
    return dataclasses.field(
        default=default,
        metadata={
            _KNOB: dict(env=env, parse=parse, doc=doc, horovod=horovod, must_agree=must_agree)
        },
    )


@dataclasses.dataclass(frozen=True)
class Config:
    """Values of every knob for one init(), one field per knob, and `explicit`: the fields set
    through the environment or overrides; built by `load`, immutable."""

    # Every knob is declared here, once: its field's name, type and default, and through _knob
    # its variables, parser and doc (KNOBS below is read from these fields). Frozen: one Config
    # is shared by every engine of an init(), so a change is a new one (dataclasses.replace).
    fusion_threshold_bytes: int = _knob(
        "MPIDP_FUSION_THRESHOLD_BYTES",
        _nonneg_int,
        4 * MiB,
        "Most bytes packed into one fusion buffer; 0 disables fusion. 4 MiB, not Horovod's "
        "128 MiB: with 16-64 MiB buffers the ResNet-18 gradients took 1.5-1.9x the best "
        "raw time, against 1.3x with 1-4 MiB (BENCHMARKS.md, fusion sweep).",
        horovod="HOROVOD_FUSION_THRESHOLD",
    )
    fuse_below_bytes: int = _knob(
        "MPIDP_FUSE_BELOW_BYTES",
        _nonneg_int,
        64 * 1024,
        "Only tensors smaller than this are fused; larger ones are reduced on their own, in "
        "place, with no copy: per-tensor calls beat pack+unpack once a tensor is "
        "bandwidth-bound (BENCHMARKS.md).",
    )
    chunk_bytes: int = _knob(
        "MPIDP_CHUNK_BYTES",
        _nonneg_int,
        4 * MiB,
        "A tensor reduced on its own is cut into chunks of this many bytes, each one "
        "collective on a slice in place; 0 means never chunk. Cache-sized chunks run at about "
        "twice the bandwidth of one 64 MB call on one host (BENCHMARKS.md). Unset, a job "
        "whose ranks span hosts times 3 reductions of two chunks when it starts and, if the "
        "link moved less than 3 Gbit/s (there the network sets the pace, and each chunk's start "
        "and end leave it idle), reduces large tensors whole (engine/link.py). Across "
        "hosts a tensor that goes whole crosses as 1 MiB pieces all in flight at once, which "
        "UCX sends eagerly over TCP (engine/backends/host.py).",
    )
    cycle_time_ms: float = _knob(
        "MPIDP_CYCLE_TIME_MS",
        _nonneg_float,
        0.0,
        "Shortest time between the starts of two engine cycles while work flows. 0 (Horovod: "
        "1 ms) because the cycle wakes on submission: a fixed wait adds directly to the latency "
        "of every blocking op.",
        horovod="HOROVOD_CYCLE_TIME",
    )
    bucket_bytes: int = _knob(
        "MPIDP_BUCKET_BYTES",
        _nonneg_int,
        25 * MiB,
        "DistributedOptimizer groups gradients, in reverse order of the parameters, into "
        "buckets of at most this many bytes; a bucket is one op (one negotiation, one handle) "
        "submitted when its last gradient is ready. 0: one op per parameter. Unset, 4 MiB "
        "across a link the ranks measured slow (MPIDP_CHUNK_BYTES), where the network waits "
        "for each bucket.",
    )
    first_bucket_bytes: int = _knob(
        "MPIDP_FIRST_BUCKET_BYTES",
        _nonneg_int,
        1 * MiB,
        "DistributedOptimizer's first bucket (the last layers' gradients, the first that the "
        "backward pass produces) closes once it holds this many bytes, so that the first "
        "reduction starts early in the backward pass. 0: the same cap as the other buckets "
        "(MPIDP_BUCKET_BYTES).",
    )
    last_bucket_bytes: int = _knob(
        "MPIDP_LAST_BUCKET_BYTES",
        _nonneg_int,
        0,
        "DistributedOptimizer's last bucket (the first layers' gradients, the last that the "
        "backward pass produces) holds the first parameters up to the one that reaches this "
        "many bytes, so that little is left to reduce once the backward pass ends. 0: the "
        "buckets fill up from the last layer back and the last one holds what is left. Unset, "
        "0 on one host or a fast link (4 MiB made ResNet-18's step on one host 1.13-1.16x the "
        'best hand-written MPI against 0.97-1.11; BENCHMARKS.md, "A wait that sleeps, and '
        "UCX's TCP segment\"), 1 MiB across a link the ranks measured slow (MPIDP_CHUNK_BYTES).",
    )
    overlap: str = _knob(
        "MPIDP_OVERLAP",
        _choice("auto", "0", "1"),
        "auto",
        "1: DistributedOptimizer starts a bucket's reduction during the backward pass, once its "
        "gradients are ready; 0: all buckets when the step synchronizes. auto: 1, unless the "
        "parameters are on the CPU and a rank's share of its host's cores is no more than "
        "torch's threads: there the backward pass keeps the cores busy, and overlapping "
        "slowed training steps by 5-80 % on one host (BENCHMARKS.md). Across hosts, on the "
        "CPU, auto is settled by timing both modes (MPIDP_OVERLAP_TRIAL_STEPS).",
        must_agree=False,
    )
    overlap_trial_steps: int = _knob(
        "MPIDP_OVERLAP_TRIAL_STEPS",
        _nonneg_int,
        3,
        "With MPIDP_OVERLAP=auto, parameters on the CPU and ranks on several hosts, "
        "DistributedOptimizer times its first training steps in four blocks of this many, "
        "overlapped, not, not, overlapped (16 steps at 3, settling ones included), and keeps "
        "the mode whose median step was shorter; the choice is logged. A torch.distributed "
        "group on backend mpidp does the same for the allreduces that backward passes make "
        "(DDP's buckets), a step being one backward pass's end to the next. Whether "
        "overlapping pays there depends on the link against the cores: it did at 1 Gbit/s and "
        "not at 10 on the test cluster (BENCHMARKS.md). 0: no trial, the core rule alone.",
        must_agree=False,
    )
    reduce_in_backward: bool = _knob(
        "MPIDP_REDUCE_IN_BACKWARD",
        _parse_bool,
        True,
        "1: the backward pass that ends a DistributedOptimizer step (its "
        "backward_passes_per_step-th) returns only once every gradient is averaged, as with "
        "DDP, so clipping, GradScaler or logging between backward() and step() see the "
        "averaged gradients; 0: the reductions are waited for in step() or synchronize(), as "
        "in Horovod.",
    )
    keep_freed_memory: bool = _knob(
        "MPIDP_KEEP_FREED_MEMORY",
        _parse_bool,
        True,
        "1: init() tells glibc's malloc to keep freed blocks below 256 MiB for reuse instead of "
        "giving them back and page-faulting them in again every step (Adam training steps ran "
        "5-20 % faster here, peak memory unchanged; BENCHMARKS.md); 0, or the environment "
        "setting malloc's thresholds, leaves malloc alone.",
        must_agree=False,
    )
    cache_capacity: int = _knob(
        "MPIDP_CACHE_CAPACITY",
        _nonneg_int,
        1024,
        "Negotiated names remembered for the bit-vector fast path; 0 disables the cache.",
        horovod="HOROVOD_CACHE_CAPACITY",
    )
    stall_warning_s: float = _knob(
        "MPIDP_STALL_WARNING_S",
        _nonneg_float,
        60.0,
        "Seconds a tensor may wait for missing ranks before rank 0 logs which ranks and "
        "tensors are missing, and an MPI call every rank entered may last before the "
        "waiting ranks log it with the ranks and hosts they wait on (a slow or cut link); "
        "0 disables the check.",
        horovod="HOROVOD_STALL_CHECK_TIME_SECONDS",
    )
    stall_shutdown_s: float = _knob(
        "MPIDP_STALL_SHUTDOWN_S",
        _nonneg_float,
        0.0,
        "Seconds after which a stalled tensor shuts the engine down and fails every pending "
        "op, and after which a rank stuck in an MPI call (a host unreachable) ends the job "
        "naming the ranks and hosts it waits on; 0 means never.",
        horovod="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
    )
    order_check_s: float = _knob(
        "MPIDP_ORDER_CHECK_S",
        _nonneg_float,
        1.0,
        "Seconds a torch.distributed call (backend mpidp) may wait before its group's ranks "
        "compare what each waits for: ranks that called different collectives, or the same "
        "with other shapes or dtypes, then get a MismatchError naming the calls and the ranks "
        "(gloo and NCCL hang there); 0 disables the check.",
    )
    log_level: str = _knob(
        "MPIDP_LOG_LEVEL",
        _log_level,
        "warning",
        "Level of mpidp's rank-prefixed log.",
        horovod="HOROVOD_LOG_LEVEL",
        must_agree=False,
    )
    abort_on_error: bool = _knob(
        "MPIDP_ABORT_ON_ERROR",
        _parse_bool,
        True,
        "An uncaught exception on any rank logs rank, host and traceback, then aborts the "
        "whole job (MPI_Abort) so no other rank waits for it forever; 0 turns this off.",
        must_agree=False,
    )
    timeline_path: str = _knob(
        "MPIDP_TIMELINE",
        _path,
        "",
        "Rank 0 writes a Chrome-trace JSON timeline of every op to this file; empty: none. "
        "DYNAMIC (as in Horovod): none until start_timeline() is called.",
        horovod="HOROVOD_TIMELINE",
        must_agree=False,
    )
    timeline_mark_cycles: bool = _knob(
        "MPIDP_TIMELINE_MARK_CYCLES",
        _parse_bool,
        False,
        "Also mark each engine cycle in the timeline.",
        horovod="HOROVOD_TIMELINE_MARK_CYCLES",
        must_agree=False,
    )
    backend: str = _knob(
        "MPIDP_BACKEND",
        _choice("auto", "mpi", "nccl", "gloo"),
        "auto",
        "Data path: mpi (host or CUDA-aware MPI), nccl or gloo (a torch.distributed process "
        "group bootstrapped over MPI); auto picks mpi for CPU tensors and nccl for CUDA ones "
        "when NCCL is available. Negotiation always runs on MPI.",
    )
    cuda_aware_mpi: str = _knob(
        "MPIDP_CUDA_AWARE_MPI",
        _choice("auto", "0", "1"),
        "auto",
        "Whether MPI may be handed CUDA device buffers: auto detects it from the MPI library; "
        "0 stages through pinned host buffers; 1 forces device buffers.",
    )
    hierarchical_allreduce: bool = _knob(
        "MPIDP_HIERARCHICAL_ALLREDUCE",
        _parse_bool,
        False,
        "Allreduce as reduce-scatter inside each node, allreduce across nodes, allgather "
        "inside the node (on host memory too). Unset, 16-bit floats on host memory go this "
        "way wherever there are several nodes of several ranks (MPICH runs their user-defined "
        "op in whole-buffer rounds that send twice the bytes over each node's link; "
        "BENCHMARKS.md) and every other dtype flat; 0 keeps everything flat.",
        horovod="HOROVOD_HIERARCHICAL_ALLREDUCE",
    )
    simulated_local_size: int = _knob(
        "MPIDP_SIMULATED_LOCAL_SIZE",
        _nonneg_int,
        0,
        "Test knob: group consecutive ranks into nodes of this many ranks instead of asking "
        "MPI which ranks share memory; 0: ask MPI.",
    )
    rendezvous_host: str = _knob(
        "MPIDP_RENDEZVOUS_HOST",
        _path,
        "",
        "Address rank 0 announces for the gloo/nccl process group's store; empty: rank 0's "
        "host name.",
    )
    autotune: bool = _knob(
        "MPIDP_AUTOTUNE",
        _parse_bool,
        False,
        "Tune the fusion thresholds and cycle time on live traffic (knobs set explicitly are "
        "left alone); rank 0 scores and decides, all ranks switch together.",
        horovod="HOROVOD_AUTOTUNE",
    )
    autotune_log: str = _knob(
        "MPIDP_AUTOTUNE_LOG",
        _path,
        "",
        "Rank 0 appends one CSV line per autotune sample to this file; empty: no log.",
        horovod="HOROVOD_AUTOTUNE_LOG",
        must_agree=False,
    )
    autotune_warmup_samples: int = _knob(
        "MPIDP_AUTOTUNE_WARMUP_SAMPLES",
        _nonneg_int,
        1,
        "Autotune drops this many samples after each switch before scoring the new setting "
        "(the old setting's backlog drains, buffers regrow).",
        horovod="HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
        must_agree=False,
    )
    autotune_samples_per_point: int = _knob(
        "MPIDP_AUTOTUNE_SAMPLES_PER_POINT",
        _pos_int,
        3,
        "Autotune scores a setting by the median of this many samples, which a noisy "
        "neighbour moves less than a mean.",
        must_agree=False,
    )
    autotune_sample_s: float = _knob(
        "MPIDP_AUTOTUNE_SAMPLE_S",
        _nonneg_float,
        0.5,
        "Seconds of traffic in one autotune sample (bytes reduced per second over it); long "
        "enough to hold several training steps.",
        must_agree=False,
    )
    elastic_checkpoint: str = _knob(
        "MPIDP_ELASTIC_CHECKPOINT",
        _path,
        "",
        "mpidp.elastic states persist each commit() to this file (rank 0's path counts) and "
        "elastic.run resumes from it when the job is restarted; empty: in-memory commits "
        "only. A state's checkpoint_path= argument overrides it.",
        must_agree=False,
    )
    explicit: FrozenSet[str] = frozenset()

    def agreed_items(self) -> Tuple[Tuple[str, object], ...]:
        """The (field, value) pairs every rank must agree on."""
        return tuple((k.field, getattr(self, k.field)) for k in KNOBS if k.must_agree)


# The knobs in the order of Config's fields, each read from its field's default and metadata.
KNOBS: Tuple[Knob, ...] = tuple(
    Knob(f.name, default=f.default, **f.metadata[_KNOB])
    for f in dataclasses.fields(Config)
    if _KNOB in f.metadata
)
_BY_FIELD: Dict[str, Knob] = {k.field: k for k in KNOBS}


def read_env(knob: Knob, env: Mapping[str, str]):
    """(variable, value) of the first of the knob's variables set in `env`, or (None, None)."""
    for var in (knob.env, knob.horovod):
        if var and var in env:
            return var, env[var]
    return None, None


def load(env: Optional[Mapping[str, str]] = None, **overrides) -> Config:
    """Build a Config from MPIDP_* (or HOROVOD_* alias) variables, then keyword overrides.

    A malformed value raises ConfigError naming the variable, the value and what is accepted.
    """
    env = os.environ if env is None else env
    values: Dict[str, Any] = {}
    explicit = set()
    for knob in KNOBS:
        var, raw = read_env(knob, env)
        if var is None:
            values[knob.field] = knob.default
            continue
        try:
            values[knob.field] = knob.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{var}={raw!r} is not valid: {exc}. {knob.doc}") from None
        explicit.add(knob.field)
    for field, value in overrides.items():
        if field not in _BY_FIELD:
            raise ConfigError(f"unknown mpidp knob {field!r}; known: {sorted(_BY_FIELD)}")
        knob = _BY_FIELD[field]
        try:
            values[field] = knob.parse(str(value))
        except ValueError as exc:
            raise ConfigError(f"{field}={value!r} is not valid: {exc}. {knob.doc}") from None
        explicit.add(field)
    try:  # horovodrun --no-stall-check's variable: both stall knobs 0 unless set themselves
        if _parse_bool(env.get(STALL_CHECK_DISABLE, "0")):
            values.update(
                {f: 0.0 for f in ("stall_warning_s", "stall_shutdown_s") if f not in explicit}
            )
    except ValueError as exc:
        raise ConfigError(f"{STALL_CHECK_DISABLE}={env[STALL_CHECK_DISABLE]!r}: {exc}") from None
    return Config(explicit=frozenset(explicit), **values)


STALL_CHECK_DISABLE = "HOROVOD_STALL_CHECK_DISABLE"  # 1: no stall warning or shutdown
# Variables of ours that are not knobs: the Slurm batch scripts in examples/slurm read them.
SCRIPT_VARIABLES = ("MPIDP_VENV", "MPIDP_PYTHON", "MPIDP_TRAIN", "MPIDP_MPIRUN")


# Variables that MPI launchers (MPICH hydra, Open MPI, PMIx) and Slurm set for each rank. mpidp
# reads them where MPI cannot answer: before init(), or when the ranks failed to find each other.
LAUNCHER_RANK_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")
LAUNCHER_SIZE_VARIABLES = (
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "PMI_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_SIZE",
    "MPI_LOCALNRANKS",
)
# A process started from a rank that must not join its job (a fresh singleton, or a job of its
# own) drops every variable with these prefixes: MPI would otherwise try to join the old job, and
# srun a surrounding allocation. MPIR_ (MPICH's) and OMPI_MCA_ settings were chosen for the job.
LAUNCHER_PREFIXES = (
    "PMI_",
    "PMIX_",
    "HYDRA_",
    "MPIR_",
    "OMPI_",
    "MPI_LOCAL",
    "SLURM_",
    "SBATCH_",
    "SRUN_",
    "SALLOC_",
)


def launcher_rank(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """This process's rank as its launcher announced it, read without MPI; None outside one."""
    env = os.environ if env is None else env
    for var in LAUNCHER_RANK_VARIABLES:
        value = env.get(var, "")
        if value.isdigit():
            return int(value)
    # srun without an MPI plugin starts each task as a world of its own, still one task of the
    # job; outside a step (in the batch script itself) SLURM_PROCID says nothing.
    if env.get("SLURM_STEP_ID") and env.get("SLURM_PROCID", "").isdigit():
        return int(env["SLURM_PROCID"])
    return None
