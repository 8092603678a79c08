"""`mpidprun`: horovodrun's command line translated into an mpiexec command (MPICH or Open MPI)."""

import os
import shlex
import shutil
import subprocess
import sys
from types import SimpleNamespace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from . import launcher_flags as flags
from .launcher_flags import UsageError, parse_hosts, read_hostfile


class LaunchError(Exception):
    """No usable mpiexec here (exit code 1)."""


def usage() -> str:
    """The --help text: every flag, its value and what it sets."""
    lines = [
        "usage: mpidprun -np N [options] command [args...]",
        "Runs the command on N ranks through mpiexec (MPICH or Open MPI, detected).",
        "",
    ]
    for names, _dest, _kind, metavar, text in flags.FLAGS:
        lines.append(f"  {', '.join(names) + (' ' + metavar if metavar else ''):<44} {text}")
    return "\n".join(lines)


def _number(flag: str, kind, text: str):
    try:
        value = kind(text)
    except ValueError:
        raise UsageError(
            f"{flag} takes {'an integer' if kind is int else 'a number'}, not "
            f"{text!r}: write for example {flag} 2"
        ) from None
    if not value >= flags.MINIMUM.get(flag, 0):  # also catches nan
        raise UsageError(f"{flag} must be >= {flags.MINIMUM.get(flag, 0)}, not {text}")
    return value


def parse_args(argv: Sequence[str]) -> SimpleNamespace:
    """horovodrun-style arguments -> namespace: options first, then the command (or after `--`).

    Raises UsageError naming the offending flag. Sets `help`/`version` when asked; prints nothing.
    """
    args = SimpleNamespace(
        **{f[1]: None for f in flags.FLAGS if f[1]}, command=[], help=False, version=False
    )
    args.verbose = args.check_build = False
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--" or not token.startswith("-") or token == "-":
            args.command = list(argv[i + (token == "--") :])
            break
        name, eq, value = token.partition("=")
        if name not in flags.BY_NAME:
            raise UsageError(
                f"unknown option {name!r}: "
                + flags.UNSUPPORTED.get(
                    name,
                    "mpidprun takes horovodrun's options (mpidprun --help lists them); "
                    "mpiexec's own options go in --mpi-args='...'; the command starts at the "
                    "first word that is not an option",
                )
            )
        _names, dest, kind, metavar, _help = flags.BY_NAME[name]
        if kind in ("help", "version"):
            setattr(args, kind, True)
            return args
        i += 1
        if kind in (True, False, "noop"):
            if eq:
                raise UsageError(f"{name} takes no value: write {name} alone")
            if kind != "noop":
                setattr(args, dest, kind)
            continue
        if not eq:
            if i >= len(argv):
                raise UsageError(f"{name} needs a value: write {name} {metavar}")
            value, i = argv[i], i + 1
        setattr(args, dest, value if kind is str else _number(name, kind, value))
    if args.check_build:
        return args
    if args.num_proc is None:
        raise UsageError(
            "-np is required: write -np N for N ranks, e.g. mpidprun -np 2 python train.py"
        )
    checks = (
        (
            not args.command,
            "no command to run: write it after the options, e.g. mpidprun -np 2 python train.py",
        ),
        (
            args.hosts is not None and args.hostfile is not None,
            "-H and --hostfile both name the hosts: give one of them",
        ),
        (
            args.no_stall_check and (args.stall_warning, args.stall_shutdown) != (None, None),
            "--no-stall-check turns the stall check off, so --stall-check-*-time-seconds with it "
            "mean nothing: keep one or the other",
        ),
        (
            args.log_level is not None and args.log_level.upper() not in flags.LOG_LEVELS,
            f"--log-level {args.log_level!r} is not a level: write one of "
            f"{', '.join(flags.LOG_LEVELS)}",
        ),
    )
    for bad, message in checks:
        if bad:
            raise UsageError(message)
    return args


