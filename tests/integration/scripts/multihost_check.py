"""Across real hosts: topology, the core collectives, a mismatch, the allreduce path, TCP peers.

Usage: multihost_check.py HOSTS PER_HOST [--hierarchical] [--tcp-to NAME=ADDR,...]

HOSTS (comma-separated) are the host names in launch order, PER_HOST ranks on each (hydra fills
each host's slots in order). Every rank checks everything, then all verdicts are gathered, so a
failure anywhere makes every rank print it and exit 1. `--hierarchical`: the engine must use
the hierarchical allreduce (the job sets MPIDP_HIERARCHICAL_ALLREDUCE=1 and nothing simulated).
`--tcp-to`: each rank must hold an ESTABLISHED TCP connection to every other host's address.
"""

import argparse
import json
import os
import socket
import sys

import torch
from proc_sockets import socket_inodes  # this script's directory is on sys.path

import mpidp

parser = argparse.ArgumentParser()
parser.add_argument("hosts")
parser.add_argument("per_host", type=int)
parser.add_argument("--hierarchical", action="store_true")
parser.add_argument("--tcp-to", default="")
args = parser.parse_args()
hosts = args.hosts.split(",")

mpidp.init()
rank, size = mpidp.rank(), mpidp.size()
failures = []


def check(ok, what):
    if not ok:
        failures.append(f"rank {rank}: {what}")


# -- topology ------------------------------------------------------------------------------------
me = socket.gethostname()
names = mpidp.allgather_object(me)
want_host = hosts[rank // args.per_host]
check(size == len(hosts) * args.per_host, f"size {size}")
check(me == want_host, f"runs on {me}, expected {want_host} (all: {names})")
check(len(set(names)) == len(hosts), f"distinct host names {sorted(set(names))}")
topo = (mpidp.local_rank(), mpidp.local_size(), mpidp.cross_rank(), mpidp.cross_size())
want = (rank % args.per_host, args.per_host, rank // args.per_host, len(hosts))
check(topo == want, f"local_rank/local_size/cross_rank/cross_size {topo}, expected {want}")
check(mpidp.is_homogeneous(), "not homogeneous")
check(not os.environ.get("MPIDP_SIMULATED_LOCAL_SIZE"), "simulated nodes in a multi-host test")

# -- the allreduce path --------------------------------------------------------------------------
# The data path the engine picked for CPU tensors (MPI on host memory here).
cpu_path = mpidp.runtime.world.state().engine.backend.routes["cpu"]
check(
    cpu_path.hierarchical == args.hierarchical,
    f"engine hierarchical={cpu_path.hierarchical}, expected {args.hierarchical}",
)

# -- collectives ---------------------------------------------------------------------------------
# Lengths that the local size divides and that it does not (the hierarchy's flat tail), small
# (fused) and large (a buffer of its own, 4 MB).
for n in (1, 3, 1000, 1 << 20):
    x = torch.arange(n, dtype=torch.float32) + rank
    total = torch.arange(n, dtype=torch.float64) * size + size * (size - 1) / 2
    got = mpidp.allreduce(x, op=mpidp.Sum, name=f"sum.{n}")
    check(torch.equal(got.double(), total), f"allreduce Sum of {n}")
    avg = mpidp.allreduce(x, name=f"avg.{n}")
    check(torch.allclose(avg.double(), total / size), f"allreduce Average of {n}")
ints = mpidp.allreduce(torch.tensor([rank, -rank], dtype=torch.int64), op=mpidp.Max, name="max")
check(ints.tolist() == [size - 1, 0], f"allreduce Max {ints.tolist()}")
handles = [
    mpidp.allreduce_async(torch.full((17,), float(rank * i)), op=mpidp.Sum, name=f"fused.{i}")
    for i in range(8)
]
for i, h in enumerate(handles):
    check(
        torch.equal(mpidp.synchronize(h), torch.full((17,), float(i * size * (size - 1) / 2))),
        f"fused allreduce {i}",
    )

gathered = mpidp.allgather(torch.full((rank + 1, 2), float(rank)), name="gather")
want_rows = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(size)])
check(torch.equal(gathered, want_rows), "allgather with per-rank row counts")

