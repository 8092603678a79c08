"""The floor of a negotiated blocking allreduce when ranks share cores: MPI alone, side by side.

    mpiexec -n 3 python benchmarks/wait_floor.py [--rounds 3] [--iters 400] [--pads 0,8,16]

mpidp's blocking allreduce of a cached name is two collectives on the caller's thread (the
negotiation band, a bitwise-AND Iallreduce of 24 B on one communicator, then the data's
allreduce on another) with Python work around them. This script times, in one job and with no
mpidp code but its wait (engine/mpi/waiting.py), what that shape costs with no Python at all
and with a few microseconds of busy Python per op, beside one raw MPI Allreduce of 4 B:

  raw        comm.Allreduce(IN_PLACE) of one float32
  band+data  the band (mpi.allreduce_band, a thread that waits: yields between tests), then
             Iallreduce + Wait of one float32
  +Nus       the same with N us of busy Python per op, half before the band and half after
  one        the shape of one collective per op instead: an Iallgather of a 96 B record per
             rank (a band with the data of a small op riding in it), with the same wait
  one+Nus    the same with N us of busy Python per op
  torch      raw MPI Allreduce of a one-element torch tensor into a new one (numpy views of
             both): what MPI costs from Python on torch tensors, before any negotiation
  least      the least Python any negotiated blocking call of a torch tensor needs, in today's
             shape: the call's signature looked up in a table (as mpidp's express lane keys
             it), the band, a new output tensor, the data's Iallreduce + Wait; no lock, no
             check, no counter
  least-one  the same least Python in the one-collective shape: the tensor's bytes into this
             rank's record, one Iallgather, every rank's bit compared, the slots summed

Where ranks outnumber cores, a rank's Python work delays the peer that shares its core, so each
microsecond of it costs about twice that per op. A sample is the slowest rank's median over
`--iters` back-to-back calls; the table gives medians over the rounds and ratios to raw.
"""

import argparse
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI
from rounds import order as rounds_order

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

    tensor = torch.ones(1)

    def key(t):
        return ("x", None, 1.0, 1.0, None, False, t.dtype, t.shape, t.device)

    memo = {key(tensor): 5}

    def least():
        if memo[key(tensor)] < 0:
            raise RuntimeError("no bit")
        engine_mpi.allreduce_band(control, band, True)
        out = torch.empty_like(tensor)
        data.Iallreduce(tensor.numpy(), out.numpy(), op=MPI.SUM).Wait()
        return out

    # Views made once: slicing in the call would cost more than the collective.
    slots = np.frombuffer(records, dtype=np.uint8).reshape(-1, 96)
    bits, values = slots[:, 0], slots[:, 8:12].view(np.float32)
    mine = np.frombuffer(record, dtype=np.uint8)
    my_value = mine[8:12].view(np.float32)

    def least_one():
        bit = memo[key(tensor)]
        mine[0] = bit
        my_value[:] = tensor.numpy()
        engine_mpi.wait(control.Iallgather([record, MPI.BYTE], [records, MPI.BYTE]), True)
        if bits.min() != bits.max():
            raise RuntimeError("the ranks' records disagree")
        out = torch.empty_like(tensor)
        values.sum(axis=0, out=out.numpy())
        return out

    if float(least_one()[0]) != data.Get_size() or float(least()[0]) != data.Get_size():
        raise RuntimeError("a least-Python contender reduced wrongly")
    pads = list(map(float, args.pads.split(",")))
    contenders = [("raw", lambda: data.Allreduce(MPI.IN_PLACE, value, op=MPI.SUM))]
    contenders += [("band+data" if us == 0 else f"+{us:g}us", negotiated(us)) for us in pads]
    contenders += [("one" if us == 0 else f"one+{us:g}us", gathered(us)) for us in pads]
    contenders += [
        ("torch", lambda: data.Allreduce(tensor.numpy(), torch.empty_like(tensor).numpy())),
        ("least", least),
        ("least-one", least_one),
    ]
    got = {name: [] for name, _ in contenders}
    for r in range(args.rounds):
        # A new order each round, the same on every rank: a rotation keeps each contender
        # behind the same neighbour, whose after-effects it would then always carry.
        for name, fn in rounds_order(contenders, r):
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
