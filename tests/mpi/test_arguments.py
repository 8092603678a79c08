"""Bad arguments raise at once (before any communication) with helpful TypeError/ValueError."""

import numpy as np
import pytest
import torch
from mpi_util import assert_all, raises_all, rank, run_all, size, tensor_diff

import mpidp


def noncontig():
    """A non-contiguous (2, 3) view whose values encode the rank."""
    base = torch.arange(6, dtype=torch.float32).reshape(3, 2) + 10 * rank()
    t = base.t()
    assert not t.is_contiguous()
    return t


# ---- non-contiguous tensors ----


@pytest.mark.mpi
@pytest.mark.parametrize(
    "call",
    [
        "allreduce_",
        "allreduce_async_",
        "grouped_allreduce_",
        "grouped_allreduce_async_",
        "broadcast_",
        "broadcast_async_",
    ],
)
def test_noncontiguous_in_place_is_a_value_error(call):
    name = f"test_noncontiguous_in_place_is_a_value_error.{call}"
    t = noncontig()
    before = t.clone()
    fn = {
        "allreduce_": lambda: mpidp.allreduce_(t, name=name),
        "allreduce_async_": lambda: mpidp.allreduce_async_(t, name=name),
        # The contiguous first tensor must not be enqueued either: the group is atomic.
        "grouped_allreduce_": lambda: mpidp.grouped_allreduce_([torch.ones(2), t], name=name),
        "grouped_allreduce_async_": lambda: mpidp.grouped_allreduce_async_(
            [torch.ones(2), t], name=name
        ),
        "broadcast_": lambda: mpidp.broadcast_(t, 0, name=name),
        "broadcast_async_": lambda: mpidp.broadcast_async_(t, 0, name=name),
    }[call]
    raises_all(ValueError, fn, match="contiguous")
    assert_all(torch.equal(t, before), "the tensor was modified")
    # Nothing was left in flight under the name: the same call on contiguous tensors works.
    c = t.contiguous()

    def again():
        if call.startswith("grouped"):
            return mpidp.grouped_allreduce_([torch.ones(2), c], op=mpidp.Sum, name=name)[1]
        if call.startswith("broadcast"):
            return mpidp.broadcast_(c, 0, name=name)
        return mpidp.allreduce_(c, op=mpidp.Sum, name=name)

    out = run_all(again)
    n = size()
    base = torch.arange(6, dtype=torch.float32).reshape(3, 2).t()
    want = base if call.startswith("broadcast") else base * n + 10 * n * (n - 1) // 2
    d = tensor_diff(out, want)
    assert_all(not d, f"the call on a contiguous copy: {d}")


@pytest.mark.mpi
def test_noncontiguous_out_of_place_copies():
    name = "test_noncontiguous_out_of_place_copies"
    r, n = rank(), size()
    t = noncontig()
    before = t.clone()
    rows = torch.arange(2 * n * 3, dtype=torch.float32).reshape(3, 2 * n).t() + 100 * r

    def body():
        return {
            "allreduce": mpidp.allreduce(t, op=mpidp.Sum, name=f"{name}.ar"),
            "grouped_allreduce": mpidp.grouped_allreduce([t], op=mpidp.Sum, name=f"{name}.gar")[0],
            "allgather": mpidp.allgather(t, name=f"{name}.ag"),
            "broadcast": mpidp.broadcast(t, n - 1, name=f"{name}.bc"),
            "alltoall": mpidp.alltoall(rows, name=f"{name}.a2a"),
            "reducescatter": mpidp.reducescatter(rows, op=mpidp.Sum, name=f"{name}.rs"),
        }

    outs = run_all(body)
    base = torch.arange(6, dtype=torch.float32).reshape(3, 2).t()
    base_rows = torch.arange(2 * n * 3, dtype=torch.float32).reshape(3, 2 * n).t()
    expected = {
        "allreduce": base * n + 10 * n * (n - 1) // 2,
        "grouped_allreduce": base * n + 10 * n * (n - 1) // 2,
        "allgather": torch.cat([base + 10 * k for k in range(n)]),
        "broadcast": base + 10 * (n - 1),
        "alltoall": torch.cat([base_rows[2 * r : 2 * r + 2] + 100 * k for k in range(n)]),
        "reducescatter": base_rows[2 * r : 2 * r + 2] * n + 100 * n * (n - 1) // 2,
    }
    problems = [
        f"{k}: {tensor_diff(outs[k], v)}" for k, v in expected.items() if tensor_diff(outs[k], v)
    ]
    if not torch.equal(t, before):
        problems.append("input modified")
    assert_all(not problems, "; ".join(problems))


