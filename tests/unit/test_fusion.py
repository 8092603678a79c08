"""fusion.plan: which allreduces share a buffer; deterministic and loss-free."""

import random

import pytest

from mpidp.engine.fusion import nbytes, plan
from mpidp.engine.messages import OpType, ReduceOp, Request, Response

BELOW = 1024  # fuse_below_bytes
THRESHOLD = 4096  # fusion_threshold_bytes


def ar(name, numel=16, dtype="float32", joined=(), **kw):
    req = Request(name, OpType.ALLREDUCE, dtype, (numel,), **kw)
    return Response(name, OpType.ALLREDUCE, req, joined=joined)


def names(batches):
    return [[r.name for r in batch] for batch in batches]


def test_nbytes():
    assert nbytes(ar("a", 16, "float32")) == 64
    assert nbytes(ar("a", 16, "bfloat16")) == 32
    assert nbytes(ar("a", 3, "bool")) == 3
    assert nbytes(ar("a", 0, "float64")) == 0
    req = Request("m", OpType.ALLREDUCE, "int64", (3, 5))
    assert nbytes(Response("m", OpType.ALLREDUCE, req)) == 120


def test_small_compatible_allreduces_fuse():
    rs = [ar(f"t{i}") for i in range(5)]  # 64 B each
    assert names(plan(rs, BELOW, THRESHOLD)) == [[f"t{i}" for i in range(5)]]


def test_fusion_respects_the_threshold():
    rs = [ar(f"t{i}", numel=200) for i in range(12)]  # 800 B each, 5 fit in 4096
    batches = plan(rs, BELOW, THRESHOLD)
    assert names(batches) == [
        [f"t{i}" for i in range(0, 5)],
        [f"t{i}" for i in range(5, 10)],
        ["t10", "t11"],
    ]
    for batch in batches:
        assert sum(nbytes(r) for r in batch) <= THRESHOLD


def test_exact_threshold_fits():
    rs = [ar("a", numel=128), ar("b", numel=128)]  # 512 + 512 = 1024
    assert names(plan(rs, 1000, 1024)) == [["a", "b"]]
    assert names(plan(rs + [ar("c", numel=1)], 1000, 1024)) == [["a", "b"], ["c"]]


def test_tensors_at_or_above_fuse_below_run_alone():
    rs = [ar("s1"), ar("big", numel=BELOW // 4), ar("s2"), ar("bigger", numel=BELOW)]
    assert names(plan(rs, BELOW, THRESHOLD)) == [["s1", "s2"], ["big"], ["bigger"]]


def test_tensor_above_threshold_runs_alone_even_if_below_fuse_below():
    rs = [ar("a"), ar("huge", numel=2000), ar("b")]  # 8000 B > threshold 4096
    assert names(plan(rs, 10**9, THRESHOLD)) == [["a", "b"], ["huge"]]


@pytest.mark.parametrize(
    "op",
    [
        OpType.ALLGATHER,
        OpType.BROADCAST,
        OpType.ALLTOALL,
        OpType.REDUCESCATTER,
        OpType.BARRIER,
        OpType.JOIN,
    ],
)
def test_non_allreduce_runs_alone(op):
    other = Response("x", op, Request("x", op, "float32", (4,)))
    rs = [ar("a"), other, ar("b")]
    assert names(plan(rs, BELOW, THRESHOLD)) == [["a", "b"], ["x"]]
    assert names(plan([other, other._replace(name="y")], BELOW, THRESHOLD)) == [["x"], ["y"]]


def test_different_dtypes_do_not_mix():
    rs = [
        ar("f1"),
        ar("d1", dtype="float64"),
        ar("f2"),
        ar("h1", dtype="float16"),
        ar("d2", dtype="float64"),
    ]
    assert names(plan(rs, BELOW, THRESHOLD)) == [["f1", "f2"], ["d1", "d2"], ["h1"]]


@pytest.mark.parametrize(
    "kw",
    [
        {"reduce_op": ReduceOp.AVERAGE},
        {"prescale": 0.5},
        {"postscale": 2.0},
        {"device": "cuda:0"},
        {"joined": (1,)},
    ],
)
def test_each_key_component_separates_batches(kw):
    rs = [ar("a"), ar("b", **kw), ar("c"), ar("d", **kw)]
    assert names(plan(rs, BELOW, THRESHOLD)) == [["a", "c"], ["b", "d"]]


def test_device_index_does_not_separate():
    rs = [ar("a", device="cuda:0"), ar("b", device="cuda:1")]
    assert names(plan(rs, BELOW, THRESHOLD)) == [["a", "b"]]


def test_threshold_zero_disables_fusion():
    rs = [ar(f"t{i}") for i in range(4)]
    assert names(plan(rs, BELOW, 0)) == [["t0"], ["t1"], ["t2"], ["t3"]]


def test_fuse_below_zero_disables_fusion():
    rs = [ar(f"t{i}") for i in range(3)]
    assert names(plan(rs, 0, THRESHOLD)) == [["t0"], ["t1"], ["t2"]]


def test_empty_input():
    assert plan([], BELOW, THRESHOLD) == []


def _random_responses(seed, n=60):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if rng.random() < 0.15:
            op = rng.choice([OpType.ALLGATHER, OpType.BROADCAST, OpType.BARRIER])
            out.append(Response(f"r{i}", op, Request(f"r{i}", op, "float32", (4,))))
        else:
            out.append(
                ar(
                    f"r{i}",
                    numel=rng.choice([0, 1, 16, 100, 255, 256, 2000]),
                    dtype=rng.choice(["float32", "float64", "int32", "float16"]),
                    reduce_op=rng.choice([ReduceOp.SUM, ReduceOp.AVERAGE]),
                    joined=rng.choice([(), (), (2,)]),
                )
            )
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "below, threshold", [(BELOW, THRESHOLD), (BELOW, 0), (10**6, 600), (0, THRESHOLD)]
)
def test_plan_is_deterministic_and_preserves_every_response_once(seed, below, threshold):
    rs = _random_responses(seed)
    first = plan(list(rs), below, threshold)
    again = plan([Response(*r) for r in rs], below, threshold)  # equal copies, new objects
    assert first == again
    flat = [r for batch in first for r in batch]
    assert sorted(r.name for r in flat) == sorted(r.name for r in rs)
    assert len(flat) == len(rs)
    for batch in first:
        assert batch
        if len(batch) > 1:
            assert all(r.op == OpType.ALLREDUCE for r in batch)
            assert (
                len(
                    {
                        (
                            r.request.dtype,
                            r.request.reduce_op,
                            r.request.prescale,
                            r.request.postscale,
                            r.request.device.split(":")[0],
                            r.joined,
                        )
                        for r in batch
                    }
                )
                == 1
            )
            assert sum(nbytes(r) for r in batch) <= threshold
            assert all(nbytes(r) < below for r in batch)
    # Within a batch, responses keep their relative order.
    position = {r.name: i for i, r in enumerate(rs)}
    for batch in first:
        assert [position[r.name] for r in batch] == sorted(position[r.name] for r in batch)


def test_plan_does_not_mutate_its_input():
    rs = _random_responses(7)
    copy = list(rs)
    plan(rs, BELOW, THRESHOLD)
    assert rs == copy
