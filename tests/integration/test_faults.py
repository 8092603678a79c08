"""Faults under mpiexec: a rank that raises, dies, stalls or loses its engine ends the job."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from .launch import ROOT, SCRIPTS, mpiexec, run

SCRIPT = SCRIPTS / "faults.py"
# Time allowed from the injected fault to the end of the whole job (the bound for a
# killed rank; the others must be at least as prompt).
BOUND_S = 10.0


def _launch(n, mode, rank, step=3, env=None, timeout=90):
    res = run(n, SCRIPT, mode, "--rank", rank, "--step", step, env=env, timeout=timeout)
    ended = time.time()
    match = re.search(rf"rank {rank}: injecting {mode} at step {step} at ([0-9.]+)", res.stdout)
    assert match, f"the fault was never injected:\n{res.output}"
    return res, ended - float(match.group(1))


@pytest.mark.parametrize("n", [2, 3])
def test_without_a_fault_the_job_finishes(n):
    res = run(n, SCRIPT, "none", timeout=90)
    assert res.returncode == 0, res.output
    assert res.stdout.count("finished") == n, res.output


@pytest.mark.parametrize("n, rank", [(2, 1), (3, 0), (4, 2)])
def test_uncaught_exception_aborts_every_rank(n, rank, tmp_path):
    """Where rank 0 raises, its timeline is whole JSON too: the abort skips shutdown(), which
    ends the timeline's array, so the hook ends it."""
    timeline = tmp_path / "timeline.json"
    res, secs = _launch(
        n, "raise", rank, env={"MPIDP_TIMELINE": str(timeline)} if rank == 0 else None
    )
    assert res.returncode != 0, res.output
    assert secs < BOUND_S, f"job took {secs:.1f} s to end after the fault:\n{res.output}"
    assert f"uncaught RuntimeError on rank {rank} (host " in res.stderr, res.output
    assert f"aborting all {n} ranks" in res.stderr
    assert f"injected failure on rank {rank} at step 3" in res.stderr  # the traceback
    assert res.stderr.count("Traceback (most recent call last)") == 1, res.stderr
    assert "finished" not in res.stdout
    if rank == 0:
        events = json.loads(timeline.read_text())  # strict: no closing bracket would fail here
        assert any(e.get("ph") == "X" for e in events), events[:5]


def test_exception_with_abort_off_still_ends_the_job():
    # Without the abort, the failed rank's exit runs shutdown(), which ends the peers' engines.
    res, secs = _launch(3, "raise", 1, env={"MPIDP_ABORT_ON_ERROR": "0"})
    assert res.returncode != 0, res.output
    assert "aborting" not in res.stderr
    assert "injected failure on rank 1" in res.stderr
    assert "shut down by rank 1 (host " in res.stderr, res.output
    assert "(mpidp.shutdown(), or its script ended)" in res.stderr, res.output
    assert "finished" not in res.stdout


# At 3 ranks, test_chaos.py's kill trial (rank 2 at step 3) checks the same and more.
@pytest.mark.parametrize("n", [2])
def test_killed_rank_ends_the_job_within_bound(n):
    res, secs = _launch(n, "kill", n - 1)
    assert res.returncode != 0, res.output
    assert secs < BOUND_S, f"job took {secs:.1f} s to end after SIGKILL:\n{res.output}"
    assert "signal 9" in res.output or "Killed" in res.output, res.output
    assert "finished" not in res.stdout


def test_stalled_rank_shuts_the_engine_down_and_ends_the_job():
    limit = 3
    res, secs = _launch(
        3, "stall", 2, env={"MPIDP_STALL_WARNING_S": "1", "MPIDP_STALL_SHUTDOWN_S": str(limit)}
    )
    assert res.returncode != 0, res.output
    assert secs < limit + BOUND_S, f"job took {secs:.1f} s to end after the stall:\n{res.output}"
    assert "missing ranks 2" in res.stderr, res.output  # the warning names the missing rank
    assert re.search(
        r"EngineShutdownError: stall: op '[^']+' waited [0-9.]+ s for ranks 2 "
        rf"\(submitted by 0,1\).*; MPIDP_STALL_SHUTDOWN_S={limit}:",
        res.stderr,
    ), res.output
    assert "finished" not in res.stdout


def test_engine_failure_fails_later_ops_and_ends_the_job():
    res, secs = _launch(3, "engine", 1)
    assert res.returncode != 0, res.output
    assert secs < BOUND_S, f"job took {secs:.1f} s to end after the engine failed:\n{res.output}"
    assert "OSError: injected engine failure" in res.stderr, res.output
    assert (
        "rank 1: later op failed: mpidp's engine failed on rank 1: OSError: injected engine failure"
    ) in res.stdout, res.output
    assert "finished" not in res.stdout


