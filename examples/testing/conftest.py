"""pytest set-up for testing your own mpidp code under mpiexec (see docs/testing.md).

    mpiexec -n 2 python -m pytest --with-mpi -p no:cacheprovider \
        --timeout=120 --timeout-method=thread examples/testing

Three things every MPI test suite needs:
  1. mpidp.init() once per session on every rank, shutdown() at the end;
  2. a per-rank --basetemp, so that ranks do not race over pytest's temporary directories;
  3. assert_all(): a verdict that fails every rank when one rank fails.
"""

import os
import tempfile

import pytest

import mpidp
from mpidp.config import launcher_rank  # the rank MPICH, Open MPI, PMIx or srun announced


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Give each rank its own temporary root. pytest numbers and prunes directories under one
    shared root (pytest-of-<user>/pytest-N); several ranks doing that at once race and delete
    each other's directories. Runs before pytest reads --basetemp, and only under a launcher."""
    rank = launcher_rank()
    if rank is None or config.option.basetemp:
        return
    # The parent process is the launcher's per-host proxy: one directory per launch.
    launch = os.path.join(
        tempfile.gettempdir(), f"pytest-ranks-{os.getuid()}", f"launch-{os.getppid()}"
    )
    os.makedirs(launch, exist_ok=True)
    config.option.basetemp = os.path.join(launch, f"rank{rank}")


@pytest.fixture(scope="session", autouse=True)
def mpidp_session():
    """init() once for the whole session (collective: every rank collects the same tests, so
    every rank gets here together), shutdown() when the session ends."""
    mpidp.init()
    yield
    mpidp.shutdown()


def assert_all(ok, message: str = "") -> None:
    """Fail on every rank if `ok` is false on any rank, naming the ranks and their messages.

    Collective: every rank must call it at the same point. A plain `assert` that fails on one
    rank ends that rank's test while the others go on into the next collective and wait for it.
    """
    verdicts = mpidp.allgather_object((bool(ok), "" if ok else str(message)))
    bad = [f"rank {r}: {msg}" for r, (good, msg) in enumerate(verdicts) if not good]
    if bad:
        raise AssertionError("failed on " + "; ".join(bad))


@pytest.fixture
def check():
    """The collective assertion as a fixture, so test files need no import from conftest."""
    return assert_all