def knob_env(args) -> Dict[str, str]:
    """The MPIDP_* variables that the knob flags set, each checked by mpidp.config's parser."""
    values = {dest: getattr(args, dest) for dest in flags.KNOB_FLAGS}
    if args.no_stall_check:
        values.update(stall_warning=0, stall_shutdown=0)
    env = {}
    for dest, value in values.items():
        if value is None:
            continue
        field, convert = flags.KNOB_FLAGS[dest]
        knob, text = flags.KNOB_BY_FIELD[field], str(convert(value))
        try:
            knob.parse(text)
        except ValueError as exc:
            raise UsageError(
                f"{flags.NAME_OF[dest]} {value}: {knob.env}={text!r} is not valid for mpidp: {exc}"
            ) from None
        env[knob.env] = text
    return env


# Forwarded to Open MPI's ranks by name: Open MPI passes remote ranks only the variables named
# with -x (hydra passes everything), and these decide which Python, packages and knobs they get.
_FORWARD = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH")
_FORWARD_PREFIXES = ("MPIDP_", "HOROVOD_")


def build_command(
    args,
    flavor: str,
    mpiexec: str = "mpiexec",
    environ: Optional[Mapping[str, str]] = None,
    as_root: bool = False,
) -> Tuple[List[str], Dict[str, str]]:
    """The mpiexec argv for parsed `args`, and variables to add to mpiexec's own environment.

    flavor: "mpich" (hydra: -n, -hosts, -genv) or "openmpi" (-np, -H, -x). environ: the
    launching environment (default os.environ). as_root adds Open MPI's --allow-run-as-root,
    as horovodrun does.
    """
    environ = os.environ if environ is None else environ
    hosts = (
        parse_hosts(args.hosts)
        if args.hosts is not None
        else read_hostfile(args.hostfile)
        if args.hostfile is not None
        else None
    )
    if hosts and sum(slots for _, slots in hosts) < args.num_proc:
        where = "-H" if args.hosts is not None else f"--hostfile {args.hostfile}"
        raise UsageError(
            f"-np {args.num_proc} asks for more ranks than the "
            f"{sum(slots for _, slots in hosts)} slots {where} gives "
            f"({','.join(f'{h}:{s}' for h, s in hosts)}); give more slots or "
            f"fewer ranks (horovodrun refuses this too)"
        )
    rank_env, launch_env = knob_env(args), {}
    ssh = f"-o ConnectTimeout={args.start_timeout}" if args.start_timeout else ""
    if flavor == "mpich":
        cmd = [mpiexec, "-n", str(args.num_proc)]
        cmd += ["-hosts", ",".join(f"{h}:{s}" for h, s in hosts)] if hosts else []
        cmd += [a for name, value in rank_env.items() for a in ("-genv", name, value)]
        if ssh:  # hydra appends this to each ssh command; keep what the user set there already
            launch_env["HYDRA_LAUNCHER_EXTRA_ARGS"] = " ".join(
                filter(None, (environ.get("HYDRA_LAUNCHER_EXTRA_ARGS"), ssh))
            )
    elif flavor == "openmpi":
        # Without -H, Open MPI allows one rank per core; horovodrun gives localhost N slots.
        spec = ",".join(f"{h}:{s}" for h, s in hosts or [("localhost", args.num_proc)])
        cmd = [
            mpiexec,
            "-np",
            str(args.num_proc),
            "-H",
            spec,
            "--bind-to",
            "none",
            "--map-by",
            "slot",
        ]
        cmd += ["--allow-run-as-root"] if as_root else []
        cmd += ["--mca", "plm_rsh_args", ssh] if ssh else []
        cmd += [a for name, value in rank_env.items() for a in ("-x", f"{name}={value}")]
        cmd += [
            a
            for name in sorted(environ)
            if name not in rank_env and (name in _FORWARD or name.startswith(_FORWARD_PREFIXES))
            for a in ("-x", name)
        ]
    else:
        raise ValueError(f"unknown MPI flavor {flavor!r}: expected 'mpich' or 'openmpi'")
    try:
        extra = shlex.split(args.mpi_args or "")
    except ValueError as exc:
        raise UsageError(f"--mpi-args {args.mpi_args!r}: {exc}") from None
    return cmd + extra + list(args.command), launch_env


