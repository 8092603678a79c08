"""Cross-rank mismatches fail every rank with one MismatchError message, and the engine recovers."""

import pytest
import torch
from mpi_util import assert_all, gather, rank, run_all, size, tensor_diff

import mpidp


def _allreduce(shape=(3,), dtype=torch.float32, op=mpidp.Sum, pre=1.0, post=1.0):
    return lambda name: mpidp.allreduce_async(
        torch.ones(shape, dtype=dtype), name=name, op=op, prescale_factor=pre, postscale_factor=post
    )


def _broadcast(root=0):
    return lambda name: mpidp.broadcast_async(torch.ones(3), root, name=name)


def _allgather(trailing=3, dtype=torch.float32):
    return lambda name: mpidp.allgather_async(
        torch.ones(rank() + 1, trailing, dtype=dtype), name=name
    )


def _alltoall(trailing=2):
    return lambda name: mpidp.alltoall_async(torch.ones(size(), trailing), name=name)


def _reducescatter(op=mpidp.Sum, rows=None):
    return lambda name: mpidp.reducescatter_async(
        torch.ones(2 * size() + (1 if rows == "odd" else 0), 2), name=name, op=op
    )


# case -> (what every rank but the last submits, what the last rank submits, words that the
# message must contain besides the tensor name and the last rank)
CASES = {
    "dtype": (_allreduce(), _allreduce(dtype=torch.float64), ["float32", "float64"]),
    "shape": (_allreduce(), _allreduce(shape=(4,)), ["(3,)", "(4,)"]),
    "op_type": (_allreduce(), _broadcast(), ["allreduce", "broadcast"]),
    "reduce_op": (_allreduce(), _allreduce(op=mpidp.Max), ["Sum", "Max"]),
    "root": (_broadcast(0), "root_last", ["root"]),
    "prescale": (_allreduce(), _allreduce(pre=2.0), ["prescale"]),
    "postscale": (_allreduce(), _allreduce(post=0.5), ["postscale"]),
    "allgather_trailing": (_allgather(3), _allgather(4), ["allgather"]),
    "allgather_dtype": (_allgather(), _allgather(dtype=torch.float64), ["float64"]),
    "alltoall_trailing": (_alltoall(2), _alltoall(5), ["alltoall"]),
    "reducescatter_op": (_reducescatter(), _reducescatter(op=mpidp.Average), ["Average"]),
    "reducescatter_shape": (_reducescatter(), _reducescatter(rows="odd"), ["reducescatter"]),
}


def _submitter(case: str, last: bool):
    good, bad, _ = CASES[case]
    if not last:
        return good
    if bad == "root_last":
        return _broadcast(size() - 1)
    return bad


def _expect_mismatch(submit, name):
    """Submit and synchronize; return (message or None, problem)."""
    try:
        h = submit(name)
    except Exception as e:  # noqa: BLE001
        return None, f"submission raised {type(e).__name__}: {e}"
    try:
        mpidp.synchronize(h)
        return None, "no error: the mismatched op completed"
    except mpidp.MismatchError as e:
        if not isinstance(e, mpidp.HorovodInternalError):
            return None, f"MismatchError is not a HorovodInternalError: {type(e).__mro__}"
        return str(e), None
    except Exception as e:  # noqa: BLE001
        return None, f"raised {type(e).__name__} instead of MismatchError: {e}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("cached", [False, True], ids=["fresh", "cached"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_mismatch(case, cached):
    """The last rank submits a different value of one field; every rank gets the same error."""
    r, n = rank(), size()
    last = r == n - 1
    name = f"test_mismatch.{case}.{'cached' if cached else 'fresh'}"
    good = _submitter(case, False)
    if cached:
        # Negotiate the name twice so it sits in the response cache; the third submission then
        # hits the invalidation path on the last rank and the fast path on the others.
        run_all(lambda: [mpidp.synchronize(good(name)) for _ in range(2)])
    msg, problem = _expect_mismatch(_submitter(case, last), name)
    assert_all(problem is None, problem)

    msgs = gather(msg)
    assert_all(
        all(m == msgs[0] for m in msgs),
        "ranks got different messages:\n" + "\n".join(f"  {m}" for m in msgs),
    )
    words = [repr(name), f"rank {n - 1}"] + CASES[case][2]
    missing = [w for w in words if w not in msg]
    assert_all(not missing, f"message {msg!r} lacks {missing}")

    # The engine goes on: a fresh name works, and so does the mismatched name used correctly.
    def after():
        fresh = mpidp.allreduce(torch.ones(2), op=mpidp.Sum, name=f"{name}.after")
        again = [mpidp.synchronize(good(name)) for _ in range(2)]
        return fresh, again

    fresh, again = run_all(after)
    d = tensor_diff(fresh, torch.full((2,), float(n)))
    assert_all(not d, f"fresh op after the mismatch: {d}")
    assert_all(
        all(isinstance(a, torch.Tensor) for a in again),
        f"the name used correctly after the mismatch gave {again!r}",
    )


