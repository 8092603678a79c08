"""Launch mpiexec from a test: the venv's hydra, a hard timeout, and captured output."""

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
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout,
                          cwd=str(ROOT), stdin=subprocess.DEVNULL)
    return Result(proc, time.monotonic() - start)
