"""messages.Request: signature() and cache_key() for every op, and op_label()."""

import pytest

from mpidp.engine.messages import OpType, ReduceOp, Request, op_label


def req(op, shape, **kw):
    return Request("t", op, "float32", shape, **kw)


@pytest.mark.parametrize("op", [OpType.ALLGATHER, OpType.ALLTOALL])
def test_gather_like_signature_ignores_dim0(op):
    assert req(op, (3, 4)).signature() == req(op, (7, 4)).signature()
    assert req(op, (3,)).signature() == req(op, (0,)).signature()
    assert req(op, (3, 4)).signature() != req(op, (3, 5)).signature()
    assert req(op, (3, 4)).signature() != req(op, (3, 4, 1)).signature()


@pytest.mark.parametrize("op", [OpType.ALLGATHER, OpType.ALLTOALL])
def test_gather_like_scalar_differs_from_vector(op):
    assert req(op, ()).signature() != req(op, (1,)).signature()


@pytest.mark.parametrize("op", [OpType.ALLREDUCE, OpType.BROADCAST, OpType.REDUCESCATTER])
def test_other_ops_signature_uses_full_shape(op):
    assert req(op, (3, 4)).signature() != req(op, (7, 4)).signature()
    assert req(op, (3, 4)).signature() == req(op, (3, 4)).signature()


def test_allgather_cache_key_includes_full_shape():
    a, b = req(OpType.ALLGATHER, (3, 4)), req(OpType.ALLGATHER, (7, 4))
    assert a.signature() == b.signature()
    assert a.cache_key() != b.cache_key()
    assert a.cache_key() == req(OpType.ALLGATHER, (3, 4)).cache_key()
    assert a.cache_key()[: len(a.signature())] == a.signature()


@pytest.mark.parametrize(
    "op", [OpType.ALLREDUCE, OpType.ALLTOALL, OpType.BROADCAST, OpType.REDUCESCATTER]
)
def test_cache_key_is_signature_for_other_ops(op):
    r = req(op, (5, 2))
    assert r.cache_key() == r.signature()


def test_alltoall_cache_key_ignores_dim0():
    assert req(OpType.ALLTOALL, (3, 4)).cache_key() == req(OpType.ALLTOALL, (9, 4)).cache_key()


def test_signature_uses_device_kind_not_index():
    assert (
        req(OpType.ALLREDUCE, (2,), device="cuda:0").signature()
        == req(OpType.ALLREDUCE, (2,), device="cuda:1").signature()
    )
    assert (
        req(OpType.ALLREDUCE, (2,), device="cuda:0").signature()
        != req(OpType.ALLREDUCE, (2,), device="cpu").signature()
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("dtype", "float64"),
        ("reduce_op", ReduceOp.AVERAGE),
        ("prescale", 0.5),
        ("postscale", 2.0),
        ("root", 1),
        ("op", OpType.BROADCAST),
    ],
)
def test_signature_changes_with_each_field(field, value):
    base = req(OpType.ALLREDUCE, (2,))
    assert base._replace(**{field: value}).signature() != base.signature()


def test_signature_ignores_name_and_cacheable():
    base = req(OpType.ALLREDUCE, (2,))
    assert base._replace(name="other", cacheable=False).signature() == base.signature()


def test_op_label():
    assert op_label(Request("fc1.weight", OpType.ALLREDUCE)) == "allreduce 'fc1.weight'"
    assert op_label(Request("x", OpType.REDUCESCATTER)) == "reducescatter 'x'"
    assert op_label(Request("e", OpType.ERROR)) == "op 'e'"
