"""Slurm over two slurmd "nodes", one per namespace host, with ranks started by `srun --mpi=pmi2`.

The module's fixture builds two hosts (tests/integration/multihost_cluster.py: hosta, hostb,
network and UTS namespaces on a bridge) and a Slurm cluster over them
(tests/integration/slurm_cluster.py): slurmctld and munged in the root namespace, reached by the
hosts at the bridge's address; one `slurmd -N hostX` inside each host. Every daemon, namespace
and the config are removed at the end, also when a test fails. Where Slurm or the hosts cannot
be had (not root, nothing to install them with) the module is skipped, except under CI=true,
where that is a failure.
"""

import sys

import pytest

from mpidp.config import LAUNCHER_PREFIXES

from .cluster_kit import start_or_skip, which
from .launch import ROOT, SCRIPTS
from .multihost_cluster import SUBNET, started
from .slurm_cluster import Node, SlurmCluster

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("clusters")]

CHECK = SCRIPTS / "multihost_check.py"
PY = sys.executable
SLURM_DIR = ROOT / "examples" / "slurm"


@pytest.fixture(scope="module")
def cluster():
    hosts = started(2, "a multi-node Slurm test cluster")
    try:
        nodes = [Node(h.name, h.address, hosts.enter(h.name)) for h in hosts.hosts]
        slurm = start_or_skip(
            SlurmCluster(nodes=nodes, controller_address=f"{SUBNET}.1"),
            "a multi-node Slurm test cluster",
            timeout=60,
            lock_timeout=300,
        )
        try:
            yield hosts, slurm
        finally:
            slurm.stop()  # raises if a daemon it started is still running
    finally:
        hosts.stop()


def job_env(hosts, **extra):
    """hosts.env() without launcher variables (srun must not join a surrounding job), and UCX on
    TCP over the hosts' eth0 only (UCX_TLS for the reason of multihost_cluster.py: every
    namespace shares the boot id).

    Under `srun --mpi=pmi2` across the nodes mpidp.init() itself picks MPICH's OFI netmod
    (mpidp/runtime/slurm_pmi.py: Slurm's PMI-1 server splits the long lines of UCX's address
    exchange), so a job that fails with slurmstepd's "invalid client request" fails its test."""
    env = {
        k: v
        for k, v in hosts.env(UCX_TLS="self,tcp", UCX_NET_DEVICES="eth0").items()
        if not k.startswith(LAUNCHER_PREFIXES + ("PYTEST_",))
    }
    env.update(extra)
    return env


def test_srun_pmi2_over_two_nodes_topology_and_collectives(cluster):
    hosts, _ = cluster
    tcp_to = ",".join(f"{h.name}={h.address}" for h in hosts.hosts)
    res = hosts.run(
        [
            which("srun"),
            "--mpi=pmi2",
            "-N",
            2,
            "-n",
            4,
            "--overcommit",
            "--kill-on-bad-exit=1",
            PY,
            CHECK,
            "hosta,hostb",
            2,
            "--tcp-to",
            tcp_to,
        ],
        timeout=60,
        env=job_env(hosts),
    )
    assert res.returncode == 0, res.output
    assert res.stdout.count("all checks passed") == 4, res.output


@pytest.mark.parametrize("script", ["train_srun.sbatch", "train_mpirun.sbatch"])
def test_batch_script_trains_over_two_nodes(cluster, tmp_path, script):
    """Each batch script as a user submits it, 4 ranks over the two nodes: it trains and ends."""
    hosts, slurm = cluster
    job = slurm.sbatch(
        SLURM_DIR / script,
        "--epochs",
        1,
        "--checkpoint",
        tmp_path / "checkpoint.pt",
        out_dir=tmp_path,
        sbatch_args=["-N", 2, "-n", 4, "-O"],
        env=job_env(hosts, MPIDP_LOG_LEVEL="info"),
        timeout=180,
    )
    assert job.returncode == 0, job
    assert "on hosta,hostb" in job.output, job  # the scripts' first line: the allocation
    assert "with 4 rank(s)" in job.output, job
    assert [ln for ln in job.output.splitlines() if ln.startswith("final test accuracy:")], job
    netmod_note = job.output.count("MPICH_CH4_NETMOD=ofi was set")
    assert netmod_note == (1 if script == "train_srun.sbatch" else 0), job
