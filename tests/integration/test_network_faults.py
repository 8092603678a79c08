"""Faults of the network between hosts: a link cut, a link crawling at 1 Mbit/s, packet loss, a
partition that heals (tests/integration/netshape.py shapes the links).

hosta and hostb run one rank each over `1gbe` links (tests/integration/scripts/net_train.py:
deterministic training, a checkpoint every few steps). Every test ends with no process left on
either host. A stall that MPI cannot report (a collective every rank entered, waiting on a peer
it cannot reach) is caught by the engine's call watch (mpidp/engine/call_watch.py) at the stall
knobs' limits.
"""

import re
import sys
import time

import pytest
import torch

from mpidp.engine.call_watch import NEGOTIATION_SLACK_S

from .launch import SCRIPTS
from .multihost_cluster import started
from .test_multihost import _Job

pytestmark = [pytest.mark.timeout(180), pytest.mark.xdist_group("clusters")]

TRAIN = SCRIPTS / "net_train.py"
PY = sys.executable
HOSTS = ("-hosts", "hosta:1,hostb:1", "-n", 2)
STEPS = 80
PAUSE = "0.05"  # seconds between steps: the job runs for about 4 s
SHUTDOWN_S = 10


@pytest.fixture(scope="module")
def cluster():
    c = started(2, "a multi-host test cluster", profile="1gbe")
    yield c
    c.stop()  # raises if a namespace or link survives


@pytest.fixture
def clean(cluster):
    """After each test: links restored, and no process of the job left on any host."""
    yield cluster
    cluster.link_up("hostb")
    cluster.shape("1gbe")
    left = cluster.leftovers(settle=15.0)
    assert not left, f"processes left on the hosts: {left}"


def _train(cluster, out, *extra, env=None):
    return _Job(cluster, *HOSTS, PY, TRAIN, STEPS, out, "--pause", PAUSE, *map(str, extra), env=env)


def _equal_params(a, b):
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    """The final parameters of the uninterrupted run on unshaped-but-for-rate `1gbe` links."""
    out = tmp_path_factory.mktemp("reference") / "full.pt"
    job = _train(cluster, out)
    rc, _ = job.finish(timeout=120)
    assert rc == 0 and "".join(job.out).count("finished") == 2, job.output
    return out


def _stall_env(cluster, warning_s, shutdown_s):
    return cluster.env(MPIDP_STALL_WARNING_S=str(warning_s), MPIDP_STALL_SHUTDOWN_S=str(shutdown_s))


def test_link_down_ends_the_job_naming_the_peers_and_the_checkpoint_resumes_bitwise(
    clean, reference, tmp_path
):
    ckpt = tmp_path / "ckpt.pt"
    job = _train(
        clean,
        tmp_path / "never.pt",
        "--ckpt",
        ckpt,
        "--every",
        10,
        env=_stall_env(clean, 2, SHUTDOWN_S),
    )
    job.wait_for("rank 1: step 25 done")
    clean.link_down("hostb")
    rc, secs = job.finish(timeout=60)
    assert rc != 0, job.output
    assert secs < SHUTDOWN_S + NEGOTIATION_SLACK_S + 5, (
        f"the job took {secs:.1f} s to end:\n{job.output}"
    )
    assert re.search(
        r"\[mpidp 0/2 hosta\] CRITICAL: stall: rank 0 has waited [0-9.]+ s in a "
        r".* \(ranks on other hosts: 1 \(hostb\)\)",
        job.output,
    ), job.output
    assert "rank 0: finished" not in job.output
    # hydra may join two ranks' lines into one: no anchors
    saved = [int(s) for s in re.findall(r"rank 0: saved at step (\d+)", "".join(job.out))]
    assert saved and saved[-1] >= 20, job.output
    clean.link_up("hostb")
    resumed = _Job(
        clean, *HOSTS, PY, TRAIN, STEPS, tmp_path / "resumed.pt", "--ckpt", ckpt, "--resume"
    )
    rc, _ = resumed.finish(timeout=120)
    assert rc == 0, resumed.output
    assert f"rank 1: resumed at step {saved[-1]}" in resumed.output, resumed.output
    assert _equal_params(reference, tmp_path / "resumed.pt")


def test_a_link_at_1_mbit_is_reported_and_the_job_finishes_when_it_recovers(clean, tmp_path):
    job = _train(clean, tmp_path / "out.pt", "--width", 512, env=_stall_env(clean, 2, 0))
    job.wait_for("rank 1: step 10 done")
    clean.shape({"rate_bit_s": 1e6}, hosts=["hostb"])
    deadline = time.monotonic() + 30
    while "WARNING: stall:" not in "".join(job.err) and time.monotonic() < deadline:
        assert job.proc.poll() is None, job.output
        time.sleep(0.1)
    clean.shape("1gbe", hosts=["hostb"])
    rc, _ = job.finish(timeout=90)
    assert rc == 0 and "".join(job.out).count("finished") == 2, job.output
    # Either side waits on the other: each names the ranks of the other host.
    assert re.search(
        r"WARNING: stall: rank (0 has waited [0-9.]+ s in a .* \(ranks on other "
        r"hosts: 1 \(hostb\)\)|1 has waited [0-9.]+ s in a .* \(ranks on other "
        r"hosts: 0 \(hosta\)\))",
        job.output,
    ), job.output


def test_lossy_links_give_the_same_result(clean, reference, tmp_path):
    clean.shape("lossy")
    job = _train(clean, tmp_path / "lossy.pt")
    rc, _ = job.finish(timeout=120)
    assert rc == 0 and "".join(job.out).count("finished") == 2, job.output
    assert _equal_params(reference, tmp_path / "lossy.pt")


def test_a_partition_that_heals_within_the_limit_does_not_end_the_job(clean, reference, tmp_path):
    job = _train(clean, tmp_path / "healed.pt", env=_stall_env(clean, 2, SHUTDOWN_S))
    job.wait_for("rank 1: step 20 done")
    clean.link_down("hostb")
    time.sleep(4)
    clean.link_up("hostb")
    rc, _ = job.finish(timeout=120)
    assert rc == 0 and "".join(job.out).count("finished") == 2, job.output
    assert _equal_params(reference, tmp_path / "healed.pt")
