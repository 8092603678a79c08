"""allgather, broadcast, alltoall and reducescatter (and grouped forms) for every dtype."""

import numpy as np
import pytest
import torch
from mpi_util import (
    DTYPES,
    FLOAT_DTYPES,
    SIGNED_DTYPES,
    assert_all,
    cast,
    dtype_id,
    int_average,
    raises_all,
    rank,
    run_all,
    size,
    tensor_diff,
)

import mpidp


def problems_of(pairs):
    """[(what, actual, expected)] -> list of problem strings."""
    out = []
    for what, actual, expected in pairs:
        d = tensor_diff(actual, expected)
        if d:
            out.append(f"{what}: {d}")
    return out


def check(pairs, extra=(), device=None):
    """Fail every rank unless each actual equals its expected value (taken to `device` first:
    results must come back on the inputs' device)."""
    if device is not None:
        pairs = [(what, actual, expected.to(device)) for what, actual, expected in pairs]
    problems = problems_of(pairs) + list(extra)
    assert_all(not problems, "; ".join(problems))


# ---- allgather ----


def gather_input(r: int, dtype, rows=None) -> torch.Tensor:
    """rank r: r+1 rows (or `rows`) of shape (2, 3), values that encode the rank and position."""
    rows = r + 1 if rows is None else rows
    i = torch.arange(rows * 6, dtype=torch.int64).reshape(rows, 2, 3)
    return cast((i + 7 * r) % 50, dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_allgather_uneven_first_dim(dtype, device):
    name = f"test_allgather_uneven_first_dim.{dtype_id(dtype)}.{device.type}"
    r, n = rank(), size()
    x = gather_input(r, dtype).to(device)
    orig = x.clone()
    expected = torch.cat([gather_input(k, dtype) for k in range(n)])

    def body():
        out = mpidp.allgather(x, name=f"{name}.blocking")
        h = mpidp.allgather_async(x, name=f"{name}.async")
        return out, mpidp.synchronize(h)

    out, out_async = run_all(body)
    extra = [] if torch.equal(x, orig) else ["allgather modified its input"]
    check([("allgather", out, expected), ("allgather_async", out_async, expected)], extra, device)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_allgather_scalars(dtype):
    name = f"test_allgather_scalars.{dtype_id(dtype)}"
    r, n = rank(), size()
    x = cast(torch.tensor(r + 3), dtype)
    expected = cast(torch.arange(n) + 3, dtype)
    out = run_all(mpidp.allgather, x, name=name)
    check([("allgather of a scalar", out, expected)])


@pytest.mark.mpi
def test_allgather_some_ranks_empty():
    """Rank r contributes r rows: rank 0 sends none."""
    name = "test_allgather_some_ranks_empty"
    r, n = rank(), size()
    x = gather_input(r, torch.float32, rows=r)
    expected = torch.cat([gather_input(k, torch.float32, rows=k) for k in range(n)])
    out = run_all(mpidp.allgather, x, name=name)
    check([("allgather with empty ranks", out, expected)])


@pytest.mark.mpi
def test_allgather_same_name_twice_with_changing_first_dim():
    """The response cache must not reuse the first call's row counts."""
    name = "test_allgather_same_name_twice_with_changing_first_dim"
    r, n = rank(), size()
    pairs = []
    for step, rows in enumerate([lambda k: k + 1, lambda k: k + 1, lambda k: 2, lambda k: n - k]):
        x = gather_input(r, torch.int32, rows=rows(r))
        expected = torch.cat([gather_input(k, torch.int32, rows=rows(k)) for k in range(n)])
        pairs.append((f"step {step}", run_all(mpidp.allgather, x, name=name), expected))
    check(pairs)


@pytest.mark.mpi
def test_grouped_allgather(device):
    name = f"test_grouped_allgather.{device.type}"
    r, n = rank(), size()
    xs = [
        t.to(device)
        for t in (
            gather_input(r, torch.float32),
            cast(torch.full((2, 4), r), torch.int64),
            cast(torch.tensor(r), torch.bfloat16),
        )
    ]
    expected = [
        torch.cat([gather_input(k, torch.float32) for k in range(n)]),
        torch.cat([torch.full((2, 4), k, dtype=torch.int64) for k in range(n)]),
        torch.arange(n).to(torch.bfloat16),
    ]

    def body():
        outs = mpidp.grouped_allgather(xs, name=f"{name}.blocking")
        outs_async = mpidp.synchronize(mpidp.grouped_allgather_async(xs, name=f"{name}.async"))
        return outs, outs_async

    outs, outs_async = run_all(body)
    extra = [
        f"{w} returned {type(o).__name__} of {len(o)}"
        for w, o in (("grouped_allgather", outs), ("grouped_allgather_async", outs_async))
        if not isinstance(o, list) or len(o) != 3
    ]
    check(
        [(f"grouped_allgather[{i}]", o, e) for i, (o, e) in enumerate(zip(outs, expected))]
        + [
            (f"grouped_allgather_async[{i}]", o, e)
            for i, (o, e) in enumerate(zip(outs_async, expected))
        ],
        extra,
        device,
    )


# ---- broadcast ----


def bcast_input(r: int, dtype) -> torch.Tensor:
    i = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    return cast((i * (r + 1) + r) % 60, dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_broadcast_every_root(dtype, device):
    name = f"test_broadcast_every_root.{dtype_id(dtype)}.{device.type}"
    r, n = rank(), size()
    x = bcast_input(r, dtype).to(device)
    orig = x.clone()

    def body():
        results = []
        for root in range(n):
            out = mpidp.broadcast(x, root, name=f"{name}.oop.{root}")
            y = x.clone()
            ret = mpidp.broadcast_(y, root, name=f"{name}.ip.{root}")
            a, b = x.clone(), x.clone()
            h1 = mpidp.broadcast_async(a, root, name=f"{name}.async.{root}")
            h2 = mpidp.broadcast_async_(b, root_rank=root, name=f"{name}.async_.{root}")
            results.append((root, out, y, ret, a, mpidp.synchronize(h1), b, mpidp.synchronize(h2)))
        return results

    pairs, extra = [], []
    for root, out, y, ret, a, out_async, b, ret2 in run_all(body):
        want = bcast_input(root, dtype)
        pairs += [
            (f"root {root} broadcast", out, want),
            (f"root {root} broadcast_", y, want),
            (f"root {root} broadcast_ returned", ret, want),
            (f"root {root} broadcast_async", out_async, want),
            (f"root {root} broadcast_async_", b, want),
            (f"root {root} broadcast_async_ returned", ret2, want),
            (f"root {root} broadcast_async input", a, orig),
        ]
        if ret.data_ptr() != y.data_ptr() or ret2.data_ptr() != b.data_ptr():
            extra.append(f"root {root}: in-place broadcast did not return the input's storage")
    if not torch.equal(x, orig):
        extra.append("out-of-place broadcast modified its input")
    check(pairs, extra, device)


@pytest.mark.mpi
def test_broadcast_scalar_with_numpy_root():
    name = "test_broadcast_scalar_with_numpy_root"
    r, n = rank(), size()
    root = np.int64(n - 1)
    out = run_all(mpidp.broadcast, torch.tensor(float(r) + 0.5), root, name=name)
    check([("broadcast of a scalar", out, torch.tensor(float(n - 1) + 0.5))])


# ---- alltoall ----


def code(sender: int, dest: int, k: int) -> int:
    """Value of row k that `sender` sends to `dest`; < 64 so it fits int8 and is exact in bf16."""
    return sender * 16 + dest * 4 + k


def a2a_even_input(r: int, n: int, dtype, per: int = 2) -> torch.Tensor:
    rows = [[code(r, j, k)] * 3 for j in range(n) for k in range(per)]
    return cast(torch.tensor(rows, dtype=torch.int64).reshape(n * per, 3), dtype)


def a2a_splits(r: int, n: int):
    """Rows rank r sends to each rank: 0, 1 or 2, so some are zero (at n >= 2)."""
    return [(r + j) % 3 for j in range(n)]


def a2a_split_input(r: int, n: int, dtype, spare: int = 0) -> torch.Tensor:
    splits = a2a_splits(r, n)
    rows = [[code(r, j, k), 1] for j in range(n) for k in range(splits[j])]
    rows += [[63, 63]] * spare  # beyond sum(splits): not sent
    t = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 2)
    return cast(t, dtype)


def a2a_split_expected(r: int, n: int, dtype):
    rows = [[code(j, r, k), 1] for j in range(n) for k in range(a2a_splits(j, n)[r])]
    t = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 2)
    return cast(t, dtype), torch.tensor([a2a_splits(j, n)[r] for j in range(n)], dtype=torch.int32)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_alltoall_even(dtype, device):
    name = f"test_alltoall_even.{dtype_id(dtype)}.{device.type}"
    r, n = rank(), size()
    x = a2a_even_input(r, n, dtype).to(device)
    orig = x.clone()
    expected = cast(torch.tensor([[code(j, r, k)] * 3 for j in range(n) for k in range(2)]), dtype)

    def body():
        out = mpidp.alltoall(x, name=f"{name}.blocking")
        out_async = mpidp.synchronize(mpidp.alltoall_async(x, name=f"{name}.async"))
        return out, out_async

    out, out_async = run_all(body)
    extra = [] if torch.equal(x, orig) else ["alltoall modified its input"]
    check([("alltoall", out, expected), ("alltoall_async", out_async, expected)], extra, device)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_alltoall_with_splits(dtype, device):
    name = f"test_alltoall_with_splits.{dtype_id(dtype)}.{device.type}"
    r, n = rank(), size()
    splits = a2a_splits(r, n)
    exp_out, exp_splits = a2a_split_expected(r, n, dtype)

    def body():
        results = {}
        x = a2a_split_input(r, n, dtype).to(device)
        results["list splits"] = mpidp.alltoall(x, splits=splits, name=f"{name}.list")
        results["int32 tensor splits"] = mpidp.alltoall(
            x, splits=torch.tensor(splits, dtype=torch.int32), name=f"{name}.t32"
        )
        results["numpy splits, spare rows"] = mpidp.alltoall(
            a2a_split_input(r, n, dtype, spare=2).to(device),
            splits=np.array(splits, dtype=np.int64),
            name=f"{name}.np",
        )
        results["async, int64 tensor splits"] = mpidp.synchronize(
            mpidp.alltoall_async(x, splits=torch.tensor(splits), name=f"{name}.async")
        )
        return results

    pairs, extra = [], []
    for what, res in run_all(body).items():
        if not isinstance(res, tuple) or len(res) != 2:
            extra.append(f"{what}: expected (output, received_splits), got {type(res).__name__}")
            continue
        out, got_splits = res
        pairs.append((f"{what}: output", out, exp_out))
        if not isinstance(got_splits, torch.Tensor) or got_splits.tolist() != exp_splits.tolist():
            extra.append(f"{what}: received splits {got_splits!r}, expected {exp_splits.tolist()}")
    check(pairs, extra, device)


