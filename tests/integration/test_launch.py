"""Launch-time behaviour under mpiexec: knobs, thread level, lonely worlds, stalls, shutdown."""

import socket
import subprocess
import sys

import pytest

from .launch import ROOT, SCRIPTS, run


@pytest.mark.parametrize("n", [2, 3])
def test_engine_demo_runs(n):
    res = run(n, ROOT / "examples" / "engine_demo.py", timeout=120)
    assert res.returncode == 0, res.output
    assert f"mpidp engine demo: {n} ranks" in res.stdout
    assert "all correct after synchronize" in res.stdout


def test_malformed_knob_on_one_rank_fails_every_rank():
    res = run(3, SCRIPTS / "knobs.py", "MPIDP_FUSION_THRESHOLD_BYTES", "lots", 2, timeout=60)
    assert res.returncode != 0
    # The launcher forwards each rank's output in chunks, so long lines from different ranks
    # may interleave: look for each rank's report anywhere in the output.
    for rank in range(3):
        assert (
            f"rank {rank}: ConfigError: rank 2: MPIDP_FUSION_THRESHOLD_BYTES='lots'" in res.stdout
        ), res.output


def test_horovod_alias_that_disagrees_across_ranks_is_refused():
    res = run(2, SCRIPTS / "knobs.py", "HOROVOD_CACHE_CAPACITY", "7", 1, timeout=60)
    assert res.returncode != 0
    assert "cache_capacity must be the same on every rank" in res.stdout, res.output


def test_thread_level_too_low_names_the_variable():
    res = run(2, SCRIPTS / "thread_level.py", env={"MPI4PY_RC_THREAD_LEVEL": "single"}, timeout=60)
    assert res.returncode != 0
    assert "MPI4PY_RC_THREAD_LEVEL" in res.stdout, res.output


def test_lonely_world_under_a_launcher_that_announced_more_ranks_warns():
    res = run(1, SCRIPTS / "thread_level.py", env={"SLURM_NTASKS": "4"}, timeout=60)
    assert res.returncode == 0, res.output
    assert "world of size 1" in res.stderr and "SLURM_NTASKS=4" in res.stderr, res.stderr
    assert "--mpi=pmi2" in res.stderr


def test_stall_warning_names_tensor_and_missing_rank():
    res = run(3, SCRIPTS / "stall.py", "3", env={"MPIDP_STALL_WARNING_S": "1"}, timeout=90)
    assert res.returncode == 0, res.output
    assert "stalled.tensor" in res.stderr and "missing ranks 2" in res.stderr, res.stderr
    assert res.stdout.count("result [3.0, 3.0]") == 3, res.output


def test_stall_shutdown_fails_pending_ops_on_every_waiting_rank():
    res = run(
        2,
        SCRIPTS / "stall.py",
        "never",
        env={"MPIDP_STALL_WARNING_S": "1", "MPIDP_STALL_SHUTDOWN_S": "2"},
        timeout=90,
    )
    assert "rank 0: EngineShutdownError: stall: op 'stalled.tensor'" in res.stdout, res.output
    assert "MPIDP_STALL_SHUTDOWN_S=2" in res.stdout
    assert res.returncode != 0


def test_a_rank_that_shuts_down_releases_the_others():
    res = run(3, SCRIPTS / "peer_shutdown.py", timeout=60)
    assert res.returncode == 0, res.output
    host = socket.gethostname()
    for rank in (1, 2):
        assert (
            f"rank {rank}: EngineShutdownError: mpidp was shut down by rank 0 (host {host})"
            in res.stdout
        ), res.output
        assert f"rank {rank}: later op refused" in res.stdout, res.output


def test_an_uncaught_init_error_is_reported_once_per_job():
    """Every rank raises the same ConfigError; left uncaught, rank 0 alone says it, in one line
    with the rank that holds the bad value, instead of one traceback per rank."""
    res = run(
        3, "-c", "import mpidp; mpidp.init()", env={"MPIDP_CYCLE_TIME_MS": "soon"}, timeout=60
    )
    assert res.returncode != 0, res.output
    line = "mpidp: init() failed on every rank: ConfigError: rank 0: MPIDP_CYCLE_TIME_MS='soon'"
    assert res.output.count(line) == 1, res.output
    assert "Traceback" not in res.output, res.output


