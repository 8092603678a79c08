"""The pure parts of benchmarks/scaling_model.py: cost formulas, step model, fit, gradient sets."""

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "scaling_model.py"
_spec = importlib.util.spec_from_file_location("scaling_model", _PATH)
sm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sm)

pytestmark = pytest.mark.timeout(60)

FAB = sm.Fabric.from_us_gbps("test", 5.0, 10.0)


def test_gradient_sets_match_torchvision_counts():
    for model, tensors, params in (("resnet50", 161, 25_557_032), ("resnet101", 314, 44_549_160)):
        sizes = sm.gradient_bytes(model)
        assert len(sizes) == tensors
        assert sum(sizes) == 4 * params


def test_ring_cost_limits():
    n = 100e6
    assert sm.ring_allreduce_time(n, 1, FAB) == 0.0
    assert sm.ring_allreduce_time(n, 2, FAB) == pytest.approx(2 * FAB.alpha + n * FAB.beta)
    # Large p: the bandwidth term tends to 2*n*beta, the latency term grows linearly.
    big = sm.ring_allreduce_time(n, 10**6, FAB)
    assert big - 2 * (10**6 - 1) * FAB.alpha == pytest.approx(2 * n * FAB.beta, rel=1e-5)
    assert sm.ring_allreduce_time(0, 64, FAB) == pytest.approx(2 * 63 * FAB.alpha)


def test_halving_doubling_has_the_ring_bandwidth_and_log_latency():
    for p in (2, 8, 1024):
        ring = sm.ring_allreduce_time(0, p, FAB)
        rd = sm.rd_allreduce_time(0, p, FAB)
        assert rd == pytest.approx(2 * math.log2(p) * FAB.alpha)
        assert rd <= ring
        assert sm.rd_allreduce_time(1e8, p, FAB) - rd == pytest.approx(
            sm.ring_allreduce_time(1e8, p, FAB) - ring
        )


def test_hierarchical_with_one_rank_per_node_is_the_flat_ring():
    intra = sm.PRESETS["nvlink"]
    for p in (2, 64):
        assert sm.hierarchical_allreduce_time(1e7, p, intra, FAB, 1) == pytest.approx(
            sm.ring_allreduce_time(1e7, p, FAB)
        )
    # With 8 per node the cross latency term shrinks 8-fold; bandwidth across is unchanged.
    flat = sm.ring_allreduce_time(0, 1024, FAB)
    hier = sm.hierarchical_allreduce_time(0, 1024, intra, FAB, 8)
    assert hier == pytest.approx(2 * 7 * intra.alpha + 2 * 127 * FAB.alpha)
    assert hier < flat


def test_buckets_cover_every_tensor_once():
    sizes = [5, 1, 7, 3, 3, 9, 2]
    plan = sm.buckets(sizes, 8)
    assert sum(b for _, b in plan) == sum(sizes)
    assert plan[-1][0] == len(sizes) - 1
    assert [i for i, _ in plan] == sorted(i for i, _ in plan)
    assert all(b >= 8 for _, b in plan[:-1])
    assert sm.buckets(sizes, 10**9) == [(len(sizes) - 1, sum(sizes))]


@pytest.mark.parametrize("model", ["resnet50", "resnet101"])
@pytest.mark.parametrize("fabric", list(sm.PRESETS.values()) + [FAB])
@pytest.mark.parametrize("p", [2, 8, 128, 1024])
@pytest.mark.parametrize("bucket_mb", [1, 25, 1000])
def test_overlap_never_worse_and_efficiency_at_most_one(model, fabric, p, bucket_mb):
    grads = sm.gradient_bytes(model)
    plain, over = sm.step_times(
        grads, 0.2, 2 / 3, bucket_mb * sm.MB, lambda n: sm.ring_allreduce_time(n, p, fabric)
    )
    assert 0.2 <= over <= plain + 1e-12
    assert 0 < sm.efficiency(0.2, plain) <= sm.efficiency(0.2, over) <= 1.0


def test_step_model_by_hand():
    # Two tensors of 10 bytes (forward order), buckets of 10: the last tensor is ready first.
    cost = lambda n: n * 0.01  # noqa: E731   0.1 s per bucket
    plain, over = sm.step_times([10, 10], 1.0, 0.5, 10, cost)
    assert plain == pytest.approx(1.2)
    # Backward runs 0.5..1.0; the first bucket is ready at 0.75 and done at 0.85, the second is
    # ready at 1.0 and done at 1.1.
    assert over == pytest.approx(1.1)
    # Communication much faster than compute: all but nothing hides.
    assert sm.step_times([10, 10], 1.0, 0.5, 10, lambda n: 0.0)[1] == pytest.approx(1.0)


def test_no_communication_gives_efficiency_one():
    plain, over = sm.step_times(
        sm.gradient_bytes("resnet50"),
        0.3,
        0.6,
        25 * sm.MB,
        lambda n: sm.ring_allreduce_time(n, 1, FAB),
    )
    assert plain == over == 0.3


def test_fit_recovers_known_alpha_beta():
    rng = np.random.default_rng(0)
    sizes = [4 * 4**k for k in range(13)]
    a, b = 6e-6, 1 / 3e9
    times = [(a + b * n) * (1 + 0.01 * rng.standard_normal()) for n in sizes]
    fit = sm.fit_alpha_beta(sizes, times)
    assert fit["alpha"] == pytest.approx(a / 2, rel=0.05)
    assert fit["beta"] == pytest.approx(b, rel=0.05)
    assert fit["r2"] > 0.999 and fit["max_rel_err"] < 0.05
    exact = sm.fit_alpha_beta(sizes, [a + b * n for n in sizes])
    assert exact["a"] == pytest.approx(a) and exact["b"] == pytest.approx(b)


def test_fit_keeps_coefficients_non_negative():
    sizes = [4, 64, 1024, 16384, 262144]
    # A large time at the smallest size and small ones after: the free fit's slope is negative.
    fit = sm.fit_alpha_beta(sizes, [1e-3, 1e-4, 1e-4, 1e-4, 1e-4])
    assert fit["clamped_to_zero"] == "b" and fit["beta"] == 0.0 and fit["alpha"] > 0
    # Points on t = -1 us + n * 1 ns: the free fit's intercept is negative.
    big = [10_000, 100_000, 1_000_000]
    fit = sm.fit_alpha_beta(big, [-1e-6 + n * 1e-9 for n in big])
    assert fit["clamped_to_zero"] == "a" and fit["alpha"] == 0.0
    assert fit["beta"] == pytest.approx(1e-9, rel=0.1)
    assert sm.fit_alpha_beta(sizes, [1e-6 + n * 1e-9 for n in sizes])["clamped_to_zero"] == ""


def test_more_ranks_never_raise_efficiency_on_a_ring():
    grads = sm.gradient_bytes("resnet101")
    effs = []
    for p in sm.RANKS:
        plain, over = sm.step_times(
            grads,
            0.4,
            2 / 3,
            25 * sm.MB,
            lambda n: sm.ring_allreduce_time(n, p, sm.PRESETS["25gbe"]),
        )
        effs.append((sm.efficiency(0.4, plain), sm.efficiency(0.4, over)))
    for (a_plain, a_over), (b_plain, b_over) in zip(effs, effs[1:]):
        assert b_plain <= a_plain and b_over <= a_over + 1e-12


def test_parse_fabric():
    fab = sm.parse_fabric("roce=3,12.5")
    assert fab.name == "roce" and fab.alpha == pytest.approx(3e-6)
    assert 1 / fab.beta == pytest.approx(12.5e9)
