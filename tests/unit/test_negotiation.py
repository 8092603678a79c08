"""negotiation.MessageTable and validate(): readiness, ordering, mismatch messages and join."""

import pytest

from mpidp.engine.messages import JOIN_NAME, OP_NAMES, OpType, ReduceOp, Request, Response
from mpidp.engine.negotiation import MessageTable, validate


def ar(name="t", shape=(17, 4), dtype="float32", **kw):
    return Request(name, OpType.ALLREDUCE, dtype, shape, **kw)


def ag(name="g", shape=(3, 4), dtype="float32", **kw):
    return Request(name, OpType.ALLGATHER, dtype, shape, **kw)


def join_req():
    return Request(JOIN_NAME, OpType.JOIN)


def submit_all(table, requests_by_rank):
    for rank, reqs in requests_by_rank.items():
        table.add(rank, reqs if isinstance(reqs, list) else [reqs])


# ---- readiness and order ----


def test_not_ready_until_every_rank_submitted():
    table = MessageTable(3)
    table.add(0, [ar()])
    assert table.ready() == []
    table.add(2, [ar()])
    assert table.ready() == []
    table.add(1, [ar()])
    (resp,) = table.ready()
    assert resp.name == "t" and resp.op == OpType.ALLREDUCE
    assert resp.request == ar()
    assert resp.error == "" and resp.joined == ()
    # Answered names leave the table.
    assert table.ready() == []
    assert table.table == {}


def test_single_rank_world_is_ready_at_once():
    table = MessageTable(1)
    table.add(0, [ar("a"), ar("b")])
    assert [r.name for r in table.ready()] == ["a", "b"]


def test_readiness_order_is_order_of_first_arrival():
    table = MessageTable(2)
    table.add(1, [ar("c"), ar("b")])
    table.add(0, [ar("a"), ar("b"), ar("c")])
    assert table.ready() == [
        Response("c", OpType.ALLREDUCE, ar("c")),
        Response("b", OpType.ALLREDUCE, ar("b")),
    ]
    table.add(1, [ar("a")])
    assert [r.name for r in table.ready()] == ["a"]


def test_order_is_independent_of_which_rank_completes_a_name():
    table = MessageTable(3)
    table.add(0, [ar("x"), ar("y"), ar("z")])
    table.add(1, [ar("z"), ar("y"), ar("x")])
    table.add(2, [ar("z")])
    table.add(2, [ar("y")])
    table.add(2, [ar("x")])
    assert [r.name for r in table.ready()] == ["x", "y", "z"]


def test_resubmitted_name_after_completion_is_a_new_arrival():
    table = MessageTable(2)
    submit_all(table, {0: [ar("a"), ar("b")], 1: [ar("a")]})
    assert [r.name for r in table.ready()] == ["a"]
    table.add(0, [ar("a")])
    table.add(1, [ar("a"), ar("b")])
    assert [r.name for r in table.ready()] == ["b", "a"]


def test_response_carries_the_lowest_rank_request():
    table = MessageTable(2)
    table.add(1, [ar(device="cuda:1")])
    table.add(0, [ar(device="cuda:0")])
    (resp,) = table.ready()
    assert resp.op == OpType.ALLREDUCE
    assert resp.request.device == "cuda:0"


def test_device_index_may_differ():
    assert validate({0: ar(device="cuda:0"), 1: ar(device="cuda:3")}, []) == ""


# ---- mismatches ----


def error_of(requests_by_rank, size=None):
    table = MessageTable(size or len(requests_by_rank))
    submit_all(table, requests_by_rank)
    (resp,) = table.ready()
    assert resp.op == OpType.ERROR
    assert resp.request == requests_by_rank[min(requests_by_rank)]
    assert resp.error
    return resp.error


def test_shape_mismatch_message_groups_ranks():
    msg = error_of(
        {0: ar(shape=(17, 4)), 1: ar(shape=(18, 4)), 2: ar(shape=(17, 4)), 3: ar(shape=(18, 4))}
    )
    assert msg == (
        "allreduce 't': ranks 0,2 sent shape (17, 4) float32, ranks 1,3 sent shape (18, 4) float32"
    )


def test_shape_mismatch_message_single_rank_first():
    msg = error_of(
        {0: ar(shape=(17, 4)), 1: ar(shape=(18, 4)), 2: ar(shape=(18, 4)), 3: ar(shape=(18, 4))}
    )
    assert msg == (
        "allreduce 't': rank 0 sent shape (17, 4) float32, ranks 1,2,3 sent shape (18, 4) float32"
    )


def test_shape_mismatch_with_a_joined_rank_names_only_submitters():
    msg = validate(
        {0: ar("fc1.weight", (17, 4)), 1: ar("fc1.weight", (18, 4)), 3: ar("fc1.weight", (18, 4))},
        [2],
    )
    assert msg == (
        "allreduce 'fc1.weight': rank 0 sent shape (17, 4) float32, "
        "ranks 1,3 sent shape (18, 4) float32"
    )