@pytest.mark.mpi
def test_alltoall_all_zero_splits_and_empty_tensor():
    name = "test_alltoall_all_zero_splits_and_empty_tensor"
    n = size()
    out, got = run_all(mpidp.alltoall, torch.empty(0, 3), splits=[0] * n, name=name)
    extra = [] if got.tolist() == [0] * n else [f"received splits {got.tolist()}"]
    check([("alltoall of nothing", out, torch.empty(0, 3))], extra)


# ---- reducescatter ----


def rs_input(r: int, dtype, dim0: int) -> torch.Tensor:
    i = torch.arange(dim0 * 2, dtype=torch.int64).reshape(dim0, 2)
    if dtype == torch.bool:
        return (i + r) % 3 == 0
    vals = (3 * i + 5 * r) % 7
    if dtype in SIGNED_DTYPES or dtype.is_floating_point:
        vals = vals - 3
    return vals.to(dtype)


def rs_expected(r: int, n: int, dtype, op, dim0: int, pre: float = 1.0, post: float = 1.0):
    xs = [rs_input(k, dtype, dim0) for k in range(n)]
    if dtype == torch.bool:
        full = torch.stack(xs).any(0)
    elif dtype.is_floating_point:
        full = torch.stack([x.double() * pre for x in xs]).sum(0)
        full = (full / n if op == mpidp.Average else full) * post
    else:
        full = torch.stack([x.long() for x in xs]).sum(0)
        if op == mpidp.Average:
            full = int_average(full, n)
    rows = [dim0 // n + (1 if k < dim0 % n else 0) for k in range(n)]
    start = sum(rows[:r])
    return full[start : start + rows[r]].to(dtype)


RS_OPS = [mpidp.Average, mpidp.Sum]


@pytest.mark.mpi
@pytest.mark.parametrize("op", RS_OPS, ids=lambda op: op.name.lower())
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_reducescatter(dtype, op, device):
    name = f"test_reducescatter.{dtype_id(dtype)}.{op.name.lower()}.{device.type}"
    r, n = rank(), size()
    even, uneven = 2 * n, 2 * n + 1  # uneven: rank 0 gets one extra row (dim0 % n == 1)
    if n > 2:
        uneven = 2 * n + n - 1  # the first n-1 ranks get an extra row
    if dtype == torch.bool and op == mpidp.Average:
        raises_all(
            TypeError,
            mpidp.reducescatter,
            rs_input(r, dtype, even).to(device),
            name=name,
            op=op,
            match="bool",
        )
        return

    def body():
        results = {}
        for label, dim0 in (("even", even), ("uneven", uneven), ("fewer rows than ranks", 1)):
            x = rs_input(r, dtype, dim0).to(device)
            orig = x.clone()
            results[label] = (
                mpidp.reducescatter(x, name=f"{name}.{label}", op=op),
                rs_expected(r, n, dtype, op, dim0),
                torch.equal(x, orig),
            )
        x = rs_input(r, dtype, uneven).to(device)
        results["async"] = (
            mpidp.synchronize(mpidp.reducescatter_async(x, name=f"{name}.async", op=op)),
            rs_expected(r, n, dtype, op, uneven),
            True,
        )
        return results

    results = run_all(body)
    extra = [f"{label}: input modified" for label, (_, _, same) in results.items() if not same]
    check([(label, got, want) for label, (got, want, _) in results.items()], extra, device)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_reducescatter_prescale_postscale(dtype):
    name = f"test_reducescatter_prescale_postscale.{dtype_id(dtype)}"
    r, n = rank(), size()
    dim0 = 2 * n + 1
    x = rs_input(r, dtype, dim0)

    def body():
        return {
            op.name: mpidp.reducescatter(
                x, name=f"{name}.{op.name}", op=op, prescale_factor=0.5, postscale_factor=3.0
            )
            for op in RS_OPS
        }

    outs = run_all(body)
    check(
        [
            (f"{op.name} scaled", outs[op.name], rs_expected(r, n, dtype, op, dim0, 0.5, 3.0))
            for op in RS_OPS
        ]
    )


@pytest.mark.mpi
def test_reducescatter_default_op_is_average():
    name = "test_reducescatter_default_op_is_average"
    r, n = rank(), size()
    dim0 = 3 * n + 1
    out = run_all(mpidp.reducescatter, rs_input(r, torch.float32, dim0), name=name)
    check([("default op", out, rs_expected(r, n, torch.float32, mpidp.Average, dim0))])


@pytest.mark.mpi
def test_grouped_reducescatter(device):
    name = f"test_grouped_reducescatter.{device.type}"
    r, n = rank(), size()
    specs = [(torch.float32, 2 * n + 1), (torch.int32, n), (torch.float64, 1)]
    xs = [rs_input(r, d, dim0).to(device) for d, dim0 in specs]

    def body():
        sums = mpidp.grouped_reducescatter(xs, name=f"{name}.sum", op=mpidp.Sum)
        avgs = mpidp.synchronize(mpidp.grouped_reducescatter_async(xs, name=f"{name}.avg"))
        return sums, avgs

    sums, avgs = run_all(body)
    extra = [
        f"{w}: expected a list of 3"
        for w, o in (("sum", sums), ("avg", avgs))
        if not isinstance(o, list) or len(o) != 3
    ]
    check(
        [
            (f"grouped_reducescatter Sum[{i}]", o, rs_expected(r, n, d, mpidp.Sum, dim0))
            for i, (o, (d, dim0)) in enumerate(zip(sums, specs))
        ]
        + [
            (
                f"grouped_reducescatter_async Average[{i}]",
                o,
                rs_expected(r, n, d, mpidp.Average, dim0),
            )
            for i, (o, (d, dim0)) in enumerate(zip(avgs, specs))
        ],
        extra,
        device,
    )


# ---- edge cases shared by several ops ----


@pytest.mark.mpi
def test_empty_tensors(device):
    name = f"test_empty_tensors.{device.type}"

    def empty(*shape):
        return torch.empty(*shape, device=device)

    def body():
        return {
            "broadcast": mpidp.broadcast(empty(0, 3), 0, name=f"{name}.bc"),
            "allgather": mpidp.allgather(empty(0, 3), name=f"{name}.ag"),
            "reducescatter": mpidp.reducescatter(empty(0, 3), op=mpidp.Sum, name=f"{name}.rs"),
            "alltoall": mpidp.alltoall(empty(0, 3), name=f"{name}.a2a"),
            "grouped_allreduce": mpidp.grouped_allreduce(
                [empty(0), torch.ones(1, device=device)], op=mpidp.Sum, name=f"{name}.g"
            )[0],
        }

    outs = run_all(body)
    want = {k: torch.empty(0, 3) for k in ("broadcast", "allgather", "reducescatter", "alltoall")}
    want["grouped_allreduce"] = torch.empty(0)
    check([(k, outs[k], v) for k, v in want.items()], device=device)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16], ids=dtype_id)
