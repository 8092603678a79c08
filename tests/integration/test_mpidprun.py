"""`mpidprun` end to end: horovodrun flags in, a real mpiexec job out, its exit code passed back.

Each launch pays the start of the launcher and of 2 ranks, all importing torch (several seconds
on a loaded 2-core machine), so the jobs themselves are a few lines long.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from .launch import ROOT, mpiexec

pytestmark = pytest.mark.timeout(300)

JOB = """\
import sys
import torch
import mpidp

mpidp.init()
cfg = mpidp.runtime.world.state().config
total = mpidp.allreduce(torch.tensor([float(mpidp.rank() + 1)]), op=mpidp.Sum, name="mpidprun.sum")
print(f"rank {mpidp.rank()}/{mpidp.size()}: fusion={cfg.fusion_threshold_bytes} "
      f"cycle={cfg.cycle_time_ms} sum={total.item():g}", flush=True)
mpidp.shutdown()
sys.exit(int(sys.argv[1]))
"""


def _launcher():
    """The installed console script if this venv has it (make venv installs it), else the module."""
    script = Path(sys.executable).parent / "mpidprun"
    return [str(script)] if script.exists() else [sys.executable, "-m", "mpidp.tools.launcher"]


def _mpidprun(*args, timeout=180):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [*_launcher(), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=str(ROOT),
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(JOB)
    return path


def test_two_ranks_from_a_horovod_hostfile_with_knob_flags_and_verbose(job, tmp_path):
    timeline = tmp_path / "timeline.json"
    hostfile = ROOT / "hostfiles" / "localhost.openmpi"  # horovodrun's 'localhost slots=4'
    proc = _mpidprun(
        "--verbose",
        "--hostfile",
        hostfile,
        "-np",
        2,
        "--fusion-threshold-mb",
        3,
        "--cycle-time-ms",
        0.5,
        "--timeline-filename",
        timeline,
        sys.executable,
        job,
        0,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for rank in range(2):
        assert f"rank {rank}/2: fusion={3 * 1024 * 1024} cycle=0.5 sum=3" in proc.stdout, out
    # The first line on stderr is the command mpidprun ran, as a shell would split it.
    assert shlex.split(proc.stderr.splitlines()[0]) == [
        mpiexec(),
        "-n",
        "2",
        "-hosts",
        "localhost:4",
        "-genv",
        "MPIDP_FUSION_THRESHOLD_BYTES",
        str(3 * 1024 * 1024),
        "-genv",
        "MPIDP_CYCLE_TIME_MS",
        "0.5",
        "-genv",
        "MPIDP_TIMELINE",
        str(timeline),
        sys.executable,
        str(job),
        "0",
    ], out
    # The timeline knob reached rank 0, which wrote the op into it.
    assert "mpidprun.sum" in timeline.read_text(), out


def test_exit_code_of_the_job_is_passed_through(job):
    proc = _mpidprun("-np", 2, sys.executable, job, 3)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert "rank 0/2:" in proc.stdout and "rank 1/2:" in proc.stdout, out
    assert "mpidprun: error" not in out and "Traceback" not in out, out


def test_check_build_lists_what_is_there_and_launches_nothing():
    import torch.distributed as dist

    proc = _mpidprun("--check-build")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert out.startswith("mpidp v0.1.0:"), out
    assert "[X] PyTorch" in out and "[ ] TensorFlow" in out, out
    controllers = out.split("Available Controllers:")[1].split("Available Tensor Operations:")
    assert "[X] MPI" in controllers[0] and "[ ] Gloo" in controllers[0], out
    gloo = "[X]" if dist.is_available() and dist.is_gloo_available() else "[ ]"
    assert f"{gloo} Gloo" in controllers[1] and "[X] MPI" in controllers[1], out
    nccl = "[X]" if dist.is_available() and dist.is_nccl_available() else "[ ]"
    assert f"{nccl} NCCL" in controllers[1], out
    assert f"Launcher: {mpiexec()} (mpich)" in out, out


@pytest.mark.parametrize(
    "args, message",
    [
        (["-np", 0, sys.executable, "-c", "pass"], "-np must be >= 1, not 0"),
        (
            ["-np", 2, "-H", "localhost", sys.executable, "-c", "pass"],
            "-H: 'localhost' is not host:slots",
        ),
        (["-np", 2, "--gloo", sys.executable, "-c", "pass"], "MPIDP_BACKEND=gloo"),
    ],
)
def test_bad_input_exits_2_with_the_reason_and_starts_no_rank(args, message):
    proc = _mpidprun(*args, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "", proc.stdout
    assert proc.stderr.startswith("mpidprun: error: ") and message in proc.stderr, proc.stderr


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "mpidprun"
    if not script.exists():
        pytest.skip(f"{script} is not installed (pip install -e . installs it)")
    proc = subprocess.run(
        [str(script), "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "mpidprun (mpidp) 0.1.0", proc