@pytest.mark.parametrize(
    "a, b, fragment_a, fragment_b",
    [
        (
            ar(),
            Request("t", OpType.ALLGATHER, "float32", (17, 4)),
            "sent allreduce",
            "sent allgather",
        ),
        (ar(), ar(dtype="float64"), "sent dtype 'float32'", "sent dtype 'float64'"),
        (ar(), ar(reduce_op=ReduceOp.AVERAGE), "sent Sum", "sent Average"),
        (ar(), ar(prescale=0.5), "sent prescale 1.0", "sent prescale 0.5"),
        (ar(), ar(postscale=2.0), "sent postscale 1.0", "sent postscale 2.0"),
        (ar(), ar(device="cuda:0"), "sent device cpu", "sent device cuda"),
        (
            Request("t", OpType.BROADCAST, "float32", (2,), root=0),
            Request("t", OpType.BROADCAST, "float32", (2,), root=1),
            "sent root 0",
            "sent root 1",
        ),
        (
            Request("t", OpType.BROADCAST, "float32", (2,), root=0),
            Request("t", OpType.BROADCAST, "float32", (3,), root=0),
            "sent shape (2,) float32",
            "sent shape (3,) float32",
        ),
        (
            ag("t", (3, 4)),
            ag("t", (3, 5)),
            "sent shape (*, 4) float32",
            "sent shape (*, 5) float32",
        ),
        (ag("t", (3, 4)), ag("t", (3,)), "sent shape (*, 4) float32", "sent shape (3,) float32"),
        (
            Request("t", OpType.ALLTOALL, "int64", (4, 2)),
            Request("t", OpType.ALLTOALL, "int64", (4, 3)),
            "sent shape (*, 2) int64",
            "sent shape (*, 3) int64",
        ),
        (
            Request("t", OpType.REDUCESCATTER, "float32", (8,)),
            Request("t", OpType.REDUCESCATTER, "float32", (8,), reduce_op=ReduceOp.MAX),
            "sent Sum",
            "sent Max",
        ),
    ],
)
def test_each_mismatch_kind_is_an_error_naming_tensor_and_ranks(a, b, fragment_a, fragment_b):
    msg = error_of({0: a, 1: b, 2: b})
    assert "'t'" in msg
    assert f"rank 0 {fragment_a}" in msg
    assert f"ranks 1,2 {fragment_b}" in msg
    # The message names the op of the lowest rank first.
    assert msg.startswith(f"{OP_NAMES[a.op]} 't': ")


def test_mismatch_groups_are_ordered_by_lowest_rank():
    msg = error_of(
        {
            0: ar(dtype="float16"),
            1: ar(dtype="float32"),
            2: ar(dtype="float64"),
            3: ar(dtype="float32"),
        }
    )
    assert msg == (
        "allreduce 't': rank 0 sent dtype 'float16', ranks 1,3 sent dtype "
        "'float32', rank 2 sent dtype 'float64'"
    )


def test_allgather_first_dim_may_differ_and_first_dims_are_reported_per_rank():
    table = MessageTable(3)
    table.add(2, [ag(shape=(5, 4))])
    table.add(0, [ag(shape=(1, 4))])
    table.add(1, [ag(shape=(0, 4))])
    (resp,) = table.ready()
    assert resp.op == OpType.ALLGATHER
    assert resp.first_dims == (1, 0, 5)


def test_allgather_of_scalars_counts_one_per_rank():
    table = MessageTable(2)
    submit_all(table, {0: ag(shape=()), 1: ag(shape=())})
    (resp,) = table.ready()
    assert resp.op == OpType.ALLGATHER and resp.first_dims == (1, 1)


def test_non_allgather_has_no_first_dims():
    table = MessageTable(2)
    submit_all(table, {0: ar(), 1: ar()})
    assert table.ready()[0].first_dims == ()


def test_mismatch_does_not_block_other_names():
    table = MessageTable(2)
    submit_all(table, {0: [ar("bad"), ar("good")], 1: [ar("bad", dtype="int32"), ar("good")]})
    bad, good = table.ready()
    assert bad.name == "bad" and bad.op == OpType.ERROR
    assert good.name == "good" and good.op == OpType.ALLREDUCE


# ---- join ----


def test_joined_ranks_count_as_submitted_for_allreduce():
    table = MessageTable(3)
    table.add(2, [join_req()])
    table.add(0, [ar()])
    assert table.ready() == []
    table.add(1, [ar()])
    (resp,) = table.ready()
    assert resp.op == OpType.ALLREDUCE and resp.name == "t"
    assert resp.joined == (2,)


def test_rank_that_joins_after_others_submitted_completes_the_name():
    table = MessageTable(2)
    table.add(0, [ar("a", reduce_op=ReduceOp.AVERAGE)])
    assert table.ready() == []
    table.add(1, [join_req()])
    (resp,) = table.ready()
    assert resp.op == OpType.ALLREDUCE and resp.joined == (1,)


def test_joined_rank_that_also_submitted_is_not_in_joined():
    table = MessageTable(2)
    table.add(1, [ar("a"), join_req()])
    table.add(0, [ar("a")])
    (resp,) = table.ready()
    assert resp.op == OpType.ALLREDUCE and resp.joined == ()


