"""Collective assertion helpers and tensor helpers shared by the MPI test modules."""

import os
import pickle
import time
import traceback

import numpy as np
import torch

import mpidp

DTYPES = [
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
]
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INT_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
SIGNED_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64]


def dtype_id(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _world():
    # The user's communicator; mpidp works on its own duplicates of it.
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _wait(request) -> None:
    """Wait for a non-blocking collective as MPICH's own blocking wait would, minus its spin:
    MPICH moves a collective's rounds only inside Test(), so test and yield the core for 2 ms
    (the common case: every rank is here), then test between 0.5 ms sleeps. A blocking collective
    instead spins a core at full speed, and with more ranks than cores the peer it waits for gets
    that core only when the spinner's time slice ends (about 1 ms per verdict at n=4 on 2 cores;
    a sixth of the mpi stage's time there)."""
    spin_until = time.monotonic() + 0.002
    while not request.Test():
        if time.monotonic() < spin_until:
            os.sched_yield()
        else:
            time.sleep(0.0005)


def assert_all(ok, msg: str = "") -> None:
    """Assert `ok` on every rank at once: allgather each rank's verdict and fail all ranks if any
    rank failed, naming the failing ranks and their messages. Call it on every rank."""
    verdicts = gather((bool(ok), "" if ok else str(msg)))
    bad = [(r, m) for r, (good, m) in enumerate(verdicts) if not good]
    if bad:
        ranks = ",".join(str(r) for r, _ in bad)
        details = "\n".join(f"  rank {r}: {m}" for r, m in bad)
        raise AssertionError(f"check failed on rank(s) {ranks}:\n{details}")


def gather(value):
    """Every rank's `value`, in rank order (pickled, allgathered on COMM_WORLD without blocking
    calls: the sizes, then the bytes, each waited for by _wait)."""
    from mpi4py import MPI

    comm = _world()
    mine = np.frombuffer(pickle.dumps(value), dtype=np.uint8)
    counts = np.empty(comm.size, dtype=np.int64)
    _wait(comm.Iallgather(np.array([mine.size], dtype=np.int64), counts))
    displs = np.zeros(comm.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=displs[1:])
    every = np.empty(int(counts.sum()), dtype=np.uint8)
    _wait(comm.Iallgatherv(mine, [every, counts, displs, MPI.BYTE]))
    return [pickle.loads(every[d : d + c].tobytes()) for d, c in zip(displs, counts)]


def run_all(fn, *args, **kwargs):
    """Run fn on every rank; an exception on any rank fails every rank (with the traceback)
    instead of leaving the others waiting. Returns fn's result."""
    try:
        result, err = fn(*args, **kwargs), None
    except Exception:  # noqa: BLE001 - converted to a collective verdict
        result, err = None, traceback.format_exc()
    assert_all(err is None, err)
    return result


def raises_all(exc_type, fn, *args, match=None, **kwargs):
    """Expect fn to raise exc_type on every rank (message containing `match`, if given).
    Returns this rank's exception. If fn returns an integer handle instead of raising, the handle
    is synchronized so no op is left pending."""
    exc, msg = None, ""
    try:
        result = fn(*args, **kwargs)
        msg = f"{getattr(fn, '__name__', fn)} did not raise {exc_type.__name__}"
        if isinstance(result, int) and not isinstance(result, bool):
            try:
                mpidp.synchronize(result)
            except Exception as e2:  # noqa: BLE001
                msg += f" (its op then failed: {e2!r})"
    except exc_type as e:
        exc = e
        if match is not None and match not in str(e):
            msg = f"{exc_type.__name__} message {str(e)!r} does not contain {match!r}"
            exc = None
    except Exception as e:  # noqa: BLE001
        msg = f"raised {type(e).__name__}: {e} instead of {exc_type.__name__}"
    assert_all(exc is not None, msg)
    return exc


def same_everywhere(value, what: str = "value") -> None:
    """Every rank holds an equal `value` (compared with ==)."""
    values = gather(value)
    ok = all(v == values[0] for v in values)
    assert_all(ok, f"{what} differs across ranks: {values!r}")


# ---- tensor helpers ----


def cast(values: torch.Tensor, dtype) -> torch.Tensor:
    """Exact small integers (int64/float64) as `dtype`; bool means odd."""
    if dtype == torch.bool:
        return (values.to(torch.int64) % 2) == 1
    return values.to(dtype)


def tensor_diff(actual, expected, exact: bool = None) -> str:
    """'' if actual matches expected in dtype, shape and value, else a description."""
    if not isinstance(actual, torch.Tensor):
        return f"expected a tensor, got {type(actual).__name__}"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype}, expected {expected.dtype}"
    if tuple(actual.shape) != tuple(expected.shape):
        return f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if actual.device != expected.device:
        return f"on {actual.device}, expected on {expected.device}"
    actual, expected = actual.cpu(), expected.cpu()
    if exact is None:
        exact = not expected.is_floating_point()
    if exact:
        if not torch.equal(actual, expected):
            return f"values {actual.tolist()}, expected {expected.tolist()}"
        return ""
    try:
        torch.testing.assert_close(actual, expected)
    except AssertionError as e:
        return f"values {actual.tolist()}, expected {expected.tolist()}: {e}"
    return ""


def check_tensor(actual, expected, what: str, exact: bool = None) -> None:
    """Collective: actual equals expected on every rank."""
    diff = tensor_diff(actual, expected, exact)
    assert_all(not diff, f"{what}: {diff}")


def rank() -> int:
    return mpidp.rank()


def size() -> int:
    return mpidp.size()


def int_average(total, n: int):
    """Horovod's integer Average of a summed tensor: times the double 1/n, truncated toward
    zero (-3 over 2 ranks is -1, not floor's -2)."""
    import torch

    return (total.to(torch.float64) * (1.0 / n)).trunc().to(total.dtype)


# ---- training helpers ----


def row_batches(steps: int, rows: int, seed: int, features: int = 4, classes: int = 3):
    """`steps` float64 batches (x, y) of `rows` rows per rank, alike on every rank."""
    g = torch.Generator().manual_seed(seed)
    n = size()
    return [
        (
            torch.randn(rows * n, features, generator=g, dtype=torch.float64),
            torch.randint(0, classes, (rows * n,), generator=g),
        )
        for _ in range(steps)
    ]


def my_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """This rank's `rows` rows of a batch from row_batches."""
    r = rank()
    return t[r * rows : (r + 1) * rows]


def max_deviation(model, ref) -> float:
    """The largest difference between the two models' parameters."""
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


def ddp_beside_one_process(ddp, ref, steps: int, seed: int, device="cpu") -> float:
    """Train `ddp` (DistributedDataParallel over a copy of `ref`) on each rank's 4 rows of float
    batches of 4 features and 3 classes, and `ref` on the whole batch, with SGD; returns the
    largest difference between their parameters."""
    n, r = size(), rank()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4 * n, 4, generator=gen).to(device)
        y = torch.randint(0, 3, (4 * n,), generator=gen).to(device)
        torch.nn.functional.cross_entropy(
            ddp(x[4 * r : 4 * r + 4]), y[4 * r : 4 * r + 4]
        ).backward()
        opt.step()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return max_deviation(ddp.module, ref)
