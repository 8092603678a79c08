"""horovodrun's flags as mpidprun knows them: kinds, knobs they set, replacements; host lists."""

import re
from typing import Any, Callable, Dict, List, Tuple

from .. import config as _config

# (names, dest, kind, metavar, help). int/float/str take a value; True/False store that value;
# "noop" is accepted and changes nothing (horovodrun's cache and controller choice mean nothing
# here); "help"/"version" print and exit.
FLAGS = (
    (("-np", "--num-proc"), "num_proc", int, "N", "number of ranks to start (required)"),
    (("-H", "--hosts"), "hosts", str, "H:S,..", "hosts and slots, e.g. node1:4,node2:4"),
    (("-hostfile", "--hostfile"), "hostfile", str, "FILE", "'host slots=N' (or 'host:N') lines"),
    (("--verbose",), "verbose", True, None, "print the mpiexec command to stderr, then run it"),
    (("--start-timeout",), "start_timeout", int, "S", "ssh ConnectTimeout for remote hosts"),
    (("--mpi-args",), "mpi_args", str, "'ARGS'", "more mpiexec options, one quoted string"),
    (("--fusion-threshold-mb",), "fusion_threshold_mb", int, "MB", "MPIDP_FUSION_THRESHOLD_BYTES"),
    (("--cycle-time-ms",), "cycle_time_ms", float, "MS", "MPIDP_CYCLE_TIME_MS"),
    (("--cache-capacity",), "cache_capacity", int, "N", "MPIDP_CACHE_CAPACITY"),
    (("--hierarchical-allreduce",), "hierarchical", True, None, "MPIDP_HIERARCHICAL_ALLREDUCE=1"),
    (
        ("--no-hierarchical-allreduce",),
        "hierarchical",
        False,
        None,
        "MPIDP_HIERARCHICAL_ALLREDUCE=0",
    ),
    (("--autotune",), "autotune", True, None, "MPIDP_AUTOTUNE=1"),
    (("--no-autotune",), "autotune", False, None, "MPIDP_AUTOTUNE=0"),
    (("--autotune-log-file",), "autotune_log_file", str, "FILE", "MPIDP_AUTOTUNE_LOG"),
    (("--autotune-warmup-samples",), "autotune_warmup", int, "N", "MPIDP_AUTOTUNE_WARMUP_SAMPLES"),
    (("--timeline-filename",), "timeline_filename", str, "FILE", "MPIDP_TIMELINE"),
    (("--timeline-mark-cycles",), "mark_cycles", True, None, "MPIDP_TIMELINE_MARK_CYCLES=1"),
    (("--no-stall-check",), "no_stall_check", True, None, "MPIDP_STALL_{WARNING,SHUTDOWN}_S=0"),
    (("--stall-check-warning-time-seconds",), "stall_warning", int, "S", "MPIDP_STALL_WARNING_S"),
    (
        ("--stall-check-shutdown-time-seconds",),
        "stall_shutdown",
        int,
        "S",
        "MPIDP_STALL_SHUTDOWN_S",
    ),
    (("--log-level",), "log_level", str, "LEVEL", "MPIDP_LOG_LEVEL (TRACE ... FATAL)"),
    (("-cb", "--check-build"), "check_build", True, None, "show what mpidp can use, then exit"),
    (("--disable-cache", "--mpi"), "", "noop", None, "accepted, no effect"),
    (("-v", "--version"), "", "version", None, "print the version"),
    (("-h", "--help"), "", "help", None, "print this help"),
)
BY_NAME = {name: flag for flag in FLAGS for name in flag[0]}
NAME_OF = {flag[1]: flag[0][-1] for flag in FLAGS}

# Flag dest -> (mpidp knob field, value as the knob's variable holds it).
KNOB_FLAGS: Dict[str, Tuple[str, Callable[[Any], object]]] = {
    "fusion_threshold_mb": ("fusion_threshold_bytes", lambda mb: mb * _config.MiB),
    "cycle_time_ms": ("cycle_time_ms", repr),
    "cache_capacity": ("cache_capacity", str),
    "hierarchical": ("hierarchical_allreduce", int),
    "autotune": ("autotune", int),
    "autotune_log_file": ("autotune_log", str),
    "autotune_warmup": ("autotune_warmup_samples", str),
    "timeline_filename": ("timeline_path", str),
    "mark_cycles": ("timeline_mark_cycles", int),
    "stall_warning": ("stall_warning_s", str),
    "stall_shutdown": ("stall_shutdown_s", str),
    "log_level": ("log_level", str.lower),
}
KNOB_BY_FIELD = {k.field: k for k in _config.KNOBS}
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
MINIMUM = {"-np": 1, "--num-proc": 1, "--start-timeout": 1}  # other numbers: >= 0

