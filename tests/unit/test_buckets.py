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