def test_in_place_ops_on_views_touch_only_the_view(dtype):
    """In-place ops on a contiguous view write the view's elements and nothing around them."""
    name = f"test_in_place_ops_on_views_touch_only_the_view.{dtype_id(dtype)}"
    r, n = rank(), size()
    big = torch.full((4, 5), 7).to(dtype)
    big[1] = r + 1
    big[2] = 10 * r

    def body():
        mpidp.allreduce_(big[1], op=mpidp.Sum, name=f"{name}.ar")
        mpidp.broadcast_(big[2], n - 1, name=f"{name}.bc")
        mpidp.grouped_allreduce_([big[3, 1:3]], op=mpidp.Max, name=f"{name}.g")
        return big

    out = run_all(body)
    want = torch.full((4, 5), 7).to(dtype)
    want[1] = n * (n + 1) // 2
    want[2] = 10 * (n - 1)
    check([("tensor around the views", out, want)])


@pytest.mark.mpi
def test_same_name_reused_across_op_types():
    """One name used in turn by every op type (each twice: negotiated, then from the cache)."""
    name = "test_same_name_reused_across_op_types"
    r, n = rank(), size()
    steps = [
        (
            "allreduce",
            lambda: mpidp.allreduce(torch.ones(2), op=mpidp.Sum, name=name),
            torch.full((2,), float(n)),
        ),
        ("allgather", lambda: mpidp.allgather(torch.tensor([r]), name=name), torch.arange(n)),
        (
            "broadcast root 0",
            lambda: mpidp.broadcast(torch.tensor([r]), 0, name=name),
            torch.tensor([0]),
        ),
        (
            "broadcast last root",
            lambda: mpidp.broadcast(torch.tensor([r]), n - 1, name=name),
            torch.tensor([n - 1]),
        ),
        ("alltoall", lambda: mpidp.alltoall(torch.full((n,), r), name=name), torch.arange(n)),
        (
            "reducescatter",
            lambda: mpidp.reducescatter(torch.ones(n, 2), op=mpidp.Sum, name=name),
            torch.full((1, 2), float(n)),
        ),
        (
            "allreduce int",
            lambda: mpidp.allreduce(torch.ones(2, dtype=torch.int32), op=mpidp.Max, name=name),
            torch.ones(2, dtype=torch.int32),
        ),
    ]

    def body():
        return [(f"{what} #{i}", fn(), want) for what, fn, want in steps for i in range(2)]

    check(run_all(body))


