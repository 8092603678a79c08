"""Ctrl-C landing at any instant of a blocking op that the main thread drives leaves the engine
whole: the cycle lock free, no op left in flight for good, the next op's result right. Python
raises a KeyboardInterrupt right after any call returns, so each trap below sends SIGINT to
this process just after one step of the driving call (taking the cycle lock, admitting the op),
where the handler runs as it would for a Ctrl-C that arrived there."""

import os
import signal
import threading
import time

import pytest
import torch
from mpi_util import assert_all, gather, rank, size

import mpidp
from mpidp.engine import interrupts


def _engine():
    return mpidp.runtime.world.state().engine


class _LockTrap:
    """The engine's cycle lock, but the `nth` time the main thread takes it, a SIGINT."""

    def __init__(self, lock, nth: int):
        self.lock, self.left = lock, nth

    @property
    def sprung(self) -> bool:
        return self.left <= 0

    def acquire(self, *args, **kwargs):
        got = self.lock.acquire(*args, **kwargs)
        if got and threading.current_thread() is threading.main_thread():
            self.left -= 1
            if self.left == 0:
                os.kill(os.getpid(), signal.SIGINT)
        return got

    def release(self):
        self.lock.release()

    def locked(self):
        return self.lock.locked()

    def __enter__(self):
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


@pytest.fixture
def ctrl_c_handler():
    """mpidp's SIGINT handler, as init() installs it where Python's own is in place (a
    launcher may start the ranks with SIGINT ignored)."""
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, interrupts._on_sigint)
    yield
    interrupts._pending = False
    signal.signal(signal.SIGINT, before)


# A trap springs only where the main thread takes the cycle lock (or admits the op) itself. The
# engine thread may hold the lock at that instant (a peer that waits for this rank wakes it), and
# the main thread then leaves the op to it: that try traps nothing, so another one is made.
TRIES = 6


def _interrupted_then_whole(name, arm, disarm, tries: int = TRIES):
    """Every rank, up to `tries` times in step: arm a trap, run a blocking allreduce of
    `name(i)` (a str: the same name each try), expect the KeyboardInterrupt wherever the trap
    sprang and none elsewhere; then check (collectively) that the engine is whole and the name
    reduces right again. Until the trap has sprung on every rank at least once."""
    eng = _engine()
    sprung_once = False
    for i in range(tries):
        this = name if isinstance(name, str) else name(i)
        sprung = arm(eng)
        try:
            mpidp.allreduce(torch.ones(3), name=this, op=mpidp.Sum)
            raised = False
        except KeyboardInterrupt:
            raised = True
        finally:
            disarm(eng)
        lock_free = eng.cycle_lock.acquire(timeout=5.0)
        if lock_free:
            eng.cycle_lock.release()
        else:
            eng.cycle_lock.release()  # kept by the interrupted call: free it for the tests after
        deadline = time.monotonic() + 10.0
        while eng.queue.ops and time.monotonic() < deadline:  # the op goes on without its caller
            time.sleep(0.01)
        left = sorted(eng.queue.ops)
        for stuck in left:
            eng.queue.finished(eng.queue.ops[stuck])
        assert_all(
            raised == sprung(),
            f"rank {rank()}: trap sprung {sprung()}, KeyboardInterrupt raised {raised}",
        )
        assert_all(lock_free, f"rank {rank()}: the cycle lock stayed taken after the Ctrl-C")
        assert_all(not left, f"rank {rank()}: ops {left} stayed in flight for good")
        gather(None)
        out = mpidp.allreduce(torch.full((3,), float(rank() + 1)), name=this, op=mpidp.Sum)
        want = float(size() * (size() + 1) // 2)
        assert_all(
            torch.equal(out, torch.full((3,), want)), f"rank {rank()}: {out} after the Ctrl-C"
        )
        sprung_once = sprung_once or sprung()
        if all(gather(sprung_once)):
            return
    assert_all(sprung_once, f"rank {rank()}: the trap never sprang in {tries} tries")


def _trap_lock(nth):
    def arm(eng):
        trap = eng.cycle_lock = _LockTrap(eng.cycle_lock, nth)
        return lambda: trap.sprung

    def disarm(eng):
        eng.cycle_lock = eng.cycle_lock.lock

    return arm, disarm


@pytest.mark.mpi
def test_ctrl_c_as_an_express_op_takes_the_cycle_lock(ctrl_c_handler):
    name = "ctrl_c.express"
    for _ in range(2):  # negotiated: the next call is an express op
        mpidp.allreduce(torch.ones(3), name=name, op=mpidp.Sum)
    _interrupted_then_whole(name, *_trap_lock(1))


@pytest.mark.mpi
def test_ctrl_c_as_a_driven_op_takes_the_cycle_lock(ctrl_c_handler):
    # A new name each try: the express lane takes the lock first and declines (not
    # negotiated), then drive() takes it to run the op's cycles.
    _interrupted_then_whole(lambda i: f"ctrl_c.driven.{i}", *_trap_lock(2))


@pytest.mark.mpi
def test_ctrl_c_as_an_express_op_is_admitted(ctrl_c_handler):
    name = "ctrl_c.admitted"
    for _ in range(2):
        mpidp.allreduce(torch.ones(3), name=name, op=mpidp.Sum)

    def arm(eng):
        hold = eng.queue.hold
        sprung = []

        def trapped(entry):
            admitted = hold(entry)
            if admitted:
                sprung.append(True)
                os.kill(os.getpid(), signal.SIGINT)
            return admitted

        eng.queue.hold = trapped
        return lambda: bool(sprung)

    def disarm(eng):
        del eng.queue.hold

    _interrupted_then_whole(name, arm, disarm)
