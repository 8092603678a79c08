"""mpidp opens no listening socket of its own: a rank's listening sockets after init() and a round
of every collective are the ones MPI had already opened."""

import json
import textwrap

import pytest

from .launch import SCRIPTS, run

# Run on every rank. Writes rank<N>.json into the directory argv[1]: the listening sockets before
# mpidp, after init() and the ops, after shutdown(), and whether the detector saw sockets opened
# on purpose.
SCRIPT = textwrap.dedent('''
    import json, os, socket, sys, tempfile

    sys.path.insert(0, SCRIPTS)
    from proc_sockets import socket_inodes
    from mpi4py import MPI
    import torch


    def listening():
        """(kind, address, inode) of this process's listening TCP and Unix sockets and bound
        UDP sockets."""
        mine, found = socket_inodes(), set()
        for kind in ("tcp", "tcp6", "udp", "udp6"):
            try:
                with open(f"/proc/net/{kind}") as f:
                    rows = f.read().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                cols = row.split()
                inode = int(cols[9])
                # TCP: state 0A is LISTEN. UDP has no listen(): any bound socket receives.
                if inode in mine and (kind.startswith("udp") or cols[3] == "0A"):
                    found.add((kind, cols[1], inode))
        with open("/proc/net/unix") as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                inode = int(cols[6])
                # __SO_ACCEPTCON (0x10000) in Flags: the socket has called listen().
                if inode in mine and int(cols[3], 16) & 0x10000:
                    found.add(("unix", cols[7] if len(cols) > 7 else "", inode))
        return found

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    # Let MPI open whatever it opens on first use before the first snapshot.
    world.allreduce(rank)
    world.Barrier()

    # The detector must see sockets that do listen.
    probe_tcp = socket.socket()
    probe_tcp.bind(("127.0.0.1", 0))
    probe_tcp.listen()
    probe_path = os.path.join(tempfile.mkdtemp(), "probe.sock")
    probe_unix = socket.socket(socket.AF_UNIX)
    probe_unix.bind(probe_path)
    probe_unix.listen()
    seen = listening()
    probes = {"tcp": any(k == "tcp" and i == os.fstat(probe_tcp.fileno()).st_ino
                         for k, _, i in seen),
              "unix": any(k == "unix" and i == os.fstat(probe_unix.fileno()).st_ino
                          for k, _, i in seen)}
    probe_tcp.close()
    probe_unix.close()
    os.unlink(probe_path)

    before = listening()
    import mpidp
    mpidp.init()
    n = mpidp.size()
    assert mpidp.allreduce(torch.ones(3), op=mpidp.Sum, name="a").tolist() == [float(n)] * 3
    assert mpidp.allreduce(torch.ones(300_000)).shape == (300_000,)
    mpidp.grouped_allreduce([torch.ones(2), torch.ones(5)], name="g")
    assert mpidp.allgather(torch.tensor([rank])).tolist() == list(range(n))
    assert mpidp.broadcast(torch.tensor([rank]), n - 1).tolist() == [n - 1]
    mpidp.alltoall(torch.arange(2 * n))
    mpidp.reducescatter(torch.ones(2 * n))
    mpidp.broadcast_object({"rank": rank}, 0)
    mpidp.barrier()
    mpidp.join()
    during = listening()
    mpidp.shutdown()
    after = listening()
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as out:
        json.dump({"rank": rank, "probes": probes, "before": sorted(before),
                   "during": sorted(during), "after": sorted(after)}, out)
''')


@pytest.mark.parametrize("n", [2, 3])
def test_mpidp_adds_no_listening_socket(n, tmp_path):
    script = tmp_path / "listening_sockets.py"
    script.write_text(f"SCRIPTS = {str(SCRIPTS)!r}\n" + SCRIPT)
    res = run(n, script, tmp_path, timeout=120)
    assert res.returncode == 0, res.output
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in reports) == list(range(n)), res.output
    for r in reports:
        assert r["probes"] == {"tcp": True, "unix": True}, (
            f"rank {r['rank']}: the detector missed a socket opened on purpose: {r}"
        )
        before = {tuple(s) for s in r["before"]}
        added = [s for s in map(tuple, r["during"] + r["after"]) if s not in before]
        assert not added, f"rank {r['rank']}: mpidp added listening sockets {added}"
