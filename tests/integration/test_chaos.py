"""Chaos, short form: each fault once at 3 ranks must end the job in time, leave no process, name
the rank and host, and resume to the uninterrupted run's parameters (`make chaos`: 100 trials)."""

import os

import pytest

from . import chaos
from .cluster_kit import skip_or_fail

pytestmark = pytest.mark.timeout(300)
N = 3


@pytest.fixture(scope="module")
def reference():
    return chaos.reference(N)


@pytest.mark.parametrize(
    "fault, rank, step",
    [
        ("kill", 2, 3),
        ("term", 1, 2),
        ("raise", 0, 4),
        ("datapath", 1, 3),
        ("stall", 2, 5),
        ("disk", 1, 2),
        ("corrupt", 0, 4),
    ],
)
def test_fault_ends_in_time_and_resumes_bitwise(reference, fault, rank, step):
    if fault == "disk" and os.geteuid() != 0:
        skip_or_fail("a small tmpfs for the full-disk fault", "mounting one needs root")
    got = chaos.trial(N, fault, rank, step, reference)
    bad = [k for k, ok in got.items() if not k.startswith("_") and not ok]
    assert not bad, (
        f"{fault} on rank {rank} at step {step}: {bad} "
        f"({got['_seconds']:.1f} s after the fault)\n{got['_output'][-4000:]}"
    )