def find_mpiexec(environ: Optional[Mapping[str, str]] = None) -> str:
    """The mpiexec beside this Python (a venv's mpich wheel), else the first one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("mpiexec", path=(os.environ if environ is None else environ).get("PATH"))
    if not found:
        raise LaunchError(
            f"no mpiexec next to {sys.executable} or on PATH: pip install "
            f"'mpidp[mpich]', or put your MPI's bin/ on PATH"
        )
    return found


def flavor_of(version_text: str) -> Optional[str]:
    """ "mpich" or "openmpi" from `mpiexec --version` output; None if it is neither."""
    if "Open MPI" in version_text or "OpenRTE" in version_text:
        return "openmpi"
    if any(mark in version_text for mark in ("HYDRA", "MPICH", "Intel(R) MPI")):
        return "mpich"  # hydra, MPICH's or Intel MPI's: the same options
    return None


def detect_flavor(mpiexec: str) -> str:
    """Run `mpiexec --version` and say which launcher it is; LaunchError if unknown."""
    try:
        proc = subprocess.run(
            [mpiexec, "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"cannot run {mpiexec} --version: {exc}") from None
    text = proc.stdout + proc.stderr
    flavor = flavor_of(text)
    if flavor is None:
        raise LaunchError(
            f"{mpiexec} is neither MPICH's nor Open MPI's mpiexec (--version "
            f"says {text.strip()[:200]!r}); launch with it directly"
        )
    return flavor


def check_build() -> str:
    """Horovod's --check-build report for mpidp: frameworks, controllers, tensor operations."""
    import torch

    from .. import __version__
    from ..runtime import topology

    def box(on):
        return "[X]" if on else "[ ]"

    try:
        nccl, gloo = topology.nccl_built(), topology.gloo_built()  # these load the MPI library
        mpi, mpi_note = topology.mpi_built(), ""
    except Exception as exc:  # noqa: BLE001 - a library that does not load is the finding
        nccl = gloo = mpi = False
        mpi_note = f" (cannot load the MPI library: {type(exc).__name__}: {exc})"
    try:
        mpiexec = find_mpiexec()
        launcher = f"{mpiexec} ({detect_flavor(mpiexec)})"
    except LaunchError as exc:
        launcher = f"none usable: {exc}"
    # Negotiation always runs over MPI, so gloo is a data path here, never a controller.
    return "\n".join(
        [
            f"mpidp v{__version__}:",
            "",
            "Available Frameworks:",
            "    [ ] TensorFlow",
            f"    [X] PyTorch ({torch.__version__})",
            "    [ ] MXNet",
            "",
            "Available Controllers:",
            f"    {box(mpi)} MPI{mpi_note}",
            "    [ ] Gloo",
            "",
            "Available Tensor Operations:",
            f"    {box(nccl)} NCCL",
            f"    {box(topology.ddl_built())} DDL",
            f"    {box(topology.ccl_built())} CCL",
            f"    {box(mpi)} MPI",
            f"    {box(gloo)} Gloo",
            "",
            f"Launcher: {launcher}",
        ]
    )


def format_command(cmd: Sequence[str], launch_env: Mapping[str, str]) -> str:
    """One shell line that runs `cmd` with `launch_env` added: what --verbose prints."""
    return " ".join(
        [f"{k}={shlex.quote(v)}" for k, v in launch_env.items()] + [shlex.quote(a) for a in cmd]
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The `mpidprun` command: replaces this process with mpiexec, whose exit code is the job's.

    Returns only when it launches nothing: 0 after --help, --version or --check-build, 2 for a
    bad command line, 1 when no usable mpiexec is found or it cannot be started.
    """
    try:
        args = parse_args(sys.argv[1:] if argv is None else list(argv))
        if args.help or args.version or args.check_build:
            from .. import __version__

            print(
                usage()
                if args.help
                else check_build()
                if args.check_build
                else f"mpidprun (mpidp) {__version__}"
            )
            return 0
        mpiexec = find_mpiexec()
        cmd, launch_env = build_command(
            args, detect_flavor(mpiexec), mpiexec, as_root=os.geteuid() == 0
        )
    except (UsageError, LaunchError) as exc:
        print(f"mpidprun: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1
    if args.verbose:
        print(format_command(cmd, launch_env), file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(cmd[0], cmd, {**os.environ, **launch_env})
    except OSError as exc:
        print(f"mpidprun: error: cannot run {cmd[0]}: {exc.strerror}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
