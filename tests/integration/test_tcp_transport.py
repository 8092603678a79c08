"""MPI forced onto TCP (tests/run_tcp_env.sh): the ranks really talk over TCP; mpidp stays right."""

import json
import subprocess

import pytest

from .launch import ROOT, SCRIPTS, clean_shm, run, shm_files

ENV_SCRIPT = ROOT / "tests" / "run_tcp_env.sh"

# Runs inside the job: mpidp allreduces (small, then 4 MB), then every rank lists the TCP
# connections its own sockets hold, and rank 0 pairs them up: rank a talks to rank b over TCP
# when one of a's connections has b's local endpoint as its remote one. Each rank also counts
# the bytes its TCP connections received during the 4 MB allreduce (the kernel's
# tcpi_bytes_received, at offset 128 of struct tcp_info, Linux 4.1 and later).
JOB = r"""
import json, os, socket, struct, sys
sys.path.insert(0, SCRIPTS)
from proc_sockets import socket_inodes
from mpi4py import MPI
import torch
import mpidp

BIG = 1 << 20

def received():
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:["):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET,
                                                                   socket.AF_INET6):
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
                total += struct.unpack_from("Q", info, 128)[0]
        except OSError:
            pass
        finally:
            sock.close()
    return total

mpidp.init()
rank, size = mpidp.rank(), mpidp.size()
ok = True
for numel in (7, BIG):
    t = torch.full((numel,), float(rank + 1))
    before = received()
    out = mpidp.allreduce(t, name=f"tcp.{numel}", op=mpidp.Sum)
    got = received() - before
    ok = ok and bool(torch.all(out == size * (size + 1) / 2))

def established():
    mine, pairs = socket_inodes(), []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            col = row.split()
            if col[3] == "01" and int(col[9]) in mine:   # 01: ESTABLISHED
                pairs.append((col[1], col[2]))
    return pairs

mine = {"ok": ok, "local_size": mpidp.local_size(), "cross_size": mpidp.cross_size(),
        "tcp_bytes_in": got, "tensor_bytes": 4 * BIG}
conns = MPI.COMM_WORLD.gather(established(), root=0)
facts = MPI.COMM_WORLD.gather(mine, root=0)
if rank == 0:
    owner = {local: r for r, pairs in enumerate(conns) for local, _ in pairs}
    linked = sorted({tuple(sorted((r, owner[remote])))
                     for r, pairs in enumerate(conns) for _, remote in pairs
                     if remote in owner and owner[remote] != r})
    print("RESULT " + json.dumps({"facts": facts, "linked": linked,
                                  "connections": [len(p) for p in conns]}), flush=True)
# One rank's shutdown() stops every rank's engine: wait until all are done with mpidp.
MPI.COMM_WORLD.Barrier()
mpidp.shutdown()
"""


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "tcp_job.py"
    path.write_text(f"SCRIPTS = {str(SCRIPTS)!r}\n" + JOB)
    before = shm_files()
    yield path
    clean_shm(before)


def tcp_env() -> dict:
    """The variables tests/run_tcp_env.sh exports, read from the script itself."""
    text = subprocess.run(
        ["bash", str(ENV_SCRIPT)], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    env = {}
    for line in text.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        env[name] = value
    assert set(env) == {"MPIR_CVAR_NOLOCAL", "MPIR_CVAR_CH4_NETMOD", "FI_PROVIDER"}, text
    return env


def result(res) -> dict:
    assert res.returncode == 0, res.output
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, res.output
    return json.loads(lines[0][len("RESULT ") :])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [2, 3])
def test_ranks_talk_over_tcp_and_results_are_right(job, n):
    out = result(run(n, job, env=tcp_env(), timeout=150))
    assert all(f["ok"] for f in out["facts"]), out
    # Every rank is a node of its own, as on n hosts with one rank each.
    assert all(f["local_size"] == 1 and f["cross_size"] == n for f in out["facts"]), out
    # No data moved but over TCP, so the rank-to-rank connections must join all n ranks.
    assert connected(n, out["linked"]), out
    # And the 4 MB went through them: whatever the algorithm, an allreduce's every rank
    # receives at least (n-1)/n of the tensor (the allgather half alone needs that).
    for f in out["facts"]:
        assert f["tcp_bytes_in"] >= f["tensor_bytes"] * (n - 1) / n, out


def connected(n: int, pairs) -> bool:
    """Whether the ranks 0..n-1 form one component over the given links."""
    reached, frontier = {0}, [0]
    while frontier:
        a = frontier.pop()
        for x, y in pairs:
            for near, far in ((x, y), (y, x)):
                if near == a and far not in reached:
                    reached.add(far)
                    frontier.append(far)
    return reached == set(range(n))


@pytest.mark.timeout(180)
def test_without_the_variables_ranks_share_memory_and_hold_no_tcp(job):
    # The control: the same job with MPICH's defaults uses shared memory, so the detector above
    # finds no rank-to-rank connection and the ranks share a node.
    env = {name: "" for name in tcp_env()}  # empty: MPICH's and libfabric's defaults
    env["MPIR_CVAR_NOLOCAL"] = "0"
    out = result(run(2, job, env=env, timeout=150))
    assert all(f["ok"] for f in out["facts"]), out
    assert all(f["local_size"] == 2 for f in out["facts"]), out
    assert out["linked"] == [], out
    assert all(f["tcp_bytes_in"] == 0 for f in out["facts"]), out


def test_no_wake_up_is_left_unreceived_at_exit():
    """Over UCX's TCP transport (as across hosts) every rank used to warn at exit of the
    shutdown wake-ups its peers sent after its last cycle ("unexpected tag-receive descriptor
    ... was not matched"): the last cycle now takes them."""
    env = {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "self,tcp"}
    res = run(3, SCRIPTS / "wake_drain.py", env=env, timeout=120)
    assert res.returncode == 0, res.output
    assert res.stdout.count("done") == 3, res.output
    assert "was not matched" not in res.output, res.output