for root in (0, size - 1):
    b = mpidp.broadcast(torch.full((5,), float(rank)), root, name=f"bcast.{root}")
    check(torch.equal(b, torch.full((5,), float(root))), f"broadcast from {root}")

splits = torch.tensor([r + 1 for r in range(size)])  # rank r gets r+1 rows from everyone
sent = torch.cat([torch.full((r + 1, 3), float(rank * 100 + r)) for r in range(size)])
received, got_splits = mpidp.alltoall(sent, splits=splits, name="alltoall")
want_recv = torch.cat([torch.full((rank + 1, 3), float(src * 100 + rank)) for src in range(size)])
check(
    torch.equal(received, want_recv) and got_splits.tolist() == [rank + 1] * size,
    f"alltoall with splits, received splits {got_splits.tolist()}",
)

rows = torch.arange(2 * size * 3, dtype=torch.float32).reshape(2 * size, 3)
mine = mpidp.reducescatter(rows + rank, op=mpidp.Sum, name="rs")
want_rs = (rows * size + size * (size - 1) / 2)[2 * rank : 2 * rank + 2]
check(torch.equal(mine, want_rs), "reducescatter Sum")

# -- a mismatch fails every rank, and the next collective still works ----------------------------
shape = (4,) if rank == size - 1 else (3,)
try:
    mpidp.allreduce(torch.ones(shape), name="mismatch")
    check(False, "a shape mismatch raised nothing")
except mpidp.MismatchError as e:
    check("(3,)" in str(e) and "(4,)" in str(e), f"mismatch message: {e}")
after = mpidp.allreduce(torch.ones(2), op=mpidp.Sum, name="after.mismatch")
check(torch.equal(after, torch.full((2,), float(size))), "allreduce after the mismatch")


# -- receives from any source (torch.distributed's recv without src) -----------------------------
# Rank 0 takes one message from every other rank, most of them from other hosts: its first
# receive starts before the messages are sent, the others after the first has matched (a
# posted receive from any source started then once missed the second message from another
# host and waited for ever: the waits have a deadline here).
import threading  # noqa: E402

from mpidp.distributed import p2p  # noqa: E402

if rank == 0:
    senders = []
    first = p2p.recv(None, torch.zeros(2), None, 5)
    mpidp.barrier()

    def _take_all():
        work = first
        for i in range(size - 1):
            if i:
                work = p2p.recv(None, torch.zeros(2), None, 5)
            got = work.result()[0]
            senders.append((work.source_rank(), got.tolist()))

    taker = threading.Thread(target=_take_all, daemon=True)
    taker.start()
    taker.join(30)
    check(
        sorted(senders) == [(r, [float(r), 1.0]) for r in range(1, size)],
        f"receives from any source got {sorted(senders)} (one from each of ranks 1..{size - 1})",
    )
else:
    mpidp.barrier()
    p2p.send(None, torch.tensor([float(rank), 1.0]), 0, 5).wait()
mpidp.barrier()


# -- where the bytes went: TCP connections held by this process ----------------------------------
def tcp_peers():
    """Remote IPv4 addresses of the ESTABLISHED TCP connections of this process's sockets."""
    inodes = socket_inodes()
    peers = set()
    with open("/proc/self/net/tcp") as f:
        for row in f.read().splitlines()[1:]:
            col = row.split()
            if col[3] == "01" and int(col[9]) in inodes:
                ip = col[2].split(":")[0]
                peers.add(socket.inet_ntoa(bytes.fromhex(ip)[::-1]))
    return sorted(peers)


peers = tcp_peers()
if args.tcp_to:
    addresses = dict(item.split("=") for item in args.tcp_to.split(","))
    for host, address in addresses.items():
        if host != me and host in hosts:
            check(address in peers, f"no TCP connection to {host} ({address}); peers {peers}")

verdicts = mpidp.allgather_object(failures)
report = {
    "rank": rank,
    "host": me,
    "topology": topo,
    "tcp_peers": peers,
    "hierarchical": cpu_path.hierarchical,
}
print("multihost_check " + json.dumps(report), flush=True)
mpidp.shutdown()
bad = [f for fs in verdicts for f in fs]
if bad:
    print("FAILED:\n" + "\n".join(bad), file=sys.stderr, flush=True)
    sys.exit(1)
print(f"rank {rank}: all checks passed", flush=True)
