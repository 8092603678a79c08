"""Launch mpiexec from a test: the venv's hydra, a hard timeout, and captured output."""

import errno
import glob
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else (shutil.which("mpiexec") or "mpiexec")


class Result:
    """What a launch returned: exit code, output, wall time."""

    def __init__(self, proc: subprocess.CompletedProcess, seconds: float):
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.seconds = seconds

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run(n: int, script, *args, env=None, timeout: float = 120, mpi_args=()) -> Result:
    """Run `python script args` on n ranks; kill the job (and fail) after `timeout` seconds."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    cmd = [mpiexec(), "-n", str(n), *mpi_args, sys.executable, str(script), *map(str, args)]
    start = time.monotonic()
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=str(ROOT),
        stdin=subprocess.DEVNULL,
    )
    return Result(proc, time.monotonic() - start)


SHM_GLOB = "/dev/shm/mpich_shm_*"


def shm_files() -> set:
    """MPICH's shared-memory segments present now."""
    return set(glob.glob(SHM_GLOB))


def clean_shm(before: set) -> list:
    """Remove segments that appeared since `before`, belong to us and no live process maps.

    A job killed by a signal never unlinks its segment; left alone they fill /dev/shm.
    """
    new = shm_files() - before
    if not new:
        return []
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(
                    line.split(None, 5)[-1].strip() for line in f if "/dev/shm/mpich_shm_" in line
                )
        except OSError:
            pass
    removed = []
    for path in sorted(new - mapped):
        try:
            if os.stat(path).st_uid == os.getuid():
                os.unlink(path)
                removed.append(path)
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise
    return removed