# ---- dtypes and tensor kinds ----

BAD_DTYPES = [torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.float8_e4m3fn]


def _every_op(t, name):
    return {
        "allreduce": lambda: mpidp.allreduce(t, op=mpidp.Sum, name=name),
        "allreduce_async_": lambda: mpidp.allreduce_async_(t, op=mpidp.Sum, name=name),
        "grouped_allreduce": lambda: mpidp.grouped_allreduce([t], op=mpidp.Sum, name=name),
        "allgather": lambda: mpidp.allgather(t, name=name),
        "grouped_allgather": lambda: mpidp.grouped_allgather([t], name=name),
        "broadcast": lambda: mpidp.broadcast(t, 0, name=name),
        "broadcast_": lambda: mpidp.broadcast_(t, 0, name=name),
        "alltoall": lambda: mpidp.alltoall(t, name=name),
        "reducescatter": lambda: mpidp.reducescatter(t, op=mpidp.Sum, name=name),
        "grouped_reducescatter": lambda: mpidp.grouped_reducescatter([t], op=mpidp.Sum, name=name),
    }


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_unsupported_dtype_is_a_type_error(dtype):
    name = f"test_unsupported_dtype_is_a_type_error.{dtype}"
    t = torch.zeros(size() * 2, 2).to(dtype)
    for op, fn in _every_op(t, name).items():
        e = raises_all(TypeError, fn)
        assert_all(
            "float32" in str(e) and str(dtype) in str(e),
            f"{op}: message does not name the dtype and the supported ones: {e}",
        )


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["list", "numpy", "sparse", "meta"])
def test_not_a_dense_cpu_tensor(kind):
    name = f"test_not_a_dense_cpu_tensor.{kind}"
    t = {
        "list": [1.0, 2.0],
        "numpy": np.ones(2, dtype=np.float32),
        "sparse": torch.eye(2).to_sparse(),
        "meta": torch.empty(2, device="meta"),
    }[kind]
    exc = ValueError if kind == "meta" else TypeError
    for op, fn in _every_op(t, name).items():
        raises_all(exc, fn)


# ---- roots, splits, ops ----


@pytest.mark.mpi
def test_broadcast_root_rank_checked():
    name = "test_broadcast_root_rank_checked"
    n = size()
    for root in (n, n + 5, -1):
        for fn in (
            mpidp.broadcast,
            mpidp.broadcast_,
            mpidp.broadcast_async,
            mpidp.broadcast_async_,
        ):
            e = raises_all(ValueError, fn, torch.ones(2), root, name=name, match="out of range")
            assert_all(f"0..{n - 1}" in str(e), f"message lacks the valid range: {e}")
    for root in (0.0, "0", None, True):
        raises_all(TypeError, mpidp.broadcast, torch.ones(2), root, name=name)


@pytest.mark.mpi
def test_alltoall_splits_checked():
    name = "test_alltoall_splits_checked"
    n = size()
    t = torch.ones(2 * n, 3)
    cases = [
        (ValueError, [1] * (n + 1), "entries"),  # one too many
        (ValueError, [1] * n + [0], "entries"),
        (ValueError, [2 * n + 1] + [0] * (n - 1), "sum"),  # more rows than dim 0
        (ValueError, [-1] + [1] * (n - 1), ">= 0"),
        (ValueError, [0.5] * n, "integer"),  # ValueError for float splits, as Horovod
        (ValueError, torch.ones(n), "integer"),
        (ValueError, torch.ones(n, dtype=torch.bool), "integer"),
        (TypeError, "1" * n, "splits"),
        (TypeError, {i: 1 for i in range(n)}, "splits"),
    ]
    if n > 1:
        cases.append((ValueError, [1] * (n - 1), "entries"))  # one too few
    for exc, splits, word in cases:
        for fn in (mpidp.alltoall, mpidp.alltoall_async):
            raises_all(exc, fn, t, splits=splits, name=name, match=word)
    raises_all(ValueError, mpidp.alltoall, torch.tensor(1.0), name=name, match="dimension")
    if n > 1:
        raises_all(ValueError, mpidp.alltoall, torch.ones(2 * n + 1, 3), name=name, match="splits")


