"""What the test clusters are built with: commands, waits, processes, packages, locks, skip reasons.

slurm_cluster.py (Slurm's daemons) and multihost_cluster.py (namespace hosts with sshd) share:

- `run` a short command (output through a file, a timeout, an error that quotes the command and
  what it said); `run_group` a long one in its own process group, killed whole on timeout.
- `wait_until` / `wait_while` a condition, with a deadline.
- /proc: `alive`, `daemon_pids`, `read_pid`, `cmdline`, `descendants`, `kill_all`, `tail` a log.
- `which` (sbin included), `is_root`, `install` missing packages with apt-get.
- `SessionLock`: one test session at a time per cluster, and the shared memory its jobs leave.
- `Unavailable` (the cluster cannot be had here: skip, or fail under CI=true, `skip_or_fail`) and
  `ClusterError` (it is there but broken: fail); `start_or_skip` turns them into a fixture's
  outcome.
"""

import fcntl
import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from .launch import ROOT, Result, clean_shm, shm_files

# Daemons live in sbin, which a non-login or non-root PATH may lack.
SEARCH_PATH = os.pathsep.join(
    [
        os.environ.get("PATH", ""),
        "/usr/local/sbin",
        "/usr/sbin",
        "/sbin",
        "/usr/local/bin",
        "/usr/bin",
        "/bin",
    ]
)
# The daemons get a plain environment, not the test's (venv first in PATH, pytest variables).
DAEMON_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/root",
}


class Unavailable(Exception):
    """A test cluster cannot be had here (not installed and not installable, not root, someone
    else's cluster running); the message says why. The caller skips (fails under CI=true)."""


class ClusterError(RuntimeError):
    """A test cluster did not start or stop cleanly; the message says what is left or broken."""


def skip_or_fail(what: str, error) -> None:
    """Skip with `what` and the reason; under CI=true, where it must work (CI has root), fail
    instead."""
    if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
        pytest.fail(f"CI=true but {what} cannot be had here: {error}")
    pytest.skip(f"{what} cannot be had here: {error}")


def start_or_skip(cluster, what: str, **start_args):
    """`cluster.start(**start_args)` for a test module's fixture: skips the module (fails it under
    CI=true) when the cluster cannot be had here, fails it when it does not start."""
    try:
        cluster.start(**start_args)
    except Unavailable as e:
        skip_or_fail(what, e)
    except ClusterError as e:
        pytest.fail(f"{what}: the cluster did not start: {e}")
    return cluster


# -- commands ------------------------------------------------------------------------------------


def which(name):
    return shutil.which(name, path=SEARCH_PATH)


def is_root():
    return os.geteuid() == 0


def _show(cmd):
    return " ".join(map(str, cmd))


