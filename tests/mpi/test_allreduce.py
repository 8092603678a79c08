"""allreduce in every form (blocking, in place, async, grouped) for every reduce op and dtype."""

import warnings

import pytest
import torch
from mpi_util import (
    DTYPES,
    FLOAT_DTYPES,
    SIGNED_DTYPES,
    assert_all,
    dtype_id,
    int_average,
    raises_all,
    rank,
    run_all,
    size,
    tensor_diff,
)

import mpidp

OPS = [mpidp.Average, mpidp.Sum, mpidp.Min, mpidp.Max, mpidp.Product]


def op_id(op) -> str:
    return op.name.lower()


def make_input(r: int, dtype, op, shape=(2, 3)) -> torch.Tensor:
    """Rank r's contribution: small exact values, chosen per dtype so every reduction is exact."""
    n = 1
    for d in shape:
        n *= d
    i = torch.arange(n, dtype=torch.int64).reshape(shape)
    if dtype == torch.bool:
        return (i + 2 * r) % 5 < 3
    signed = dtype in SIGNED_DTYPES or dtype.is_floating_point
    if op == mpidp.Product:
        # |product| <= 2**size = 16 at n=4: fits uint8 and int8.
        vals = torch.tensor([-1, 1, 2])[(i + r) % 3] if signed else 1 + (i + r) % 2
    else:
        vals = (2 * i + 3 * r) % 7
        if signed:
            vals = vals - 3  # negatives: integer Average truncates toward zero, as Horovod
    return vals.to(dtype)


def reference(dtype, op, n: int, pre: float = 1.0, post: float = 1.0, shape=(2, 3)):
    """What every rank must get, computed in int64/float64 from every rank's input."""
    xs = [make_input(r, dtype, op, shape) for r in range(n)]
    if dtype == torch.bool:
        stack = torch.stack(xs)
        # Sum and Max are logical or; Min and Product logical and.
        return stack.any(0) if op in (mpidp.Sum, mpidp.Max) else stack.all(0)
    if dtype.is_floating_point:
        stack = torch.stack([x.double() * pre for x in xs])
    else:
        stack = torch.stack([x.long() for x in xs])
    if op == mpidp.Sum:
        out = stack.sum(0)
    elif op == mpidp.Average:
        out = stack.sum(0) / n if dtype.is_floating_point else int_average(stack.sum(0), n)
    elif op == mpidp.Min:
        out = stack.amin(0)
    elif op == mpidp.Max:
        out = stack.amax(0)
    else:
        out = stack.prod(0)
    if dtype.is_floating_point:
        out = out * post
    return out.to(dtype)


def _all_forms(x, expected, name, **kwargs):
    """Run the four allreduce forms on copies of x; return a list of problems on this rank."""
    problems = []
    orig = x.clone()
    out = mpidp.allreduce(x, name=f"{name}.oop", **kwargs)
    inplace = x.clone()
    ret = mpidp.allreduce_(inplace, name=f"{name}.ip", **kwargs)
    a = x.clone()
    b = x.clone()
    h1 = mpidp.allreduce_async(a, name=f"{name}.async", **kwargs)
    h2 = mpidp.allreduce_async_(b, name=f"{name}.async_", **kwargs)
    out_async = mpidp.synchronize(h1)
    ret2 = mpidp.synchronize(h2)
    for what, got in (
        ("allreduce", out),
        ("allreduce_ (tensor)", inplace),
        ("allreduce_ (returned)", ret),
        ("allreduce_async", out_async),
        ("allreduce_async_ (tensor)", b),
        ("allreduce_async_ (returned)", ret2),
    ):
        diff = tensor_diff(got, expected)
        if diff:
            problems.append(f"{what}: {diff}")
    for what, inp in (("allreduce", x), ("allreduce_async", a)):
        if not torch.equal(inp, orig):
            problems.append(f"out-of-place {what} modified its input: {inp.tolist()}")
    if ret.data_ptr() != inplace.data_ptr() or ret2.data_ptr() != b.data_ptr():
        problems.append("in-place form did not return the input's storage")
    if out.data_ptr() == x.data_ptr():
        problems.append("out-of-place allreduce returned the input's storage")
    return problems


