"""`make gpu-check` (tests/gpu_check.py): without a GPU it says so and runs nothing; its CPU twin
runs the same matrix, example and benchmark on host tensors and reports them in one table, here
with MPI brought from the mpich wheel as on a machine that has none and cannot download."""

import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

from .launch import ROOT

SCRIPT = ROOT / "tests" / "gpu_check.py"


def _run(*args, timeout, env=None):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env=env,
    )


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: make gpu-check runs")
def test_without_a_gpu_it_says_so_and_exits_0():
    res = _run(timeout=100)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no GPU here" in res.stdout, res.stdout
    assert "torch: " + torch.__version__ in res.stdout, res.stdout
    assert "| tests on" not in res.stdout, "it ran something"


@pytest.mark.timeout(400)
def test_cpu_twin_runs_matrix_example_and_benchmark_in_one_table(tmp_path):
    """With what `make gpu-wheels` fetches and --bring-mpich: the mpich wheel installed by the
    check into a temporary prefix whose mpiexec and libmpi every step then uses, and the
    example reading the digits from the .npz (as on a GPU image without scikit-learn)."""
    wheels = tmp_path / "wheels"
    subprocess.run(
        ["make", "-s", "gpu-wheels", f"WHL={wheels}"],
        cwd=str(ROOT),
        check=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    out = tmp_path / "report.md"
    res = _run(
        "--device",
        "cpu",
        "--quick",
        "--bring-mpich",
        "--out",
        str(out),
        timeout=300,
        env=dict(os.environ, MPIDP_WHEELS=str(wheels)),
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    report = out.read_text()
    brought = re.escape(tempfile.gettempdir()) + r"/mpidp-gpu-check-\w+/mpich/"
    assert re.search(r"\| found: mpiexec \| \| \| " + brought + r"bin/mpiexec", report), report
    assert re.search(r"\| found: MPI library file \| \| \| " + brought + r"lib/libmpi", report), (
        report
    )
    matrix = re.findall(
        r"\| tests on cpu, MPIDP_BACKEND=(\w+) \| (\d) \| ok \| (\d+) passed, "
        r"0 failed",
        report,
    )
    assert {(path, n) for path, n, _ in matrix} == {("mpi", "1"), ("mpi", "2"), ("gloo", "2")}, (
        report
    )
    assert all(int(passed) > 0 for _, _, passed in matrix), report
    accuracy = re.search(
        r"examples/train.py --device cpu, \d+ epochs \| 2 \| ok \| final test "
        r"accuracy ([0-9.]+), exit 0, digits from " + re.escape(str(wheels)),
        report,
    )
    assert accuracy and float(accuracy.group(1)) > 0.5, report
    steps = re.findall(
        r"step, mpidp over (\w+) vs DDP \(gloo\) \| 2 \| ok \| no comm ([0-9.]+) "
        r"ms, mpidp ([0-9.]+) ms",
        report,
    )
    assert [path for path, _, _ in steps] == ["mpi", "gloo"], report
    assert all(float(a) > 0 and float(b) > 0 for _, a, b in steps), report
