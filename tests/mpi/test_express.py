"""The express lane: a blocking allreduce of a named, negotiated tensor runs in one cycle on the
caller's thread; every case it does not cover falls back to the general path, same result."""

import pytest
import torch
from mpi_util import assert_all, check_tensor, gather, raises_all, rank, run_all, size

import mpidp


def _engine():
    return mpidp.runtime.world.state().engine


class _Spy:
    """Counts Engine.express calls and how many ran the op (returned True)."""

    def __init__(self):
        self.eng = _engine()
        self.original = self.eng.express
        self.calls = self.taken = 0

    def __enter__(self):
        def spy(*args):
            self.calls += 1
            taken = self.original(*args)
            self.taken += taken
            return taken

        self.eng.express = spy
        return self

    def __exit__(self, *exc):
        del self.eng.express


CASES = [  # (dtype, op, prescale, postscale, shape)
    (torch.float32, mpidp.Sum, 1.0, 1.0, (1,)),
    (torch.float32, mpidp.Average, 1.0, 1.0, (3, 2)),
    (torch.float64, mpidp.Max, 1.0, 1.0, ()),
    (torch.int32, mpidp.Min, 1.0, 1.0, (5,)),
    (torch.int64, mpidp.Average, 1.0, 1.0, (4,)),
    (torch.float32, mpidp.Sum, 2.0, 0.5, (7,)),  # prescale: the general data path
    (torch.float16, mpidp.Sum, 1.0, 1.0, (6,)),  # 16-bit: the general data path
    (torch.bool, mpidp.Sum, 1.0, 1.0, (3,)),
]