@pytest.mark.mpi
def test_reducescatter_takes_horovods_arguments_and_compression():
    """Horovod's order: (tensor, name, compression, op, process_set, prescale, postscale);
    compression casts on the wire and back. An op in compression's place is refused clearly."""
    name = "test_reducescatter_takes_horovods_arguments"
    n, r = size(), rank()
    x = torch.arange(2 * n * 3, dtype=torch.float32).reshape(2 * n, 3) + r
    want = (
        sum(torch.arange(2 * n * 3, dtype=torch.float32).reshape(2 * n, 3) + k for k in range(n))
    )[2 * r : 2 * r + 2]
    got = run_all(
        mpidp.reducescatter, x, f"{name}.a", mpidp.Compression.fp16, mpidp.Sum, None, 1.0, 1.0
    )
    grouped = run_all(
        mpidp.grouped_reducescatter, [x, x * 2], f"{name}.g", mpidp.Compression.fp16, mpidp.Sum
    )
    ok = (
        got.dtype == torch.float32
        and torch.equal(got, want)
        and torch.equal(grouped[0], want)
        and torch.equal(grouped[1], want * 2)
    )
    assert_all(ok, f"{got} vs {want}; grouped {grouped}")
    for fn, arg in ((mpidp.reducescatter, x), (mpidp.grouped_reducescatter, [x])):
        raises_all(TypeError, fn, arg, f"{name}.bad", mpidp.Sum, match="pass op= by keyword")
