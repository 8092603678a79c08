"""A lone negotiated op that its submitter waits for runs as the express lane runs a blocking
allreduce: taken from the queue by the waiting thread, one band with its bit alone, executed at
once. Every case it does not cover (peers late, other ops in flight) gives the same results."""

import threading
import time

import pytest
import torch
from mpi_util import assert_all, check_tensor, rank, run_all, size

import mpidp
from mpidp import ops

SHAPES = [(3, 4), (5,), (2, 3, 2), ()]


def _engine():
    return mpidp.runtime.world.state().engine


class _Spy:
    """Counts drive()'s lone takes (Engine._hold with queued=True) and the threads that run
    cycles (general ones and a lone op's first)."""

    def __init__(self):
        self.eng = _engine()
        self.lone = self.tries = 0
        self.threads = []

    def __enter__(self):
        hold, cycle, lone = self.eng._hold, self.eng._cycle, self.eng._lone_cycle

        def spy_hold(entry, queued=False):
            taken = hold(entry, queued)
            if queued:
                self.tries += 1
                self.lone += taken
            return taken

        def spied(run):
            def spy(*args):
                self.threads.append(threading.current_thread().name)
                return run(*args)

            return spy

        self.eng._hold, self.eng._cycle = spy_hold, spied(cycle)
        self.eng._lone_cycle = spied(lone)
        return self

    def __exit__(self, *exc):
        del self.eng._hold, self.eng._cycle, self.eng._lone_cycle


def _bucket(step):
    return [torch.full(s, float(rank() + step + 1)) for s in SHAPES]


def _want(step):
    total = sum(r + step + 1 for r in range(size())) / size()
    return [torch.full(s, total) for s in SHAPES]


@pytest.mark.mpi
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_waited_for_bucket_runs_on_the_callers_thread_with_exact_results(blocking):
    name = f"lone.bucket.{blocking}"
    with _Spy() as spy:
        for step in range(6):
            tensors = _bucket(step)
            if blocking:
                with ops.blocking():
                    handle = mpidp.grouped_allreduce_async_(tensors, name=name)
            else:
                handle = mpidp.grouped_allreduce_async_(tensors, name=name)
            out = run_all(mpidp.synchronize, handle)
            for i, (got, want) in enumerate(zip(out, _want(step))):
                check_tensor(got, want, f"step {step}, tensor {i}")
    # The first step negotiates the name through the coordinator; the later ones are cached.
    # An async submission wakes the engine thread, which may hold the cycle lock at the moment
    # the caller drives; a blocking one may meet its wake-up test (every WAKE_POLL_S).
    least = 4 if blocking else 1
    assert_all(spy.lone >= least, f"{spy.lone} of {spy.tries} waits ran the lone op")
    if blocking:
        assert_all(spy.threads.count("MainThread") >= 5, f"cycles ran on {spy.threads}")


@pytest.mark.mpi(min_size=2)
def test_a_lone_op_whose_peers_are_late_waits_for_them_in_its_band():
    """Rank 0 waits for a cached op that the others submit 0.2 s later: its band waits for
    theirs (their engines sleep until then), and the op completes exactly."""
    name = "lone.late"
    t = torch.ones(6)
    run_all(mpidp.allreduce_, t.clone(), name=name, op=mpidp.Sum)  # negotiated: cached now
    with _Spy() as spy:
        if rank() != 0:
            time.sleep(0.2)
        with ops.blocking():
            handle = mpidp.allreduce_async_(t, name=name, op=mpidp.Sum)
        began = time.monotonic()
        out = run_all(mpidp.synchronize, handle)
        waited = time.monotonic() - began
    check_tensor(out, torch.full((6,), float(size())), "late peers")
    assert_all(len(spy.threads) >= 1, f"rank {rank()}: no cycle ran")
    assert_all(rank() != 0 or waited > 0.1, f"rank 0 waited {waited:.3f} s for peers 0.2 s late")


@pytest.mark.mpi
def test_two_ops_in_flight_are_not_lone_and_both_complete():
    names = ("lone.pair.a", "lone.pair.b")
    for name in names:
        run_all(mpidp.allreduce_, torch.ones(3), name=name, op=mpidp.Sum)
    with _Spy() as spy:
        with ops.blocking():
            handles = [
                mpidp.allreduce_async_(torch.full((3,), float(i + 1)), name=name, op=mpidp.Sum)
                for i, name in enumerate(names)
            ]
        outs = [run_all(mpidp.synchronize, h) for h in handles]
    for i, out in enumerate(outs):
        check_tensor(out, torch.full((3,), float((i + 1) * size())), f"op {i}")
    assert_all(spy.lone == 0, f"{spy.lone} lone takes with two ops in flight")