UNSUPPORTED = {  # horovodrun flags with no mpidprun equivalent: what to do instead
    "--gloo": "mpidprun always launches with mpiexec and negotiates over MPI; to move tensors "
    "through gloo, set MPIDP_BACKEND=gloo in the environment",
    "--jsrun": "mpidprun launches with mpiexec only; under LSF, run jsrun yourself",
    "--mpi-threads-disable": "mpidp needs MPI_THREAD_SERIALIZED at least; set "
    "MPI4PY_RC_THREAD_LEVEL=serialized to give up MPI_THREAD_MULTIPLE",
    **dict.fromkeys(
        (
            "--min-np",
            "--max-np",
            "--host-discovery-script",
            "--slots-per-host",
            "--elastic-timeout",
            "--reset-limit",
            "--blacklist-cooldown-range",
        ),
        "mpidprun starts a fixed number of ranks (-np); an mpidp.elastic job "
        "resumes from MPIDP_ELASTIC_CHECKPOINT when started again",
    ),
    **dict.fromkeys(
        (
            "--autotune-steps-per-sample",
            "--autotune-bayes-opt-max-samples",
            "--autotune-gaussian-process-noise",
        ),
        "mpidp's autotune samples by time: set MPIDP_AUTOTUNE_SAMPLE_S and "
        "MPIDP_AUTOTUNE_SAMPLES_PER_POINT instead",
    ),
    **dict.fromkeys(
        (
            "--config-file",
            "--hierarchical-allgather",
            "--num-nccl-streams",
            "--thread-affinity",
            "--gloo-timeout-seconds",
            "--log-without-timestamp",
        ),
        "mpidp has no such setting (its knobs are in mpidp/config.py); drop it",
    ),
    **dict.fromkeys(
        ("-p", "--ssh-port", "-i", "--ssh-identity-file"),
        "put Port and IdentityFile for the hosts in ~/.ssh/config",
    ),
    **dict.fromkeys(
        (
            "--network-interface",
            "--network-interfaces",
            "--output-filename",
            "--prefix-output-with-timestamp",
            "--binding-args",
            "--tcp",
        ),
        "give your mpiexec's own option for it in --mpi-args='...' (for an "
        "interface, MPICH: -iface NIC; Open MPI: --mca btl_tcp_if_include NIC)",
    ),
}


class UsageError(Exception):
    """A bad command line; the message names the flag and what to write instead (exit code 2)."""


def parse_hosts(spec: str, where: str = "-H") -> List[Tuple[str, int]]:
    """`host1:2,host2:4` -> [("host1", 2), ("host2", 4)]; UsageError naming `where` if malformed."""
    hosts = []
    for item in spec.split(","):
        m = re.fullmatch(r"([\w.-]+):([0-9]+)", item.strip())
        if not m or int(m.group(2)) < 1:
            raise UsageError(
                f"{where}: {item.strip()!r} is not host:slots with slots >= 1; "
                f"write for example -H node1:4,node2:4"
            )
        hosts.append((m.group(1), int(m.group(2))))
    return hosts


def read_hostfile(path: str) -> List[Tuple[str, int]]:
    """Hosts of a hostfile: `host slots=N` lines (horovodrun, Open MPI) or `host:N` (MPICH)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise UsageError(f"--hostfile {path}: cannot read it ({exc.strerror})") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = [w[len("slots=") :] for w in words[1:] if w.startswith("slots=")]
        if not slots and ":" not in words[0]:
            raise UsageError(
                f"--hostfile {path} line {number}: {line.strip()!r} does not say "
                f"how many slots; write '{words[0]} slots=N'"
            )
        hosts += parse_hosts(
            f"{words[0]}:{slots[0]}" if slots else words[0], f"--hostfile {path} line {number}"
        )
    if not hosts:
        raise UsageError(f"--hostfile {path} names no host; write one 'host slots=N' a line")
    return hosts