@pytest.mark.mpi
def test_reducescatter_arguments_checked():
    name = "test_reducescatter_arguments_checked"
    for fn in (mpidp.reducescatter, mpidp.reducescatter_async):
        raises_all(ValueError, fn, torch.tensor(1.0), name=name, match="scalar")
        for op in (mpidp.Min, mpidp.Max, mpidp.Product):
            raises_all(ValueError, fn, torch.ones(size()), name=name, op=op, match="Average")
        raises_all(ValueError, fn, torch.ones(size()), name=name, op=mpidp.Adasum)
        raises_all(TypeError, fn, torch.ones(size(), dtype=torch.bool), name=name, match="bool")
    raises_all(
        ValueError,
        mpidp.grouped_reducescatter,
        [torch.ones(2), torch.tensor(1.0)],
        name=name,
        match="scalar",
    )


@pytest.mark.mpi
@pytest.mark.parametrize(
    "call",
    [
        "allreduce",
        "allreduce_",
        "allreduce_async",
        "allreduce_async_",
        "grouped_allreduce",
        "grouped_allreduce_async",
    ],
)
def test_reduce_op_arguments_checked(call):
    name = f"test_reduce_op_arguments_checked.{call}"
    fn = getattr(mpidp, call)
    wrap = (lambda t: [t]) if call.startswith("grouped") else (lambda t: t)
    # Average (also the default op) is not defined on bool.
    raises_all(TypeError, fn, wrap(torch.ones(2, dtype=torch.bool)), name=name, match="bool")
    raises_all(
        TypeError,
        fn,
        wrap(torch.ones(2, dtype=torch.bool)),
        name=name,
        op=mpidp.Average,
        match="Sum",
    )
    # average= and op= together.
    raises_all(
        ValueError, fn, wrap(torch.ones(2)), average=True, op=mpidp.Sum, name=name, match="not both"
    )
    # Adasum on integers (or, as in Horovod, on a world that is not a power of 2), unknown ops.
    n = size()
    raises_all(
        TypeError if n & (n - 1) == 0 else NotImplementedError,
        fn,
        wrap(torch.ones(2, dtype=torch.int64)),
        op=mpidp.Adasum,
        name=name,
        match="Adasum",
    )
    for bad in (99, "sum"):
        raises_all(ValueError, fn, wrap(torch.ones(2)), op=bad, name=name, match="op")
    # Scale factors on bool (on integers they are allowed, as in Horovod).
    raises_all(
        TypeError,
        fn,
        wrap(torch.ones(2, dtype=torch.bool)),
        op=mpidp.Sum,
        prescale_factor=2.0,
        name=name,
        match="bool",
    )
    raises_all(
        TypeError,
        fn,
        wrap(torch.ones(2, dtype=torch.bool)),
        op=mpidp.Max,
        postscale_factor=0.5,
        name=name,
        match="bool",
    )


@pytest.mark.mpi
def test_bad_names_and_handles():
    for bad in ("", 7, b"x"):
        raises_all(TypeError, mpidp.allreduce_async, torch.ones(2), name=bad, match="name")
        raises_all(TypeError, mpidp.allgather_async, torch.ones(2), name=bad, match="name")
    for h in (10**9, -1, None, "1"):
        raises_all(ValueError, mpidp.synchronize, h, match="unknown")
        raises_all(ValueError, mpidp.poll, h, match="unknown")


@pytest.mark.mpi
def test_empty_grouped_ops():
    """An empty list is a no-op (or a clear error), never a hang."""
    name = "test_empty_grouped_ops"

    def body():
        out = {}
        for what, fn in (
            ("grouped_allreduce", mpidp.grouped_allreduce),
            ("grouped_allgather", mpidp.grouped_allgather),
            ("grouped_reducescatter", mpidp.grouped_reducescatter),
        ):
            try:
                out[what] = fn([], name=f"{name}.{what}")
            except ValueError:
                out[what] = "ValueError"
        return out

    outs = run_all(body)
    bad = {k: v for k, v in outs.items() if v not in ([], "ValueError")}
    assert_all(not bad, f"{bad}")


@pytest.mark.mpi(min_size=2)
def test_refused_unnamed_op_does_not_shift_unnamed_numbering():
    r, n = rank(), size()

    def body():
        if r == 0:
            try:
                mpidp.allreduce_async(torch.ones(2, dtype=torch.complex64))
            except TypeError:
                pass
        h = mpidp.allreduce_async(torch.ones(2), op=mpidp.Sum)
        try:
            return mpidp.synchronize(h, timeout=2.0).tolist()
        except mpidp.OpTimeoutError:
            return "the next unnamed op never matched (timed out after 2 s)"

    result = run_all(body)
    if result != [float(n)] * 2:
        # Leave no stray unnamed ops behind: restart the engine on every rank.
        mpidp.shutdown()
        mpidp.init()
    assert_all(result == [float(n)] * 2, f"{result}")
