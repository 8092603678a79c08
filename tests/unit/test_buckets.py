"""How DistributedOptimizer groups parameters into buckets (make_buckets), no MPI."""

import torch

from mpidp.training.buckets import make_buckets


def _params(*numels, dtype=torch.float32):
    return [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in numels]


def _sizes(buckets):
    return [[p.numel() for p in b.params] for b in buckets]


def _names(params):
    return {p: f"p{i}" for i, p in enumerate(params)}


def test_buckets_fill_up_to_the_cap_in_reverse_order():
    ps = _params(10, 20, 30, 40)  # float32: 40, 80, 120, 160 bytes
    assert _sizes(make_buckets(ps, _names(ps), {}, 200)) == [[40], [30, 20], [10]]
    assert _sizes(make_buckets(ps, _names(ps), {}, 0)) == [[40], [30], [20], [10]]


def test_the_first_bucket_closes_once_it_holds_first_cap_bytes():
    ps = _params(10, 20, 30, 5, 40)  # the last layers first: 160, 20, 120, 80, 40 bytes
    # 160 + 20 bytes reach 170 with the second parameter, which stays: the bucket closes after it.
    assert _sizes(make_buckets(ps, _names(ps), {}, 400, first_cap=170)) == [[40, 5], [30, 20, 10]]
    # Reached by the very first parameter: it is alone.
    assert _sizes(make_buckets(ps, _names(ps), {}, 400, first_cap=100)) == [[40], [5, 30, 20, 10]]
    # Never reached: as without first_cap.
    assert _sizes(make_buckets(ps, _names(ps), {}, 400, first_cap=10_000)) == _sizes(
        make_buckets(ps, _names(ps), {}, 400)
    )
    # The cap still bounds the first bucket.
    assert _sizes(make_buckets(ps, _names(ps), {}, 170, first_cap=10_000)) == [
        [40],
        [5, 30],
        [20, 10],
    ]


def test_each_kind_of_parameter_has_its_own_first_bucket():
    wide = _params(30, 30, 30)
    half = _params(30, 30, 30, dtype=torch.float16)  # 60 bytes each
    ps = wide[:1] + half[:1] + wide[1:] + half[1:]
    buckets = make_buckets(ps, _names(ps), {}, 1000, first_cap=100)
    kinds = [(b.params[0].dtype, [p.numel() for p in b.params]) for b in buckets]
    assert kinds == [
        (torch.float16, [30, 30]),  # 120 bytes reach 100 with the second
        (torch.float32, [30]),  # 120 bytes reach 100 at once
        (torch.float32, [30, 30]),
        (torch.float16, [30]),
    ]


def test_groups_are_kept_whole_and_are_not_the_first_bucket():
    ps = _params(10, 20, 30, 40)
    groups = {ps[3]: 0, ps[2]: 0}
    sizes = _sizes(make_buckets(ps, _names(ps), groups, 1000, first_cap=50))
    assert sizes == [[30, 40], [20], [10]]


def test_the_last_bucket_holds_the_first_parameters_up_to_last_cap_bytes():
    ps = _params(10, 20, 30, 5, 40)  # bytes 40, 80, 120, 20, 160 in the model's order
    # 40 + 80 reach 100 with the second parameter: those two are the last bucket, whatever
    # the other buckets' fill leaves (without last_cap the last bucket is [30, 20, 10]).
    assert _sizes(make_buckets(ps, _names(ps), {}, 400, first_cap=170)) == [[40, 5], [30, 20, 10]]
    got = make_buckets(ps, _names(ps), {}, 400, first_cap=170, last_cap=100)
    assert _sizes(got) == [[40, 5], [30], [20, 10]]
    # Buckets before the last fill as before, from the last layer back.
    assert _sizes(make_buckets(ps, _names(ps), {}, 140, last_cap=30)) == [[40], [5, 30], [20], [10]]


def test_a_tail_that_would_hold_everything_changes_nothing():
    ps = _params(10, 20, 30)
    plain = _sizes(make_buckets(ps, _names(ps), {}, 400, first_cap=50))
    assert _sizes(make_buckets(ps, _names(ps), {}, 400, first_cap=50, last_cap=10_000)) == plain
    assert _sizes(make_buckets(ps, _names(ps), {}, 0, last_cap=100)) == [[30], [20], [10]]


def test_a_scrap_left_before_the_last_bucket_joins_it_but_the_first_bucket_stays():
    # A layer's weight then its bias, twice, as in the MLP: the tail takes the first weight
    # (it reaches the mark); the bias left between the buckets before it and it goes with it.
    ps = _params(1000, 1, 1000, 1)
    got = make_buckets(ps, _names(ps), {}, 4004, first_cap=100, last_cap=2000)
    assert _sizes(got) == [[1, 1000], [1, 1000]]
    # The first bucket is never merged into the tail, however small.
    ps = _params(1000, 1, 1, 1)
    got = make_buckets(ps, _names(ps), {}, 8000, first_cap=100, last_cap=2000)
    assert _sizes(got) == [[1, 1, 1], [1000]]


def test_each_kind_of_parameter_has_its_own_last_bucket():
    ps = _params(10, 20) + _params(30, 40, dtype=torch.float64) + _params(50)
    got = make_buckets(ps, _names(ps), {}, 10_000, last_cap=40)
    kinds = [(b.params[0].dtype, _sizes([b])[0]) for b in got]
    # float32: the first parameter's 40 bytes reach the mark; float64: 240 bytes do.
    f32, f64 = torch.float32, torch.float64
    assert kinds == [(f32, [50, 20]), (f64, [40]), (f32, [10]), (f64, [30])]


def test_a_slow_link_sets_the_bucket_caps_left_unset():
    """buckets.bucket_caps: the knobs as they are on a fast link or one host; across a slow
    link the SLOW_LINK_* caps for each knob not set, the knob's value where set."""
    from mpidp import config as cfgmod
    from mpidp.training.buckets import bucket_caps

    plain = cfgmod.load(env={})
    assert bucket_caps(plain, False) == (plain.bucket_bytes, plain.last_bucket_bytes)
    assert bucket_caps(plain, True) == (
        cfgmod.SLOW_LINK_BUCKET_BYTES,
        cfgmod.SLOW_LINK_LAST_BUCKET_BYTES,
    )
    one = cfgmod.load(env={"MPIDP_BUCKET_BYTES": "123"})
    assert bucket_caps(one, True) == (123, cfgmod.SLOW_LINK_LAST_BUCKET_BYTES)
    both = cfgmod.load(env={}, bucket_bytes=0, last_bucket_bytes=0)
    assert bucket_caps(both, True) == (0, 0)
