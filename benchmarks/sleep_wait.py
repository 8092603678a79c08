"""What a wait that sleeps between MPI's tests costs across hosts: time and CPU, side by side.

    mpiexec -hosts hosta:1,hostb:1 -n 2 python benchmarks/sleep_wait.py [--mb 23.4] [--rounds 3]
    (on `python -m tests.integration.multihost_cluster up 2 --profile 1gbe`; again with
    `-genv UCX_TCP_RX_SEG_SIZE 64k` for UCX's own segment, and at `--profile 10gbe`)

mpidp's engine reduces a bucket during the backward pass by testing the collective and sleeping
between tests, so as not to take the core the backward pass computes on (engine/mpi/waiting.py).
MPICH's UCX netmod moves bytes over TCP only inside a test, and each test reads at most one receive
segment (UCX_TCP_RX_SEG_SIZE) from a socket: the longest sleep that keeps a link fed depends on it.
This script reduces `--mb` MB of float32 as 1 MiB pieces, all in flight at once (as mpidp sends a
buffer across a slow link), with MPI's own wait (Waitall, which spins) and with tests separated by
sleeps doubling from 20 us up to each cap, and prints per reduction the wall time and this rank's
CPU time (user, system), medians over the rounds, each round alternating the contenders. The
segment in force is what the launch's environment says: mpi4py is imported here without mpidp, so
mpidp's own default (2 MiB, runtime/ucx_segment.py) applies only where this script sets it, which
it does unless the variable is set.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("UCX_TCP_RX_SEG_SIZE", "2m")  # mpidp's default, before MPI starts

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

PIECE = 1 << 20


def reduce_once(comm, buf, cap):
    step = PIECE // buf.itemsize
    reqs = [comm.Iallreduce(MPI.IN_PLACE, buf[lo : lo + step]) for lo in range(0, len(buf), step)]
    if cap == 0:
        MPI.Request.Waitall(reqs)
        return
    delay = 20e-6
    while not MPI.Request.Testall(reqs):
        time.sleep(delay)
        delay = min(delay * 2, cap)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=23.4, help="MB reduced (ResNet-18 in fp16: 23.4)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=3, help="reductions timed per sample")
    ap.add_argument("--caps-us", default="30,250,1000,3000", help="sleep caps to time")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    buf = np.ones(int(args.mb * 1e6) // 4, np.float32)
    caps = [0.0] + [float(c) * 1e-6 for c in args.caps_us.split(",") if c]
    reduce_once(comm, buf, 0.0)  # connections up, buffers touched
    samples = {cap: [] for cap in caps}
    for r in range(args.rounds):
        for cap in caps if r % 2 == 0 else caps[::-1]:
            comm.Barrier()
            c0, t0 = os.times(), time.perf_counter()
            for _ in range(args.calls):
                reduce_once(comm, buf, cap)
            wall = (time.perf_counter() - t0) / args.calls
            c1 = os.times()
            user = (c1.user - c0.user) / args.calls
            system = (c1.system - c0.system) / args.calls
            samples[cap].append((wall, user, system))
    if comm.rank == 0:
        seg = os.environ.get("UCX_TCP_RX_SEG_SIZE")
        print(f"{args.mb} MB float32 in 1 MiB pieces, {comm.size} ranks, UCX_TCP_RX_SEG_SIZE={seg}")
        print("wait                       wall ms   user ms   sys ms   (rank 0, medians)")
        spin = statistics.median(s[0] for s in samples[0.0])
        for cap in caps:
            wall, user, system = (statistics.median(s[i] for s in samples[cap]) for i in range(3))
            name = "Waitall (spins)" if cap == 0 else f"test + sleep <= {cap * 1e6:.0f} us"
            print(
                f"{name:24} {wall * 1e3:8.1f} {user * 1e3:9.0f} {system * 1e3:8.0f}"
                f"   {wall / spin:.2f}x the spin"
            )


if __name__ == "__main__":
    main()
