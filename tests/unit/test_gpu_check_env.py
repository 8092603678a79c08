"""tests/gpu_check.py's environment for the commands it launches (no MPI, no GPU needed)."""

import importlib.util
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tests" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checkout_first_on_a_pythonpath_already_set(gpu_check, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = gpu_check.env_with("/site", MPIDP_BACKEND="gloo")
    assert env["PYTHONPATH"] == os.pathsep.join([str(ROOT), "/site", "/elsewhere"])
    assert env["MPIDP_BACKEND"] == "gloo"


def test_open_mpi_may_run_as_root_unless_the_environment_says_otherwise(gpu_check, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.delenv("OMPI_ALLOW_RUN_AS_ROOT", raising=False)
    assert gpu_check.env_with()["OMPI_ALLOW_RUN_AS_ROOT"] == "1"
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "0")
    assert gpu_check.env_with()["OMPI_ALLOW_RUN_AS_ROOT"] == "0"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv("OMPI_ALLOW_RUN_AS_ROOT")
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in gpu_check.env_with()