def _expected(dtype, op, pre, post, shape, step):
    values = [torch.full(shape, r + step + 1, dtype=torch.float64) for r in range(size())]
    if dtype == torch.bool:
        return torch.full(shape, True)
    stack = torch.stack(values) * pre
    if op == mpidp.Max:
        out = stack.max(0).values
    elif op == mpidp.Min:
        out = stack.min(0).values
    else:
        out = stack.sum(0)
        if op == mpidp.Average:
            out = out / size()
    out = out * post
    if not dtype.is_floating_point:
        out = out.trunc()
    return out.to(dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{int(c[1])}-{c[2]}-{c[4]}")
def test_repeated_named_allreduce_takes_the_express_lane_with_exact_results(case, inplace):
    dtype, op, pre, post, shape = case
    name = f"express.{dtype}.{int(op)}.{pre}.{shape}.{inplace}"
    fn = mpidp.allreduce_ if inplace else mpidp.allreduce
    with _Spy() as spy:
        for step in range(6):
            t = torch.full(shape, rank() + step + 1, dtype=torch.float64).to(dtype)
            before = t.clone()
            out = run_all(fn, t, name=name, op=op, prescale_factor=pre, postscale_factor=post)
            check_tensor(
                out, _expected(dtype, op, pre, post, shape, step), f"step {step}", exact=True
            )
            assert_all((out is t) == inplace, "in place: the input is returned, else a new one")
            if not inplace:
                assert_all(torch.equal(t, before), "out-of-place allreduce changed its input")
    # The first call negotiates the name (general path); the later ones are express ops, but
    # for one that meets the sleeping engine thread holding the cycle lock while it tests for
    # wake-ups (a moment every WAKE_POLL_S): that one takes the general path.
    assert_all(spy.taken >= 4, f"{spy.taken} of {spy.calls} calls took the express lane")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_express_integer_average_truncates_toward_zero(dtype):
    # Horovod's rule, on the lane's own scaling: -5 over 4 ranks is -1, not -2.
    name = f"express.trunc.{dtype}"
    t = torch.tensor([-2 if rank() == 0 else -1, 3 if rank() == 0 else 1], dtype=dtype)
    want = torch.tensor([-(size() + 1), size() + 2], dtype=torch.float64) / size()
    with _Spy() as spy:
        for step in range(4):
            out = run_all(mpidp.allreduce, t, name=name, op=mpidp.Average)
            check_tensor(out, want.trunc().to(dtype), f"step {step}", exact=True)
    assert_all(spy.taken >= 2, f"{spy.taken} of {spy.calls} calls took the express lane")


@pytest.mark.mpi
def test_express_ops_count_in_stats_and_leave_the_engine_thread_asleep():
    name = "express.stats"
    t = torch.ones(8)
    run_all(mpidp.allreduce, t, name=name, op=mpidp.Sum)
    gather(None)
    before = mpidp.stats()
    eng = _engine()
    threads = []

    def spied(run):
        def spy(*args):
            import threading

            threads.append(threading.current_thread().name)
            return run(*args)

        return spy

    eng._cycle, eng._lone_cycle = spied(eng._cycle), spied(eng._lone_cycle)
    try:
        for _ in range(5):
            run_all(mpidp.allreduce, t, name=name, op=mpidp.Sum)
    finally:
        del eng._cycle, eng._lone_cycle
    after = mpidp.stats()
    delta = after["by_op"]["allreduce"]["bytes"] - before["by_op"]["allreduce"]["bytes"]
    assert_all(delta == 5 * 32, f"allreduce bytes grew by {delta}, not 5 x 32")
    assert_all(after["cache_hits"] - before["cache_hits"] == 5, "express ops are cache hits")
    # (one op may meet the engine thread's wake-up test and be run by that thread)
    assert_all(threads.count("MainThread") >= 4, f"cycles ran on {threads}")


@pytest.mark.mpi(min_size=2)
def test_express_op_meets_a_peer_with_other_ops_in_flight():
    """The last rank has an async op pending when it calls the blocking one (no express for it:
    its band carries two bits); the others' express bands come back with their own bit alone.
    Then the others submit the pending name too: both complete, exact, nothing hangs."""
    last = rank() == size() - 1
    t = torch.full((4,), float(rank() + 1))
    for name in ("express.peer.a", "express.peer.b"):  # both names get a cache bit
        run_all(mpidp.allreduce, t, name=name, op=mpidp.Sum)
    total = float(sum(range(1, size() + 1)))
    with _Spy() as spy:
        handle = mpidp.allreduce_async(t, name="express.peer.b", op=mpidp.Sum) if last else None
        out = run_all(mpidp.allreduce, t, name="express.peer.a", op=mpidp.Sum)
        if not last:
            handle = mpidp.allreduce_async(t, name="express.peer.b", op=mpidp.Sum)
        other = run_all(mpidp.synchronize, handle)
    check_tensor(out, torch.full((4,), total), "blocking op")
    check_tensor(other, torch.full((4,), total), "async op")
    # The last rank cannot take the lane (an op in flight); the others take it unless the
    # engine thread's wake-up test holds the cycle lock at that moment.
    assert_all(spy.taken == 0 if last else spy.taken <= 1, f"express ops taken: {spy.taken}")


@pytest.mark.mpi(min_size=2)
def test_shape_mismatch_after_express_fails_on_every_rank_and_the_name_recovers():
    name = "express.mismatch"
    for _ in range(2):
        run_all(mpidp.allreduce, torch.ones(3), name=name, op=mpidp.Sum)
    shape = (4,) if rank() == 0 else (3,)
    raises_all(mpidp.MismatchError, mpidp.allreduce, torch.ones(shape), name=name, op=mpidp.Sum)
    out = run_all(mpidp.allreduce, torch.ones(3), name=name, op=mpidp.Sum)
    check_tensor(out, torch.full((3,), float(size())), "after the mismatch")


@pytest.mark.mpi
def test_calls_the_express_lane_refuses_still_give_the_general_paths_answers():
    name = "express.refused"
    run_all(mpidp.allreduce, torch.ones(2), name=name)
    # A non-contiguous input is copied by the general path; a tensor that wants a gradient
    # goes through autograd; compression is applied: all give the plain result.
    wide = torch.ones(2, 4)[:, ::2]
    assert_all(not wide.is_contiguous())
    out = run_all(mpidp.allreduce, wide, name=name + ".strided", op=mpidp.Sum)
    check_tensor(out, torch.full((2, 2), float(size())), "strided input")
    w = torch.ones(3, requires_grad=True)
    out = run_all(mpidp.allreduce, w, name=name + ".grad", op=mpidp.Sum)
    out.sum().backward()
    check_tensor(w.grad, torch.full((3,), float(size())), "gradient through the allreduce")
    out = run_all(
        mpidp.allreduce,
        torch.ones(3),
        name=name + ".fp16",
        op=mpidp.Sum,
        compression=mpidp.Compression.fp16,
    )
    assert_all(out.dtype == torch.float32, f"decompressed to {out.dtype}")
    raises_all(TypeError, mpidp.allreduce, [1.0], name=name + ".list")
    raises_all(ValueError, mpidp.allreduce_, wide, name=name + ".strided_inplace")
    # The lane resolves the op only for a new signature: an unknown or unhashable one still
    # gets the general path's message, and the name still works afterwards.
    for bad in ("nope", [1]):
        raises_all(ValueError, mpidp.allreduce_, torch.ones(2), name=name, op=bad, match="op")
    out = run_all(mpidp.allreduce_, torch.ones(2), name=name, op=mpidp.Sum)
    check_tensor(out, torch.full((2,), float(size())), "after refused ops")


@pytest.mark.mpi
def test_express_after_reinit_uses_the_new_engine():
    name = "express.reinit"
    for _ in range(2):
        run_all(mpidp.allreduce, torch.ones(2), name=name, op=mpidp.Sum)
    mpidp.shutdown()
    raises_all(mpidp.NotInitializedError, mpidp.allreduce, torch.ones(2), name=name)
    mpidp.init()
    with _Spy() as spy:
        for _ in range(3):
            out = run_all(mpidp.allreduce, torch.ones(2), name=name, op=mpidp.Sum)
    check_tensor(out, torch.full((2,), float(size())), "after init() again")
    assert_all(spy.taken >= 1, f"{spy.taken} express ops after init() again")
