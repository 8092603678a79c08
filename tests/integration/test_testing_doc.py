"""docs/testing.md's example, run as a user would: pytest under mpiexec on examples/testing."""

import re

from .launch import ROOT, run

EXAMPLE = ROOT / "examples" / "testing"
INNER_TIMEOUT = 90  # pytest-timeout per test inside the launched job


def _pytest(n, env=None):
    return run(
        n,
        "-m",
        "pytest",
        "--with-mpi",
        "-p",
        "no:cacheprovider",
        "-q",
        f"--timeout={INNER_TIMEOUT}",
        "--timeout-method=thread",
        EXAMPLE,
        env=env,
        timeout=300,
    )


def _summaries(out):
    """Each rank's closing line, e.g. '7 passed, 1 skipped in 11.55s' (lines may run together
    when ranks finish at the same moment)."""
    return re.findall(r"(\d+ failed, )?(\d+) passed(, \d+ skipped)? in [0-9.]+s", out)


def test_example_passes():
    # At 2 ranks; at 3 the test below runs the same 7 tests, and the 7 besides the deliberate
    # failure must pass there too.
    n = 2
    res = _pytest(n)
    assert res.returncode == 0, res.output
    summaries = _summaries(res.stdout)
    # Every rank ran the 7 tests (the deliberate failure is skipped without its variable).
    assert len(summaries) == n, res.output
    assert all(s == ("", "7", ", 1 skipped") for s in summaries), summaries


def test_one_rank_failing_fails_every_rank_promptly():
    n = 3
    res = _pytest(n, env={"EXAMPLE_FAIL_ON_RANK": "1"})
    assert res.returncode != 0, res.output
    # Every rank reports the failure of the one rank, with its message ...
    # (pytest also repeats the message in its short summary when it detects CI: at least n.)
    assert (
        res.stdout.count("FAILED examples/testing/test_user_example.py::test_deliberate_failure")
        == n
    ), res.output
    assert res.stdout.count("AssertionError: failed on rank 1: expected 3, computed 4.0") >= n, (
        res.output
    )
    # ... fails exactly that test, and runs the later tests normally: the ranks stayed in step.
    summaries = _summaries(res.stdout)
    assert len(summaries) == n and all(s == ("1 failed, ", "7", "") for s in summaries), res.output
    # No rank was left waiting for the per-test timeout to end it.
    assert "Timeout" not in res.output, res.output
    assert res.seconds < INNER_TIMEOUT, f"took {res.seconds:.0f} s"
