"""Checkpoints under SIGKILL: a kill during save never tears one; resumes repeat runs bitwise."""

import random
import re

import pytest
import torch

from .launch import SCRIPTS, run

pytestmark = pytest.mark.timeout(900)

KILL_SCRIPT = SCRIPTS / "ckpt_kill_during_save.py"


def _version_on_disk(path):
    """Read the file as a plain torch user would, with no MPI: its version, checked for tearing."""
    payload = torch.load(path, weights_only=True)
    state = payload["state"]
    version = state["version"]
    torn = [
        k for k, t in state["tensors"].items() if not torch.equal(t, torch.full_like(t, version))
    ]
    assert not torn, f"tensors {torn} do not hold version {version}"
    return version


def _temporaries(directory):
    return sorted(p.name for p in directory.glob(".ckpt.pt.tmp-*"))


def test_sigkill_during_save_always_leaves_the_previous_or_the_new_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    first = run(2, KILL_SCRIPT, path, 1, "none", 0, timeout=180)
    assert first.returncode == 0, first.output
    seconds = float(re.search(r"rank 0: saved version 1 in ([0-9.]+) s", first.stdout).group(1))
    size = path.stat().st_size
    rng = random.Random(20261122)
    plan = [
        ("bytes", size // 3),
        ("delay", rng.uniform(0, 1.5 * seconds)),
        ("bytes", size * 2 // 3),
        ("delay", rng.uniform(0, 1.5 * seconds)),
        ("delay", rng.uniform(0, 1.5 * seconds)),
    ]
    good, outcomes = 1, []
    for version, (mode, value) in enumerate(plan, start=2):
        res = run(2, KILL_SCRIPT, path, version, mode, value, timeout=180)
        where = f"round {version} ({mode} {value}, first save took {seconds:.3f} s)"
        assert res.returncode != 0, f"{where}: the job was not killed\n{res.output}"
        for rank in (0, 1):
            assert f"rank {rank}: loaded version {good} consistent True" in res.stdout, (
                f"{where}\n{res.output}"
            )
        found = _version_on_disk(path)
        assert found in (good, version), f"{where}: version {found} on disk"
        if mode == "bytes":
            assert "save finished before the kill" not in res.stdout, res.output
            assert found == good, f"{where}: killed mid-write, yet version {found} is in place"
        assert len(_temporaries(tmp_path)) <= 1, _temporaries(tmp_path)
        outcomes.append("previous" if found == good else "new")
        good = found
    last = run(2, KILL_SCRIPT, path, 7, "none", 0, timeout=180)
    assert last.returncode == 0, last.output
    assert f"rank 1: loaded version {good} consistent True" in last.stdout, last.output
    assert _version_on_disk(path) == 7
    assert _temporaries(tmp_path) == [], "the last save left temporaries behind"
    assert "previous" in outcomes, outcomes  # the bytes rounds kill before the rename
    print(f"kills left these checkpoints in place: {outcomes}")


def _equal_params(a, b):
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_save_kill_resume_repeats_the_uninterrupted_run_bitwise(tmp_path):
    script = SCRIPTS / "ckpt_train.py"
    ckpt = tmp_path / "train.pt"
    full = run(2, script, "full", 30, 17, ckpt, tmp_path / "full.pt", timeout=240)
    assert full.returncode == 0, full.output
    part = run(2, script, "part", 30, 17, ckpt, tmp_path / "never.pt", timeout=240)
    assert part.returncode != 0 and "rank 0: saved at step 17" in part.stdout, part.output
    assert not (tmp_path / "never.pt").exists()
    resumed = run(2, script, "resume", 30, 17, ckpt, tmp_path / "resumed.pt", timeout=240)
    assert resumed.returncode == 0, resumed.output
    assert "rank 1: resumed at step 17 epoch 1" in resumed.stdout, resumed.output
    assert _equal_params(tmp_path / "full.pt", tmp_path / "resumed.pt")
    # The control: without each rank's RNG states the same resume takes other steps.
    norng = run(2, script, "resume_norng", 30, 17, ckpt, tmp_path / "norng.pt", timeout=240)
    assert norng.returncode == 0, norng.output
    assert not _equal_params(tmp_path / "full.pt", tmp_path / "norng.pt")


def test_elastic_run_resumes_a_restarted_job_from_the_last_commit(tmp_path):
    script = SCRIPTS / "elastic_train.py"
    ref = run(
        2,
        script,
        30,
        5,
        0,
        tmp_path / "ref.pt",
        timeout=240,
        env={"MPIDP_ELASTIC_CHECKPOINT": str(tmp_path / "ref_commit.pt")},
    )
    assert ref.returncode == 0, ref.output
    assert "rank 0: start at step 0 epoch 0" in ref.stdout and "reset callback" not in ref.stdout
    env = {"MPIDP_ELASTIC_CHECKPOINT": str(tmp_path / "commit.pt")}
    died = run(2, script, 30, 5, 18, tmp_path / "never.pt", timeout=240, env=env)
    assert died.returncode != 0 and "rank 1: committed step 15" in died.stdout, died.output
    assert "committed step 20" not in died.stdout, died.output
    again = run(2, script, 30, 5, 0, tmp_path / "resumed.pt", timeout=240, env=env)
    assert again.returncode == 0, again.output
    for rank in (0, 1):
        assert f"rank {rank}: start at step 15 epoch 1" in again.stdout, again.output
        assert f"rank {rank}: reset callback" in again.stdout, again.output
    assert _equal_params(tmp_path / "ref.pt", tmp_path / "resumed.pt")
