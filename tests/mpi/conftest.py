"""Session set-up for the MPI test suite: mpidp.init() once on every rank, shutdown at the end."""

import gc

import pytest
from devices import DEVICE_PARAMS, use_device
from mpi_util import assert_all, gather, raises_all, run_all  # noqa: F401 (re-exported helpers)

import mpidp


@pytest.fixture(scope="session", autouse=True)
def mpidp_session():
    """mpidp.init() once for the whole session on every rank; shutdown at its end."""
    mpidp.init()
    yield
    mpidp.shutdown()


@pytest.fixture(autouse=True)
def mpidp_still_initialised(mpidp_session):
    """After each test, mpidp must still be initialised on every rank (lifecycle tests re-init)
    and every rank must have numbered the same count of unnamed ops; if not, fail the test and
    re-initialise so that later tests are not failed by it.

    Before that, every rank collects the test's garbage and freezes what survives (a test's
    lazy imports: torch.optim, torch.distributed, about 120 000 objects), as tests/conftest.py
    does once after collection: a DistributedOptimizer whose names another one used collects
    first (training/buckets.py), and a full collection over those objects took 60-120 ms, 6 of
    test_sharded.py's 17 s at n=4."""
    yield
    gc.collect()
    gc.freeze()
    ok = mpidp.is_initialized()
    views = gather((ok, _unnamed_counter() if ok else None))
    counters = [c for _, c in views]
    in_step = all(c == counters[0] for c in counters)
    if not all(o for o, _ in views) or not in_step:
        # Restart so that later tests start from a clean, agreed state.
        mpidp.shutdown()
        mpidp.init()
    assert_all(ok, "the test left mpidp shut down")
    assert_all(
        in_step,
        f"the ranks submitted different numbers of unnamed ops (barrier included), so "
        f"later unnamed ops would be matched wrongly: counters {counters}",
    )


def _unnamed_counter():
    """How many unnamed ops this rank has numbered (mpidp internals; None if not available)."""
    from mpidp.runtime import world

    return world.state().unnamed_count()


@pytest.fixture
def shared_dir(tmp_path):
    """Rank 0's temporary directory, on every rank (each rank's own tmp_path differs)."""
    return gather(str(tmp_path))[0]


@pytest.fixture(params=DEVICE_PARAMS)
def device(request):
    """The tensors' device: a test taking this fixture runs on cpu, then on cuda where a GPU is
    present and the engine's CUDA path serves this many ranks per GPU (devices.py)."""
    return use_device(request.param)
