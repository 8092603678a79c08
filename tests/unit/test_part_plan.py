"""fusion.PartPlanner and parts.FusionBuffers: how a bucket's parts are grouped, and the views
of the fusion buffer each packed group keeps."""

import math

import torch

from mpidp.engine.backends.parts import FusionBuffers
from mpidp.engine.fusion import PartPlanner
from mpidp.engine.messages import OpType, Request, Response

BELOW = 1024  # fuse_below_bytes
THRESHOLD = 4096  # fusion_threshold_bytes


def bucket(name, shapes, dtype="float32"):
    total = sum(math.prod(s) for s in shapes)
    req = Request(name, OpType.ALLREDUCE, dtype, (total,), parts=tuple(shapes))
    return Response(name, OpType.ALLREDUCE, req)


def layout(groups):
    return [(g.packed, g.idx) for g in groups]


def test_small_parts_are_packed_first_and_large_ones_follow_alone_in_order():
    # float32: 300 elements = 1200 bytes (alone), 10 elements = 40 bytes (packed)
    shapes = [(300,), (10,), (20, 30), (2, 5), (4,), (256,)]
    groups = PartPlanner()([bucket("b", shapes)], BELOW, THRESHOLD)
    assert layout(groups) == [(True, [1, 3, 4]), (False, [0]), (False, [2]), (False, [5])]
    packed = groups[0]
    assert packed.shapes == [(10,), (2, 5), (4,)]
    assert packed.numels == [10, 10, 4] and packed.total == 24


def test_packed_groups_close_at_the_threshold():
    shapes = [(200,)] * 12  # 800 bytes each: five fit under 4096
    groups = PartPlanner()([bucket("b", shapes)], BELOW, THRESHOLD)
    assert layout(groups) == [(True, [0, 1, 2, 3, 4]), (True, [5, 6, 7, 8, 9]), (True, [10, 11])]


def test_threshold_zero_reduces_every_part_alone():
    groups = PartPlanner()([bucket("b", [(4,), (8,)])], BELOW, 0)
    assert layout(groups) == [(False, [0]), (False, [1])]


def test_a_fused_batch_of_several_ops_is_one_packed_group():
    batch = [bucket("a", [(4,)]), bucket("b", [(300,)])]
    assert layout(PartPlanner()(batch, BELOW, THRESHOLD)) == [(True, [0, 1])]


def test_the_plan_is_memoized_per_response_and_limits():
    planner = PartPlanner()
    resp = bucket("b", [(300,), (10,)])
    first = planner([resp], BELOW, THRESHOLD)
    assert planner([resp], BELOW, THRESHOLD) is first
    other = planner([resp], BELOW, 0)
    assert other is not first and layout(other) == [(False, [0]), (False, [1])]
    # An equal response that is another object is planned anew (the memo is by identity).
    again = planner([bucket("b", [(300,), (10,)])], BELOW, THRESHOLD)
    assert again is not first and layout(again) == layout(first)


def test_fusion_buffer_views_are_kept_and_share_the_buffer():
    group = PartPlanner()([bucket("b", [(2, 3), (4,), ()])], BELOW, THRESHOLD)[0]
    buffers = FusionBuffers()
    flat, views = buffers.views(group, torch.float32, torch.device("cpu"))
    assert [tuple(v.shape) for v in views] == [(2, 3), (4,), ()]
    assert flat.numel() == 11
    again = buffers.views(group, torch.float32, torch.device("cpu"))
    assert again[0] is flat and again[1] is views
    flat.copy_(torch.arange(11.0))
    assert views[0].flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert views[1].tolist() == [6.0, 7.0, 8.0, 9.0] and views[2].item() == 10.0


def test_a_larger_group_grows_the_buffer_twofold_and_others_rebind():
    planner = PartPlanner()
    small = planner([bucket("s", [(8,), (8,)])], BELOW, THRESHOLD)[0]
    buffers = FusionBuffers()
    cpu = torch.device("cpu")
    flat_small, _ = buffers.views(small, torch.float32, cpu)
    first = flat_small._base
    assert first.numel() == 1024  # the smallest buffer made
    big = planner([bucket("g", [(200,)] * 6)], 4096, 8192)[0]  # 1200 elements packed
    flat_big, _ = buffers.views(big, torch.float32, cpu)
    grown = flat_big._base
    assert grown is not first and grown.numel() == 2048
    flat_again, _ = buffers.views(small, torch.float32, cpu)
    assert flat_again._base is grown  # rebound to the current buffer, not the old one
    # Another dtype has a buffer of its own.
    flat_double, _ = buffers.views(small, torch.float64, cpu)
    assert flat_double.dtype == torch.float64 and flat_double._base is not grown