def run(cmd, timeout=30, env=None, check=False, error=ClusterError):
    """Run a short command; return (exit code, stdout and stderr together). Output goes through a
    file, not a pipe, because daemons the command starts fork into the background and could hold a
    pipe open (and us waiting on it). With `check` a non-zero exit raises `error`; running past
    `timeout` seconds always does, with what the command said so far."""
    with tempfile.TemporaryFile(mode="w+") as out:
        try:
            proc = subprocess.run(
                [str(c) for c in cmd],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            out.seek(0)
            raise error(
                f"{_show(cmd)} did not finish within {timeout}s; its output:\n{out.read()}"
            ) from None
        out.seek(0)
        text = out.read()
    if check and proc.returncode != 0:
        raise error(f"{_show(cmd)} exited {proc.returncode}:\n{text.strip()}")
    return proc.returncode, text


def run_group(cmd, timeout=120, env=None, cwd=ROOT):
    """Run `cmd` (mpiexec, sbatch --wait, ...) from `cwd` in its own process group and return its
    Result; on timeout kill the whole group (mpiexec and its ssh clients, say) and re-raise
    TimeoutExpired."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=str(cwd),
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except OSError:
                pass
            try:
                proc.communicate(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        raise
    return Result(
        subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.monotonic() - start
    )


# -- waits ---------------------------------------------------------------------------------------


def wait_while(probe, timeout, interval=0.2):
    """Call `probe` until it returns something false or `timeout` seconds have passed; return its
    last value (false: what it waited for happened)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if not value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def wait_until(predicate, timeout, interval=0.2):
    """Whether `predicate()` became true within `timeout` seconds (asked every `interval`)."""
    return not wait_while(lambda: not predicate(), timeout, interval)


# -- processes -----------------------------------------------------------------------------------


def _stat(pid):
    """The fields of /proc/PID/stat after the command name (state, parent, ...); [] if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def alive(pid):
    """Whether process `pid` exists and is not a zombie."""
    return _stat(pid)[:1] not in ([], ["Z"], ["X"])


def _pids():
    return [int(path.split("/")[2]) for path in glob.glob("/proc/[0-9]*")]


def daemon_pids(name):
    """Live (not zombie) processes whose command name is `name`, from /proc."""
    found = []
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() != name:
                    continue
        except OSError:
            continue
        if alive(pid):
            found.append(pid)
    return sorted(found)


def read_pid(path):
    """The live process whose pid file is `path`, or None."""
    try:
        with open(path) as f:
            pid = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if alive(pid) else None


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "(gone)"


def descendants(pids):
    """`pids` and every process below them, sorted."""
    parent = {}
    for pid in _pids():
        fields = _stat(pid)
        if len(fields) > 1 and fields[1].isdigit():
            parent[pid] = int(fields[1])
    found, grew = set(pids), True
    while grew:
        more = {p for p, pp in parent.items() if pp in found} - found
        found |= more
        grew = bool(more)
    return sorted(found)


def kill_all(pids, sig=signal.SIGKILL, timeout=5.0):
    """Send `sig` to `pids`; whether they were all gone within `timeout` seconds."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    return not wait_while(lambda: any(alive(p) for p in pids), timeout, 0.05)


def tail(path, lines=40):
    """The last `lines` lines of a log, or why it cannot be read."""
    try:
        with open(path, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-lines:])
    except OSError as e:
        return f"({path}: {e.strerror})"


# -- packages ------------------------------------------------------------------------------------


def install(packages, missing, attempts=3, timeout=600):
    """As root, apt-get install `packages` quietly, retried, until `missing()` (the programs still
    missing) is empty; Unavailable if that cannot be done."""
    if not is_root():
        raise Unavailable(
            f"{', '.join(missing())} missing, and we are not root, so cannot "
            f"install them (as root: apt-get install {' '.join(packages)})"
        )
    apt = which("apt-get")
    if apt is None:
        raise Unavailable(
            f"{', '.join(missing())} missing, and there is no apt-get to install "
            f"{' '.join(packages)} with"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    log = ""
    for attempt in range(1, attempts + 1):
        try:
            up = subprocess.run(
                [apt, "-qq", "update"],
                capture_output=True,
                text=True,
                env=env,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
            inst = subprocess.run(
                [apt, "install", "-y", "-qq", "--no-install-recommends", *packages],
                capture_output=True,
                text=True,
                env=env,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
            log = up.stdout + up.stderr + inst.stdout + inst.stderr
            if inst.returncode == 0 and not missing():
                return
        except subprocess.TimeoutExpired as e:
            log = f"timed out after {timeout}s: {e.cmd}"
        if attempt < attempts:
            time.sleep(5 * attempt)
    raise Unavailable(
        f"apt-get install {' '.join(packages)} failed {attempts} times; last output:\n{log[-3000:]}"
    )


# -- one session at a time -----------------------------------------------------------------------


class SessionLock:
    """Held from a cluster's start() to its stop(): two test sessions on one machine would
    otherwise tear down each other's cluster (the kernel drops the flock if the holder dies). At
    release(), the MPICH shared-memory segments that appeared since acquire() and that no process
    maps are removed (a job killed by a signal leaves its segment)."""

    def __init__(self, path, log):
        self.path = path
        self._log = log
        self._fd = None
        self._shm_before = set()

    def acquire(self, timeout):
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        said = []

        def busy():
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return False
            except BlockingIOError:
                if not said:
                    self._log("another test session is using the test cluster; waiting for it")
                    said.append(True)
                return True

        if wait_while(busy, timeout, 1.0):
            os.close(fd)
            raise Unavailable(
                f"another test session has held {self.path} (its test cluster) "
                f"for more than {timeout}s"
            )
        self._fd = fd
        self._shm_before = shm_files()

    def release(self):
        if self._fd is None:
            return
        for path in clean_shm(self._shm_before):
            self._log(f"removed leftover {path}")
        os.close(self._fd)  # drops the flock
        self._fd = None