@pytest.mark.mpi
@pytest.mark.parametrize("op", OPS, ids=op_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_allreduce_dtype_op(dtype, op, device):
    name = f"test_allreduce_dtype_op.{dtype_id(dtype)}.{op_id(op)}.{device.type}"
    x = make_input(rank(), dtype, op).to(device)
    if dtype == torch.bool and op == mpidp.Average:
        raises_all(TypeError, mpidp.allreduce, x, op=op, name=name, match="bool")
        raises_all(TypeError, mpidp.allreduce_async_, x.clone(), op=op, name=name, match="Average")
        return
    expected = reference(dtype, op, size()).to(device)
    problems = run_all(_all_forms, x, expected, name, op=op)
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
@pytest.mark.parametrize("op", OPS, ids=op_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_allreduce_prescale_postscale(dtype, op, device):
    name = f"test_allreduce_prescale_postscale.{dtype_id(dtype)}.{op_id(op)}.{device.type}"
    pre, post = 0.5, 3.0
    x = make_input(rank(), dtype, op).to(device)
    expected = reference(dtype, op, size(), pre, post).to(device)
    problems = run_all(
        _all_forms, x, expected, name, op=op, prescale_factor=pre, postscale_factor=post
    )
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
@pytest.mark.parametrize("op", [mpidp.Sum, mpidp.Average], ids=op_id)
@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64], ids=dtype_id)
def test_integer_scale_factors_follow_horovods_rule(dtype, op, device):
    """Integers take scale factors as in Horovod: times the double factor, cast back
    (truncated toward zero), before the sum (prescale) and after it (postscale, with 1/size
    folded in for Average)."""
    name = (
        f"test_integer_scale_factors_follow_horovods_rule.{dtype_id(dtype)}.{op_id(op)}."
        f"{device.type}"
    )
    pre, post, n = 1.5, 0.75, size()
    x = make_input(rank(), dtype, op).to(device)
    total = sum((make_input(r, dtype, op).double() * pre).trunc() for r in range(n))
    expected = (total * (post / n if op == mpidp.Average else post)).trunc().to(dtype).to(device)
    problems = run_all(
        _all_forms, x, expected, name, op=op, prescale_factor=pre, postscale_factor=post
    )
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
def test_allreduce_default_op_is_average_and_average_kwarg():
    name = "test_allreduce_default_op_is_average_and_average_kwarg"
    x = make_input(rank(), torch.float32, mpidp.Sum)

    def body():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            avg_kw = mpidp.allreduce(x, average=True, name=f"{name}.avg")
            sum_kw = mpidp.allreduce(x, average=False, name=f"{name}.sum")
        default = mpidp.allreduce(x, name=f"{name}.default")
        deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
        return default, avg_kw, sum_kw, len(deprecations)

    default, avg_kw, sum_kw, n_warn = run_all(body)
    avg = reference(torch.float32, mpidp.Average, size())
    total = reference(torch.float32, mpidp.Sum, size())
    problems = [
        f"{w}: {d}"
        for w, d in (
            ("default op", tensor_diff(default, avg)),
            ("average=True", tensor_diff(avg_kw, avg)),
            ("average=False", tensor_diff(sum_kw, total)),
        )
        if d
    ]
    if n_warn < 2:
        problems.append(f"average= gave {n_warn} DeprecationWarning(s), expected 2")
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32], ids=dtype_id)
def test_allreduce_large_tensor_chunked(dtype, device):
    """A tensor above the fusion size and the 4 MiB chunk size: reduced alone, in chunks."""
    name = f"test_allreduce_large_tensor_chunked.{dtype_id(dtype)}.{device.type}"
    n_elems = (4 * 1024 * 1024) // 4 + 12345  # > chunk_bytes for 4-byte dtypes
    r, n = rank(), size()
    base = torch.arange(n_elems, dtype=torch.int64, device=device) % 11
    x = (base + r).to(dtype)
    expected = (base * n + n * (n - 1) // 2).to(dtype)

    def body():
        out = mpidp.allreduce(x, op=mpidp.Sum, name=f"{name}.oop")
        y = x.clone()
        mpidp.allreduce_(y, op=mpidp.Sum, name=f"{name}.ip")
        return out, y

    out, y = run_all(body)
    problems = [d for d in (tensor_diff(out, expected), tensor_diff(y, expected)) if d]
    if not torch.equal(x, (base + r).to(dtype)):
        problems.append("input modified")
    assert_all(not problems, "; ".join(p[:300] for p in problems))


@pytest.mark.mpi
def test_allreduce_scalar_and_empty(device):
    name = f"test_allreduce_scalar_and_empty.{device.type}"
    r, n = rank(), size()

    def body():
        s = mpidp.allreduce(
            torch.tensor(float(r), device=device), op=mpidp.Sum, name=f"{name}.scalar"
        )
        e = mpidp.allreduce(torch.empty(0, 3, device=device), op=mpidp.Sum, name=f"{name}.empty")
        return s, e

    s, e = run_all(body)
    problems = [
        d
        for d in (
            tensor_diff(s, torch.tensor(float(n * (n - 1) // 2), device=device)),
            tensor_diff(e, torch.empty(0, 3, device=device)),
        )
        if d
    ]
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
def test_grouped_allreduce_all_forms(device):
    name = f"test_grouped_allreduce_all_forms.{device.type}"
    r, n = rank(), size()
    dtypes = [torch.float32, torch.int32, torch.float64, torch.bfloat16, torch.uint8]
    shapes = [(3,), (2, 2), (), (5,), (1, 4)]
    xs = [
        make_input(r, d, mpidp.Sum, s if s else (1,)).reshape(s).to(device)
        for d, s in zip(dtypes, shapes)
    ]
    expected = [
        reference(d, mpidp.Sum, n, shape=s if s else (1,)).reshape(s).to(device)
        for d, s in zip(dtypes, shapes)
    ]
    originals = [x.clone() for x in xs]

    def body():
        outs = {}
        outs["grouped_allreduce"] = mpidp.grouped_allreduce(xs, op=mpidp.Sum, name=f"{name}.g")
        ip = [x.clone() for x in xs]
        ret = mpidp.grouped_allreduce_(ip, op=mpidp.Sum, name=f"{name}.g_")
        outs["grouped_allreduce_ (tensors)"] = ip
        outs["grouped_allreduce_ (returned)"] = ret
        ip2 = [x.clone() for x in xs]
        h1 = mpidp.grouped_allreduce_async(xs, op=mpidp.Sum, name=f"{name}.ga")
        h2 = mpidp.grouped_allreduce_async_(ip2, op=mpidp.Sum, name=f"{name}.ga_")
        outs["grouped_allreduce_async"] = mpidp.synchronize(h1)
        outs["grouped_allreduce_async_ (returned)"] = mpidp.synchronize(h2)
        outs["grouped_allreduce_async_ (tensors)"] = ip2
        return outs

    outs = run_all(body)
    problems = []
    for what, got in outs.items():
        if not isinstance(got, list) or len(got) != len(xs):
            problems.append(f"{what}: expected a list of {len(xs)}, got {type(got).__name__}")
            continue
        for i, (g, e) in enumerate(zip(got, expected)):
            d = tensor_diff(g, e)
            if d:
                problems.append(f"{what}[{i}]: {d}")
    if not all(torch.equal(a, b) for a, b in zip(xs, originals)):
        problems.append("out-of-place grouped allreduce modified its inputs")
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
def test_grouped_allreduce_average_and_scale(device):
    name = f"test_grouped_allreduce_average_and_scale.{device.type}"
    n = size()
    xs = [
        make_input(rank(), torch.float32, mpidp.Average, (4,)).to(device),
        make_input(rank(), torch.float64, mpidp.Average, (2, 2)).to(device),
    ]
    exp = [
        reference(torch.float32, mpidp.Average, n, 2.0, 0.25, (4,)).to(device),
        reference(torch.float64, mpidp.Average, n, 2.0, 0.25, (2, 2)).to(device),
    ]
    outs = run_all(
        mpidp.grouped_allreduce, xs, name=name, prescale_factor=2.0, postscale_factor=0.25
    )
    problems = [d for d in (tensor_diff(o, e) for o, e in zip(outs, exp)) if d]
    assert_all(not problems, "; ".join(problems))
