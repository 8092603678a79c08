"""`python -m mpidp doctor`: alone, under mpiexec (smoke test), with the problems it must catch."""

import os
import subprocess
import sys

import pytest

from .launch import ROOT, mpiexec, run


def _doctor(n, env=None, timeout=120):
    return run(n, "-m", "mpidp", "doctor", env=env, timeout=timeout)


def test_doctor_alone_passes_and_names_mpi_and_torch():
    import torch

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "mpidp", "doctor"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=str(ROOT),
        stdin=subprocess.DEVNULL,
    )
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MPI library: MPICH" in out, out
    assert f"torch: {torch.__version__}" in out, out
    assert "MPI thread level: multiple" in out, out
    assert "CUDA-aware MPI:" in out and "NCCL:" in out and "gloo:" in out, out
    assert "knobs: none set" in out, out
    assert "smoke test: skipped: one rank" in out, out
    assert out.rstrip().endswith("all checks passed"), out


def test_doctor_under_mpiexec_runs_the_smoke_test_and_only_rank_0_prints():
    res = _doctor(2, env={"MPIDP_CYCLE_TIME_MS": "0.5", "HOROVOD_CACHE_CAPACITY": "9"})
    out = res.stdout
    assert res.returncode == 0, res.output
    assert "world: 2 rank(s)" in out, out
    assert "smoke test: allreduce, allgather and broadcast correct on 2 ranks" in out, out
    # The knobs that are set, with the variable that set them and the parsed value.
    assert "MPIDP_CYCLE_TIME_MS='0.5' -> cycle_time_ms = 0.5" in out, out
    assert "HOROVOD_CACHE_CAPACITY='9' -> cache_capacity = 9" in out, out
    assert out.count("mpidp doctor (rank 0's view)") == 1, out
    assert out.count("all checks passed") == 1, out


def test_misspelled_knobs_are_named_by_init_once_and_by_doctor():
    env = {"MPIDP_FUSION_TRESHOLD_BYTES": "1024", "HOROVOD_GPU_OPERATIONS": "NCCL"}
    res = run(2, "-c", "import mpidp; mpidp.init(); mpidp.shutdown()", env=env)
    assert res.returncode == 0, res.output
    typo = (
        "MPIDP_FUSION_TRESHOLD_BYTES='1024' is not an mpidp knob, and ignored; did you mean "
        "MPIDP_FUSION_THRESHOLD_BYTES?"
    )
    assert res.output.count(typo) == 1, res.output  # once per job, not once per rank
    assert (
        res.output.count(
            "HOROVOD_GPU_OPERATIONS='NCCL' is a Horovod setting mpidp does not have; ignored"
        )
        == 1
    ), res.output
    doc = _doctor(2, env=env)
    assert doc.returncode == 0, doc.output  # a warning, not a failure
    assert f"[warn] unknown variable: {typo}" in doc.stdout, doc.output
    assert "knobs: none set" in doc.stdout, doc.output


def test_doctor_reports_a_malformed_knob_and_fails():
    res = _doctor(2, env={"MPIDP_FUSION_THRESHOLD_BYTES": "lots"})
    assert res.returncode != 0, res.output
    assert "Traceback" not in res.output, res.output
    assert "[FAIL] knobs: MPIDP_FUSION_THRESHOLD_BYTES='lots' is not valid" in res.stdout, (
        res.output
    )
    assert "problem(s) found" in res.stdout and "all checks passed" not in res.stdout


def test_doctor_reports_a_malformed_knob_on_another_rank():
    # Rank 1 alone holds the bad value (hydra's -env applies per executable block).
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [
        mpiexec(),
        "-n",
        "1",
        sys.executable,
        "-m",
        "mpidp",
        "doctor",
        ":",
        "-n",
        "1",
        "-env",
        "MPIDP_STALL_WARNING_S",
        "soon",
        sys.executable,
        "-m",
        "mpidp",
        "doctor",
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=str(ROOT),
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "[FAIL] init(): ConfigError: rank 1: MPIDP_STALL_WARNING_S='soon'" in proc.stdout, (
        proc.stdout + proc.stderr
    )


def test_doctor_reports_a_thread_level_too_low():
    res = _doctor(2, env={"MPI4PY_RC_THREAD_LEVEL": "single"})
    assert res.returncode != 0, res.output
    assert "Traceback" not in res.output, res.output
    assert "[FAIL] MPI thread level: 'single' is too low" in res.stdout, res.output
    assert "MPI4PY_RC_THREAD_LEVEL" in res.stdout, res.output


def test_doctor_reports_a_lonely_world():
    res = _doctor(1, env={"SLURM_NTASKS": "4"})
    assert res.returncode != 0, res.output
    assert "[FAIL] world: size 1, but SLURM_NTASKS=4" in res.stdout, res.output


def test_doctor_reports_a_backend_this_machine_cannot_run():
    import torch

    if torch.cuda.is_available():
        pytest.skip("NCCL may be usable on a machine with a GPU")
    res = _doctor(1, env={"MPIDP_BACKEND": "nccl"})
    assert res.returncode != 0, res.output
    assert "[FAIL] knobs: MPIDP_BACKEND=nccl, but NCCL is not available here" in res.stdout, (
        res.output
    )