def test_engine_failure_caught_and_a_normal_exit_still_end_the_job():
    """The script catches the engine's error and exits normally: the peers wait in a cycle
    this rank's engine left, so its shutdown() at exit ends the job instead of finalizing."""
    res, secs = _launch(3, "engine_caught", 1)
    assert res.returncode != 0, res.output
    assert secs < BOUND_S, f"job took {secs:.1f} s to end after the engine failed:\n{res.output}"
    assert "failed in the middle of a cycle on rank 1" in res.stderr, res.output
    assert "finished" not in res.stdout


@pytest.mark.parametrize("abort_on_error", ["1", "0"])
def test_data_path_failure_on_one_rank_ends_the_job(abort_on_error):
    """Rank 1 fails while packing a fusion buffer, and its script even catches the error and
    carries on: the peers are inside (or about to enter) the collective rank 1 never joins, so
    the job must end, saying why, whatever MPIDP_ABORT_ON_ERROR says."""
    res, secs = _launch(3, "datapath", 1, env={"MPIDP_ABORT_ON_ERROR": abort_on_error})
    assert res.returncode != 0, res.output
    assert secs < BOUND_S, f"job took {secs:.1f} s to end after the failure:\n{res.output}"
    assert (
        "the data path failed on rank 1 with MemoryError: injected failure while packing "
        "a fusion buffer"
    ) in res.output, res.output
    assert "finished" not in res.stdout, res.output


def _interrupt(target: str, mode: str = "idle", *args):
    """Start 3 ranks of scripts/interrupt.py in `mode`, send SIGINT to the job's whole process
    group (what Ctrl-C in a terminal does), to rank 2 alone, or to ranks 1 and 2 ("peers");
    returns (exit code, output, seconds to the end)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPIDP_STALL_WARNING_S="10")
    proc = subprocess.Popen(
        [mpiexec(), "-n", "3", sys.executable, str(SCRIPTS / "interrupt.py"), mode, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(ROOT),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    pids, lines = {}, []
    try:
        while len(pids) < 3:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            # Three ranks write through one launcher: a line may carry more than one rank's
            # output (seen once in CI), so find every announcement wherever it is.
            for r, pid in re.findall(r"ready (\d+) (\d+)", line):
                pids[int(r)] = int(pid)
        assert len(pids) == 3, "".join(lines)
        if mode != "idle":
            time.sleep(1.0)  # well into training
        began = time.time()
        if target == "job":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            for r in (1, 2) if target == "peers" else (2,):
                os.kill(pids[r], signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            # The ranks' own words say where they hang (the catch mode dumps every thread's
            # stack 20 s into its save, the stall inspector warns at 10 s): show them all.
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"the job did not end within 60 s of SIGINT:\n{''.join(lines)}{out}")
        return proc.returncode, "".join(lines) + out, time.time() - began
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("target, speaker", [("job", 0), ("rank", 2), ("peers", 1)])
def test_ctrl_c_is_reported_once_per_job(target, speaker):
    """Ctrl-C reaches every rank: one line for the job (rank 0's), no traceback per rank. A
    rank interrupted alone says so itself, and the job ends too. When rank 0 does not raise
    (its Ctrl-C held in a cycle its peers left, as seen in CI), the lowest rank that did
    speaks, alone."""
    rc, out, secs = _interrupt(target)
    assert rc != 0, out
    assert out.count("interrupted (KeyboardInterrupt)") == 1, out
    assert f"interrupted (KeyboardInterrupt) on rank {speaker}" in out, out
    assert "Traceback" not in out and secs < BOUND_S, out


@pytest.mark.parametrize("attempt", range(3))
def test_ctrl_c_during_training_is_reported_once(attempt):
    """Ctrl-C mostly lands while the main thread runs an engine cycle (a blocking call drives
    the engine): it is held to the cycle's end, so no rank logs an engine failure."""
    rc, out, secs = _interrupt("job", "busy")
    assert rc != 0, out
    assert out.count("interrupted (KeyboardInterrupt)") == 1, out
    assert "Traceback" not in out and "engine failed" not in out and secs < BOUND_S, out


@pytest.mark.parametrize("attempt", range(3))
def test_a_script_that_catches_ctrl_c_saves_a_checkpoint_and_ends(attempt, tmp_path):
    """As with Horovod, whose engine runs on its own thread: a training script that catches
    KeyboardInterrupt can still run collectives (here a checkpoint's), and the job ends
    normally. An interrupt taken in the middle of a cycle used to break the engine there and
    leave the peers waiting in a collective for good."""
    rc, out, secs = _interrupt("job", "catch", "--checkpoint", str(tmp_path / "ck.pt"))
    assert rc == 0 and secs < BOUND_S, f"exit {rc} after {secs:.1f} s:\n{out}"
    assert sorted(re.findall(r"saved (\d)", out)) == ["0", "1", "2"], out
    assert "engine failed" not in out, out
