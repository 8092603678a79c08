"""How a thread waits for MPI requests: yields while someone waits, paced sleeps otherwise."""

import os
import time

# How a thread that waits for a result waits (wait() with `spin`): it tests the request and
# yields the core between tests, as MPICH's own blocking wait does. MPICH advances a non-blocking
# collective only inside Test(), so a collective of several rounds is paced by the gaps between
# tests; and where ranks share cores (more ranks than cores, data-loader workers), a yield hands
# the core to the peer this rank waits for at once, where a sleep of even 20 us costs a timer
# wake-up and, doubled, up to a millisecond a round (issue 27: 0.8-1 ms per blocking 4 B
# allreduce at n=3-4 on 2 cores). After YIELD_S of yielding the wait turns to sleeps, so a
# rank blocked on a peer that is seconds late (a straggler, a stalled rank) does not hold a core.
YIELD_S = 10e-3
POLL_EVERY_S = 1e-3  # poll()'s pace while yielding
SLEEP_MAX_S = 1e-3
# The longest sleep between tests of a data collective whose bytes cross the network while a
# backward pass has the core: MPICH's TCP transport moves bytes only inside a test, so sleeps
# of up to 1 ms left a 1 Gbit/s link idle and a reduction overlapped with the backward pass was
# slower than one after it (ResNet-18 at 1gbe, 2 x 1: 498-518 ms against 471-491; with 30 us,
# 444-447 ms, BENCHMARKS.md "The network wait's sleeps"). Where a test reads 2 MiB from a
# socket (UCX's TCP segment as mpidp sets it, runtime/ucx_segment.py) and the link was measured
# slow, 1 ms sleeps keep it fed at half the CPU: the backward pass gets the difference.
NETWORK_SLEEP_MAX_S = 30e-6
NETWORK_SLEEP_LONG_S = 1e-3


def wait(request, spin: bool = True, poll=None, status=None) -> None:
    """Complete a non-blocking MPI request. With `spin` (a thread waits for this result, so the
    CPU is ours): test and yield between tests for up to YIELD_S, then poll with a bounded
    back-off. Without it (a backward pass needs the core): the back-off at once. `poll()`, if
    given, is called between tests once the request has waited POLL_EVERY_S while yielding,
    and after each sleep (the engine uses it to wake sleeping peers it waits for). `status`: an
    MPI.Status (calls.new_status()) that receives the completed request's status."""
    if request.Test(status):
        return
    # No poll() at once: its reasons (a stall, a stop) are seconds in the making, and at once it
    # would cost a blocking call that waits a few microseconds for its peers about a tenth of
    # its time (the express lane, issue 27).
    if spin:
        now = time.perf_counter()
        end, next_poll = now + YIELD_S, now + POLL_EVERY_S
        while True:
            if request.Test(status):
                return
            os.sched_yield()
            now = time.perf_counter()
            if now >= end:
                break
            if poll is not None and now >= next_poll:
                poll()
                next_poll = now + POLL_EVERY_S
    delay = 20e-6
    while not request.Test(status):
        time.sleep(delay)
        delay = min(delay * 2, SLEEP_MAX_S)
        if poll is not None:
            poll()


def complete(test, wait, busy, network: float) -> None:
    """Complete what `test()`/`wait()` poll and wait for: the blocking wait where no `busy()`
    is given or a user thread waits, else paced(). Synchronization: that of the request's
    collective, nothing of its own."""
    if busy is None or busy():
        wait()
    else:
        paced(test, wait, busy, network)


def complete_in_order(requests, bounds, drain, busy, network: float) -> None:
    """Complete `requests` in order, `drain(lo, hi)` each as soon as it is done, waiting as
    complete() does, with one back-off for them all: started anew per piece, the sleeps would
    climb from 20 us again for every piece (a 1 MiB piece takes 8 ms at 1 Gbit/s).
    Synchronization: that of the requests' collectives, nothing of its own."""
    delay = 20e-6
    for request, (lo, hi) in zip(requests, bounds):
        if busy is None or busy():
            request.Wait()
        else:
            delay = paced(request.Test, request.Wait, busy, network, delay)
        drain(lo, hi)


def paced(done, finish, busy, network: float, delay: float = 20e-6) -> float:
    """Test with `done()` until it is true, giving the core away between tests
    (calls.allreduce says how); `finish()` (the blocking wait) as soon as `busy()` turns true.
    Returns the sleep the back-off, which starts at `delay`, had reached. Synchronization: none
    of its own."""
    while not done():
        if busy():
            finish()
            break
        if network:
            time.sleep(delay)
            delay = min(delay * 2, network)
        else:
            os.sched_yield()
    return delay