@pytest.mark.mpi(min_size=2)
def test_mismatch_in_grouped_op_fails_the_group_only():
    r, n = rank(), size()
    name = "test_mismatch_in_grouped_op_fails_the_group_only"
    shapes = [(2,), (5,) if r == n - 1 else (3,), (1,)]

    def body():
        h = mpidp.grouped_allreduce_async([torch.ones(s) for s in shapes], op=mpidp.Sum, name=name)
        other = mpidp.allreduce_async(torch.ones(2), op=mpidp.Sum, name=f"{name}.other")
        try:
            mpidp.synchronize(h)
            msg = None
        except mpidp.MismatchError as e:
            msg = str(e)
        return msg, mpidp.synchronize(other)

    msg, other = run_all(body)
    msgs = gather(msg)
    assert_all(
        msg is not None and f"{name}.1" in msg and all(m == msg for m in msgs),
        f"grouped mismatch messages: {msgs}",
    )
    d = tensor_diff(other, torch.full((2,), float(n)))
    assert_all(not d, f"op beside the failed group: {d}")


@pytest.mark.mpi(min_size=3)
def test_mismatch_message_names_every_group_of_ranks():
    """Three different shapes on three groups of ranks: all are named."""
    r, n = rank(), size()
    name = "test_mismatch_message_names_every_group_of_ranks"
    length = 3 if r < n - 2 else (4 if r == n - 2 else 5)
    msg, problem = _expect_mismatch(_allreduce(shape=(length,)), name)
    assert_all(problem is None, problem)
    missing = [
        w for w in (f"rank {n - 2}", f"rank {n - 1}", "(3,)", "(4,)", "(5,)") if w not in msg
    ]
    assert_all(not missing, f"message {msg!r} lacks {missing}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", ["shape", "dtype", "op_type", "root"])
def test_mismatch_cached_name_all_but_last_rank_change(case):
    """The reverse of the cache invalidation above: every rank but the last changes a cached
    name's metadata, and the last rank's unchanged request waits on the cache bit."""
    r, n = rank(), size()
    name = f"test_mismatch_cached_name_all_but_last_rank_change.{case}"
    good = _submitter(case, False)
    run_all(lambda: [mpidp.synchronize(good(name)) for _ in range(2)])
    deviant = r != n - 1
    submit = _submitter(case, True) if deviant else good
    msg, problem = _expect_mismatch(submit, name)
    assert_all(problem is None, problem)
    msgs = gather(msg)
    assert_all(all(m == msgs[0] for m in msgs), f"ranks got different messages: {msgs}")
    missing = [w for w in (repr(name), f"rank {n - 1}") if w not in msg]
    assert_all(not missing, f"message {msg!r} lacks {missing}")
    outs = run_all(lambda: [mpidp.synchronize(good(name)) for _ in range(2)])
    assert_all(all(isinstance(o, torch.Tensor) for o in outs), f"reuse gave {outs!r}")
