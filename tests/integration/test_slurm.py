"""The batch scripts in examples/slurm/, submitted for real to a single-node Slurm on localhost.

The module's fixture installs Slurm if it is missing (root with apt-get), configures and starts
munged, slurmctld and slurmd, and stops them at the end (tests/integration/slurm_cluster.py).
Where Slurm cannot be had (not root, no apt-get) the module is skipped, except under CI=true,
where that is a failure.

Jobs are submitted from the repository root with a PATH that does not hold the venv, so the
scripts must find .venv themselves (from $SLURM_SUBMIT_DIR), as they would for a user.
"""

import os
import re
import sys

import pytest

from mpidp.config import LAUNCHER_PREFIXES

from .cluster_kit import start_or_skip
from .launch import ROOT
from .slurm_cluster import SlurmCluster

SLURM_DIR = ROOT / "examples" / "slurm"
TRAIN = ROOT / "examples" / "train.py"
DEMO = ROOT / "examples" / "engine_demo.py"
JOB_TIMEOUT = 300  # per `sbatch --wait`; the job is cancelled if it runs past this
# Under pytest-xdist the test clusters (Slurm daemons, namespace hosts) take turns on one worker.
pytestmark = pytest.mark.xdist_group("clusters")


@pytest.fixture(scope="module")
def slurm():
    cluster = start_or_skip(
        SlurmCluster(), "Slurm to test the batch scripts with", timeout=60, lock_timeout=300
    )
    yield cluster
    cluster.stop()  # raises if a daemon it started is still running


def job_env(**extra):
    """The test's environment without the venv in PATH and without launcher or pytest variables
    (the job's pytest must not inherit PYTEST_ADDOPTS, nor srun a surrounding job's SLURM_*)."""
    drop_prefixes = LAUNCHER_PREFIXES + ("PYTEST_",)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(drop_prefixes) and k not in ("VIRTUAL_ENV", "PYTHONPATH")
    }
    venv_bins = {
        os.path.realpath(ROOT / ".venv" / "bin"),
        os.path.realpath(os.path.dirname(sys.executable)),
    }
    env["PATH"] = os.pathsep.join(
        p
        for p in env.get("PATH", "/usr/bin:/bin").split(os.pathsep)
        if p and os.path.realpath(p) not in venv_bins
    )
    if not (ROOT / ".venv" / "bin" / "python").exists():
        env["MPIDP_PYTHON"] = sys.executable  # a venv elsewhere: tell the scripts where
    env.update(extra)
    return env


def submit(cluster, script, *args, tmp_path, sbatch_args=(), env=None, separate_error=False):
    job = cluster.sbatch(
        script,
        *args,
        out_dir=tmp_path,
        sbatch_args=sbatch_args,
        env=env or job_env(),
        timeout=JOB_TIMEOUT,
        separate_error=separate_error,
    )
    print(
        f"{os.path.basename(str(script))}: job {job.job_id}, rc={job.returncode}, "
        f"{job.seconds:.1f}s"
    )
    assert job.job_id is not None, job
    # With a job purged before sbatch looked again, `sbatch --wait` says so and exits 0.
    assert "no longer found" not in job.sbatch_output, job
    return job


def training_job():
    """examples/train.py (2 epochs) once it exists, else the engine demo; with the line that rank
    0, and only rank 0, prints at the end."""
    if TRAIN.exists():
        return TRAIN, "final test accuracy:"
    return DEMO, "mpidp engine demo: 2 ranks"


def training_args(script, tmp_path):
    if script != TRAIN:
        return ()
    args = ["--epochs", "2"]
    if "--checkpoint" in TRAIN.read_text():  # keep its checkpoint out of the repository
        args += ["--checkpoint", str(tmp_path / "checkpoint.pt")]
    return args


@pytest.mark.parametrize("script", ["train_srun.sbatch", "train_mpirun.sbatch"])
def test_training_job(slurm, tmp_path, script):
    program, final = training_job()
    extra = {} if program == TRAIN else {"MPIDP_TRAIN": str(program.relative_to(ROOT))}
    job = submit(
        slurm,
        SLURM_DIR / script,
        *training_args(program, tmp_path),
        tmp_path=tmp_path,
        env=job_env(**extra),
    )
    assert job.returncode == 0, job
    lines = [line for line in job.output.splitlines() if line.startswith(final)]
    # Exactly one: in a world of size 1 per task, every task would be "rank 0" and print it.
    assert len(lines) == 1, job


def test_lightning_job_under_srun(slurm, tmp_path):
    """A Lightning Trainer whose DDP runs over backend "mpidp", its 2 ranks started by srun
    (train_srun.sbatch with MPIDP_TRAIN): Lightning sees SLURM_NTASKS, and the example hands it
    MPI's ranks, so the two ranks train one model (the loss line once, from rank 0 of 2)."""
    example = "examples/torch_distributed/lightning_ddp.py"
    job = submit(
        slurm,
        SLURM_DIR / "train_srun.sbatch",
        "--epochs",
        "2",
        tmp_path=tmp_path,
        env=job_env(MPIDP_TRAIN=example),
    )
    assert job.returncode == 0, job
    losses = re.findall(r"lightning_ddp: loss ([0-9.]+) -> ([0-9.]+) on (\d+) rank", job.output)
    assert len(losses) == 1, job  # rank 0 alone: one world of 2, not two worlds of 1
    before, after, ranks = losses[0]
    assert ranks == "2" and float(after) < float(before), job
    assert "distributed_backend=mpidp" in job.output, job


def test_pytest_job_with_more_ranks_than_cpus(slurm, tmp_path):
    """pytest.sbatch at 3 ranks on the 2-CPU node, which needs --overcommit (-O)."""
    job = submit(
        slurm,
        SLURM_DIR / "pytest.sbatch",
        "tests/mpi/test_lifecycle.py",
        tmp_path=tmp_path,
        sbatch_args=["-n", "3", "-O"],
    )
    assert job.returncode == 0, job
    closing = re.findall(r"^=+ (.*\bin [0-9.]+s.*) =+$", job.output, re.M)
    assert len(closing) == 3, job  # one per rank
    for line in closing:
        assert "passed" in line and "failed" not in line and "error" not in line, job
    # pytest-mpi's report: each rank saw a world of 3, not of 1.
    assert sorted(re.findall(r"^size: (\d+)$", job.output, re.M)) == ["3"] * 3, job


def test_srun_without_pmi2_runs_lonely_worlds_and_mpidp_says_so(slurm, tmp_path):
    script = tmp_path / "lonely.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --ntasks=2\n"
        f"srun --mpi=none -n 2 {sys.executable} -c "
        "'import mpidp; mpidp.init(); print(mpidp.size())'\n"
    )
    job = submit(slurm, script, tmp_path=tmp_path, separate_error=True)
    assert job.returncode == 0, job
    assert job.output.split() == ["1", "1"], job
    warning = "MPI reports a world of size 1, but SLURM_NTASKS=2"
    assert job.error.count(warning) == 2, job
    assert "--mpi=pmi2" in job.error, job


def test_python_override_is_used(slurm, tmp_path):
    """MPIDP_PYTHON replaces the venv's interpreter; a wrong one fails at once, saying why."""
    job = submit(
        slurm,
        SLURM_DIR / "train_srun.sbatch",
        tmp_path=tmp_path,
        env=job_env(MPIDP_PYTHON="/nonexistent/python"),
    )
    assert job.returncode == 2, job
    assert "no Python at /nonexistent/python" in job.output, job
