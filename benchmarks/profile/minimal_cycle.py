"""The floor under a blocking allreduce's latency: one negotiated cycle with no engine around it.

    mpiexec -n 2 python benchmarks/profile/minimal_cycle.py [--iters 2000] [--trials 15]

What the express lane must do at least, written as directly as Python allows: a memo lookup,
a lock, a 3-word band Iallreduce (bitwise AND) spun on Test, an out-of-place 4 B Iallreduce +
Wait into a new tensor. No checks, no stats, no error handling: a measuring stick, not an
implementation. Prints its warm median, then its median after 0.2 s of sleep against raw MPI
(one Allreduce, and two in a row) timed the same way, every sample the largest over the ranks.

Then the pieces after the same sleep, as ratios to the raw Allreduce: `torch.empty_like` of the
4 B tensor alone, one Iallreduce spun on Test, and the two together (an out-of-place allreduce
with no negotiation, no lookup and no lock at all): what any allreduce that returns a new
tensor pays after idling, whatever its engine.
"""

import argparse
import statistics
import threading
import time

import numpy as np
import torch
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
CONTROL, DATA = WORLD.Dup(), WORLD.Dup()
_lock = threading.Lock()
_memo = {}
_SENT = bytes([1]) + bytes(7) + b"\xff" * 16  # bit 0 set; no invalid bit, no flag


def cycle(t: torch.Tensor, name: str) -> torch.Tensor:
    key = (name, t.dtype, t.shape, t.device)
    sent = _memo.get(key) or _memo.setdefault(key, _SENT)
    with _lock:
        band = bytearray(sent)
        req = CONTROL.Iallreduce(MPI.IN_PLACE, [band, MPI.UINT64_T], op=MPI.BAND)
        while not req.Test():
            pass
        if band != sent:
            raise RuntimeError("the peers negotiated something else")
        out = torch.empty_like(t)
        DATA.Iallreduce(
            [MPI.buffer.fromaddress(t.data_ptr(), 4), MPI.FLOAT],
            [MPI.buffer.fromaddress(out.data_ptr(), 4), MPI.FLOAT],
            op=MPI.SUM,
        ).Wait()
        return out


def after_sleep(fn, trials: int) -> float:
    samples = []
    for _ in range(trials):
        WORLD.Barrier()
        time.sleep(0.2)
        t0 = time.perf_counter()
        fn()
        samples.append(WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return statistics.median(samples)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--trials", type=int, default=15)
    args = ap.parse_args()
    t = torch.ones(1)
    a = np.ones(1, dtype=np.float32)
    for _ in range(300):
        cycle(t, "x")
    WORLD.Barrier()
    warm = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        cycle(t, "x")
        warm.append(time.perf_counter() - t0)
    warm_us = WORLD.allreduce(statistics.median(warm), op=MPI.MAX) * 1e6
    cold = after_sleep(lambda: cycle(t, "x"), args.trials) * 1e6
    raw = after_sleep(lambda: DATA.Allreduce(MPI.IN_PLACE, a), args.trials) * 1e6
    raw2 = (
        after_sleep(
            lambda: (CONTROL.Allreduce(MPI.IN_PLACE, a), DATA.Allreduce(MPI.IN_PLACE, a)),
            args.trials,
        )
        * 1e6
    )
    if WORLD.rank == 0:
        print(
            f"minimal cycle, np={WORLD.size}: warm median {warm_us:.1f} us; after 0.2 s "
            f"sleep {cold:.1f} us, raw Allreduce {raw:.1f} us ({cold / raw:.2f} x), two raw "
            f"Allreduces {raw2:.1f} us"
        )
    pieces = [
        ("empty_like", lambda: torch.empty_like(t)),
        ("spun Iallreduce", lambda: spun(t)),
        ("empty_like + spun Iallreduce", lambda: spun(t, torch.empty_like(t))),
        ("raw Allreduce", lambda: DATA.Allreduce(MPI.IN_PLACE, a)),
    ]
    cold = {what: after_sleep(fn, args.trials) for what, fn in pieces}
    if WORLD.rank == 0:
        print(
            "after 0.2 s sleep, / raw Allreduce: "
            + ", ".join(
                f"{what} {cold[what] * 1e6:.1f} us ({cold[what] / cold['raw Allreduce']:.2f} x)"
                for what, _ in pieces
            )
        )


def spun(t: torch.Tensor, out=None) -> None:
    """One 4 B Iallreduce of `t` (into `out`, or in place), spun on Test as the lane spins."""
    send = MPI.buffer.fromaddress(t.data_ptr(), 4)
    req = DATA.Iallreduce(
        MPI.IN_PLACE if out is None else [send, MPI.FLOAT],
        [send if out is None else MPI.buffer.fromaddress(out.data_ptr(), 4), MPI.FLOAT],
        op=MPI.SUM,
    )
    while not req.Test():
        pass


if __name__ == "__main__":
    main()
