"""The floor of a negotiated blocking allreduce when ranks share cores: MPI alone, side by side.

    mpiexec -n 3 python benchmarks/wait_floor.py [--rounds 3] [--iters 400]

mpidp's blocking allreduce of a cached name is two collectives on the caller's thread (the
negotiation band, a bitwise-AND Iallreduce of 24 B on one communicator, then the data's
allreduce on another) with Python work around them. This script times, in one job and with no
mpidp code but its wait (engine/mpi.py), what that shape costs with no Python at all and with a
few microseconds of busy Python per op, beside one raw MPI Allreduce of 4 B:

  raw        comm.Allreduce(IN_PLACE) of one float32
  band+data  the band (mpi.allreduce_band, a thread that waits: yields between tests), then
             Iallreduce + Wait of one float32
  +Nus       the same with N us of busy Python per op, half before the band and half after
  one        the shape of one collective per op instead: an Iallgather of a 96 B record per
             rank (a band with the data of a small op riding in it), with the same wait
  one+Nus    the same with N us of busy Python per op

Where ranks outnumber cores, a rank's Python work delays the peer that shares its core, so each
microsecond of it costs about twice that per op. A sample is the slowest rank's median over
`--iters` back-to-back calls; the table gives medians over the rounds and ratios to raw.
"""

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from mpidp.engine import mpi as engine_mpi


def pad(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def timed(comm, fn, iters: int) -> float:
    for _ in range(50):
        fn()
    comm.Barrier()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return comm.allreduce(statistics.median(samples), op=MPI.MAX)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--pads", default="0,8,16", help="busy Python per op, in us")
    args = ap.parse_args()
    data, control = MPI.COMM_WORLD.Dup(), MPI.COMM_WORLD.Dup()
    value = np.ones(1, dtype=np.float32)
    band = bytearray(24)

    def negotiated(us):
        def op():
            pad(us / 2)
            engine_mpi.allreduce_band(control, band, True, lambda: None)
            pad(us / 2)
            data.Iallreduce(MPI.IN_PLACE, value, op=MPI.SUM).Wait()

        return op

    record = bytearray(96)
    records = bytearray(96 * data.Get_size())

    def gathered(us):
        def op():
            pad(us / 2)
            engine_mpi.wait(control.Iallgather([record, MPI.BYTE], [records, MPI.BYTE]), True)
            pad(us / 2)

        return op

    pads = list(map(float, args.pads.split(",")))
    contenders = [("raw", lambda: data.Allreduce(MPI.IN_PLACE, value, op=MPI.SUM))]
    contenders += [("band+data" if us == 0 else f"+{us:g}us", negotiated(us)) for us in pads]
    contenders += [("one" if us == 0 else f"one+{us:g}us", gathered(us)) for us in pads]
    got = {name: [] for name, _ in contenders}
    for r in range(args.rounds):
        order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
        for name, fn in order:
            got[name].append(timed(data, fn, args.iters))
    if data.Get_rank() == 0:
        raw = statistics.median(got["raw"])
        print(f"# n={data.Get_size()}, {args.rounds} rounds of {args.iters} calls")
        for name, samples in got.items():
            med = statistics.median(samples)
            print(
                f"{name:10s} {med * 1e6:8.1f} us  x{med / raw:5.1f} raw   rounds "
                + " / ".join(f"{s * 1e6:.1f}" for s in samples)
            )
    data.Free()
    control.Free()


if __name__ == "__main__":
    main()