def test_a_joined_rank_that_serves_a_prefix_is_waited_for_under_it_only():
    """A ShardedOptimizer's joined rank keeps submitting its shard's ops (prefix 'opt.'): the
    others wait for it there, while their other allreduces get its zeros as usual."""
    table = MessageTable(2)
    table.add(1, [Request(JOIN_NAME, OpType.JOIN, serves=("opt.",))])
    table.add(0, [Request("opt.rs", OpType.REDUCESCATTER, "float32", (4,)), ar("loss")])
    (loss,) = table.ready()
    assert loss.name == "loss" and loss.joined == (1,)
    table.add(1, [Request("opt.rs", OpType.REDUCESCATTER, "float32", (4,))])
    (rs,) = table.ready()
    assert rs.op == OpType.REDUCESCATTER and rs.joined == ()
    # Rank 1 sends its next round while joined; rank 0 joins before sending its own: JOIN
    # names it as pending, so rank 0 sends it to the coordinator even though it is cached.
    table.add(1, [Request("opt.rs", OpType.REDUCESCATTER, "float32", (4,))])
    table.add(0, [Request(JOIN_NAME, OpType.JOIN, serves=("opt.",))])
    (j,) = table.ready()
    assert j.op == OpType.JOIN and j.last_joined == 0 and table.serves == {}
    assert j.pending == ("opt.rs",)


@pytest.mark.parametrize(
    "req",
    [
        ag("t"),
        Request("t", OpType.BROADCAST, "float32", (2,), root=0),
        Request("t", OpType.ALLTOALL, "float32", (2,)),
        Request("t", OpType.REDUCESCATTER, "float32", (4,)),
    ],
)
def test_non_allreduce_ops_error_while_ranks_are_joined(req):
    table = MessageTable(3)
    table.add(1, [join_req()])
    table.add(0, [req])
    table.add(2, [req])
    (resp,) = table.ready()
    assert resp.op == OpType.ERROR
    assert "'t'" in resp.error
    assert "rank 1 already called join()" in resp.error


def test_barrier_completes_among_ranks_that_have_not_joined():
    # A joined rank has nothing more to submit; the others' barrier must not wait for it
    # (its engine skips the response: see Engine._execute).
    table = MessageTable(2)
    table.add(1, [join_req()])
    table.add(0, [Request("b", OpType.BARRIER, cacheable=False)])
    (resp,) = table.ready()
    assert resp.op == OpType.BARRIER
    assert resp.joined == (1,)


@pytest.mark.parametrize("op", [ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT])
def test_min_max_product_allreduce_errors_while_joined(op):
    table = MessageTable(2)
    table.add(1, [join_req()])
    table.add(0, [ar(reduce_op=op)])
    (resp,) = table.ready()
    assert resp.op == OpType.ERROR
    assert op.name.capitalize() in resp.error
    assert "rank 1" in resp.error
    assert "'t'" in resp.error


@pytest.mark.parametrize("op", [ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT])
def test_min_max_product_allreduce_fine_without_joined_ranks(op):
    table = MessageTable(2)
    submit_all(table, {0: ar(reduce_op=op), 1: ar(reduce_op=op)})
    assert table.ready()[0].op == OpType.ALLREDUCE


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE])
def test_sum_and_average_allowed_while_joined(op):
    table = MessageTable(2)
    table.add(0, [join_req()])
    table.add(1, [ar(reduce_op=op)])
    (resp,) = table.ready()
    assert resp.op == OpType.ALLREDUCE and resp.joined == (0,)


def test_join_response_when_all_have_joined_names_last_joined():
    table = MessageTable(3)
    table.add(2, [join_req()])
    assert table.ready() == []
    table.add(0, [join_req()])
    assert table.ready() == []
    table.add(1, [join_req()])
    (resp,) = table.ready()
    assert resp.op == OpType.JOIN and resp.name == JOIN_NAME
    assert resp.last_joined == 1


def test_join_response_comes_after_flushed_names_and_state_resets():
    table = MessageTable(2)
    table.add(0, [ar("a")])
    table.add(0, [join_req()])
    table.add(1, [join_req()])
    a, j = table.ready()
    assert a.name == "a" and a.op == OpType.ALLREDUCE and a.joined == (1,)
    assert j.op == OpType.JOIN and j.last_joined == 1
    assert table.joined == []
    # After the reset nobody counts as joined: a name needs every rank again.
    table.add(0, [ar("b")])
    assert table.ready() == []
    table.add(1, [ar("b")])
    (b,) = table.ready()
    assert b.op == OpType.ALLREDUCE and b.joined == ()


def test_join_twice_by_one_rank_counts_once():
    table = MessageTable(2)
    table.add(0, [join_req()])
    table.add(0, [join_req()])
    assert table.ready() == []
    table.add(1, [join_req()])
    (resp,) = table.ready()
    assert resp.op == OpType.JOIN and resp.last_joined == 1


def test_validate_is_empty_when_requests_agree():
    assert validate({0: ar(), 1: ar(), 2: ar()}, []) == ""
    assert validate({0: ag(shape=(1, 4)), 1: ag(shape=(9, 4))}, []) == ""
