"""A sleeping engine: no cycles while idle, and an idle rank still learns of a peer's shutdown,
a stall check that names it, and a blocking op driven on the caller's thread."""

import logging
import time

import pytest
import torch
from mpi_util import assert_all, gather, rank, run_all, size

import mpidp


def _reinit(**knobs):
    mpidp.shutdown()
    mpidp.init(**knobs)


def _engine():
    return mpidp.runtime.world.state().engine


@pytest.mark.mpi
def test_an_idle_engine_runs_no_cycles():
    """Between ops nothing runs: no negotiation in lockstep with the peers, so the cycle count
    stays put (the old engine ran about 20 idle cycles a second)."""
    name = "test_an_idle_engine_runs_no_cycles"
    run_all(mpidp.allreduce, torch.ones(2), name=name)
    gather(None)
    eng = _engine()
    before = eng.neg.cycles
    time.sleep(0.4)
    after = eng.neg.cycles
    counts = gather(after)
    assert_all(after == before, f"{after - before} cycles ran while idle")
    assert_all(len(set(counts)) == 1, f"cycle counts differ across ranks: {counts}")


@pytest.mark.mpi
def test_blocking_op_runs_on_the_callers_thread_when_idle():
    """A blocking allreduce on an idle engine is driven by the caller (no hand-off): the engine
    thread stays asleep and the result is exact. The sleeping engine thread takes the cycle lock
    for a moment every WAKE_POLL_S to test for wake-ups; an op submitted in that moment is run
    by the engine thread instead (correct, only slower), so most ops, not all, must show it."""
    name = "test_blocking_op_runs_on_the_callers_thread_when_idle"
    eng = _engine()
    original = eng._cycle
    ops, on_caller, bad = 10, 0, []
    seen = []

    def spy(*args):
        import threading

        seen.append(threading.current_thread().name)
        return original(*args)

    eng._cycle = spy
    try:
        for i in range(ops):
            seen.clear()
            out = run_all(
                mpidp.allreduce,
                torch.full((3,), float(rank() + i)),
                op=mpidp.Sum,
                name=f"{name}.{i}",
            )
            want = float(sum(range(size())) + i * size())
            if out.tolist() != [want] * 3:
                bad.append((i, out.tolist()))
            on_caller += bool(seen) and all(t == "MainThread" for t in seen)
    finally:
        del eng._cycle
    assert_all(not bad, f"wrong results: {bad}")
    assert_all(on_caller >= ops - 2, f"only {on_caller} of {ops} ops ran on the caller's thread")


@pytest.mark.mpi(min_size=2)
def test_idle_ranks_learn_of_a_peer_shutdown():
    """The last rank shuts down while every other rank is idle (nothing pending): their sleeping
    engines are woken, stop within a fraction of a second, and refuse later ops with the
    shutdown message."""
    r, n = rank(), size()

    def body():
        gather(None)
        if r == n - 1:
            mpidp.shutdown()
            return None
        eng = _engine()
        t0 = time.monotonic()
        eng._thread.join(10.0)
        took = time.monotonic() - t0
        if eng._thread.is_alive():
            return "the idle engine was still running 10 s after a peer's shutdown()"
        try:
            mpidp.allreduce(torch.ones(1), name="after.peer.shutdown")
            return "an op after the peer's shutdown was accepted"
        except mpidp.EngineShutdownError as exc:
            if "shut down" not in str(exc):
                return f"unhelpful message: {exc}"
        return None if took < 2.0 else f"the engine took {took:.2f} s to stop"

    try:
        problem = run_all(body)
    finally:
        mpidp.shutdown()
        mpidp.init()
    assert_all(problem is None, problem)
    out = run_all(mpidp.allreduce, torch.ones(1), op=mpidp.Sum, name="after.reinit")
    assert_all(out.item() == size(), f"{out}")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.mpi(min_size=2)
def test_stall_warning_names_a_rank_whose_engine_sleeps():
    """Every rank but the last submits an op; the last sleeps with nothing pending. The waiting
    ranks wake it for a stall check, so rank 0's warning names the missing rank; once the last
    rank submits, the op completes everywhere."""
    name = "test_stall_warning_names_a_rank_whose_engine_sleeps"
    r, n = rank(), size()
    records = _Records()
    logger = logging.getLogger("mpidp")
    logger.addHandler(records)

    def body():
        _reinit(stall_warning_s=0.3)
        if r == n - 1:
            time.sleep(1.5)
        return mpidp.allreduce(torch.ones(1), op=mpidp.Sum, name=name)

    try:
        out = run_all(body)
    finally:
        logger.removeHandler(records)
        _reinit()
    assert_all(out.item() == n, f"{out}")
    if r == 0:
        warned = [m for m in records.messages if "stall" in m and name in m]
        ok = any(f"missing ranks {n - 1}" in m for m in warned)
        msg = f"no stall warning naming rank {n - 1}: {records.messages}"
    else:
        ok, msg = True, ""
    assert_all(ok, msg)