_CAUGHT = (
    "import mpidp\n"
    "try:\n"
    "    mpidp.init()\n"
    "except mpidp.MpidpError as e:\n"
    "    print(f'caught {type(e).__name__}: {e}', flush=True)\n"
)


@pytest.mark.parametrize("abort", ["1", "0"])
def test_an_init_failure_on_rank_0_alone_fails_init_on_every_rank(abort):
    """Rank 0 alone opens the autotune log; an unwritable path used to abort the job from rank
    0 (or, without the abort policy, leave the others waiting for good). Every rank's init()
    raises, and uncaught, rank 0 alone says it, once."""
    env = {
        "MPIDP_AUTOTUNE": "1",
        "MPIDP_AUTOTUNE_LOG": "/nonexistent-dir/tune.csv",
        "MPIDP_ABORT_ON_ERROR": abort,
    }
    res = run(3, "-c", _CAUGHT, env=env, timeout=60)
    assert res.returncode == 0, res.output
    assert res.stdout.count("caught MpidpError: rank 0: FileNotFoundError") == 3, res.output
    res = run(3, "-c", "import mpidp; mpidp.init()", env=env, timeout=60)
    assert res.returncode != 0, res.output
    assert (
        res.output.count("init() failed on every rank: MpidpError: rank 0: FileNotFoundError") == 1
    ), res.output
    assert "Traceback" not in res.output, res.output


def test_an_init_error_every_rank_sees_is_said_once_with_its_ranks():
    """MPIDP_BACKEND=nccl on a host without a GPU: one line for the job, not a traceback per
    rank."""
    res = run(3, "-c", "import mpidp; mpidp.init()", env={"MPIDP_BACKEND": "nccl"}, timeout=60)
    assert res.returncode != 0, res.output
    line = "init() failed on every rank: ConfigError: ranks 0, 1, 2: MPIDP_BACKEND=nccl"
    assert res.output.count(line) == 1, res.output
    assert "Traceback" not in res.output, res.output


@pytest.mark.parametrize("code", [0, 1])
def test_a_peer_that_dies_leaves_rank_0s_timeline_with_what_came_before(tmp_path, code):
    """The launcher ends rank 0 moments after rank 1 exits; its timeline held only '[' (events
    were written every 0.25 s). Every event before the failure is there, whole, and the CLI
    reads the file without its closing bracket."""
    path = tmp_path / "timeline.json"
    run(2, SCRIPTS / "timeline_peer_dies.py", code, env={"MPIDP_TIMELINE": str(path)}, timeout=60)
    from mpidp.engine import timeline

    events = timeline.load(str(path))
    timeline.validate(events)
    rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {f"before.{i}" for i in range(5)} <= rows, rows
    spans = [e for e in events if e["name"] == "allreduce" and e["ph"] == "X"]
    assert len(spans) >= 5, events
    res = subprocess.run(
        [sys.executable, "-m", "mpidp", "timeline", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(ROOT),
    )
    assert res.returncode == 0 and "valid trace" in res.stdout, res.stdout + res.stderr


def test_sigterm_handler_raising_systemexit_ends_that_rank_cleanly():
    """SystemExit from a SIGTERM handler used to strike inside an engine cycle the main thread
    was running ("engine failed", the job aborted). The rank ends cleanly; the others' ops fail
    with an error that names it."""
    res = run(3, SCRIPTS / "sigterm_exit.py", timeout=90)
    assert res.returncode == 0, res.output
    assert "engine failed" not in res.output and "Traceback" not in res.output, res.output
    host = socket.gethostname()
    for rank in (0, 2):
        assert (
            f"rank {rank}: EngineShutdownError: mpidp was shut down by rank 1 (host {host})"
            in res.stdout
        ), res.output
