"""Gradients of the differentiable collectives match Horovod's rules (allreduce, allgather, ...)."""

import pytest
import torch
from mpi_util import assert_all, raises_all, rank, run_all, size, tensor_diff

import mpidp


def weights(r: int, shape) -> torch.Tensor:
    """A rank-dependent upstream gradient d(loss_r)/d(output)."""
    n = 1
    for d in shape:
        n *= d
    return ((torch.arange(n, dtype=torch.float64) + 1) * (r + 1) % 7 + 0.5).reshape(shape)


def grad_of(fn, x, w):
    """Run y = fn(x), backprop sum(y * w); returns (y, x.grad) (x.grad None if not reached)."""
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    out = y[0] if isinstance(y, tuple) else y
    (out * w).sum().backward()
    return y, x.grad


def check_grad(label, fn, x, w, expected):
    result = run_all(grad_of, fn, x, w)
    _, grad = result
    d = "no gradient reached the input" if grad is None else tensor_diff(grad, expected)
    assert_all(not d, f"{label}: {d}")
    return result


@pytest.mark.mpi
@pytest.mark.parametrize("op", [mpidp.Sum, mpidp.Average], ids=lambda o: o.name.lower())
def test_allreduce_gradient(op):
    name = f"test_allreduce_gradient.{op.name.lower()}"
    r, n = rank(), size()
    x = torch.arange(4, dtype=torch.float64) + r
    ws = [weights(k, (4,)) for k in range(n)]
    total = sum(ws)
    expected = total / n if op == mpidp.Average else total
    y, _ = check_grad(
        "allreduce", lambda t: mpidp.allreduce(t, op=op, name=name), x, ws[r], expected
    )
    assert_all(y.requires_grad and y.grad_fn is not None, "allreduce output has no grad_fn")


@pytest.mark.mpi
def test_allreduce_gradient_with_scale_factors():
    name = "test_allreduce_gradient_with_scale_factors"
    r, n = rank(), size()
    x = torch.arange(3, dtype=torch.float32) - r
    ws = [weights(k, (3,)).float() for k in range(n)]
    expected = (sum(w * 2.0 for w in ws) / n) * 0.5
    check_grad(
        "scaled allreduce",
        lambda t: mpidp.allreduce(
            t, op=mpidp.Average, name=name, prescale_factor=2.0, postscale_factor=0.5
        ),
        x,
        ws[r],
        expected,
    )


@pytest.mark.mpi
def test_allgather_gradient():
    name = "test_allgather_gradient"
    r, n = rank(), size()
    rows = [k + 1 for k in range(n)]
    total = sum(rows)
    x = torch.ones(rows[r], 2, dtype=torch.float64) * r
    ws = [weights(k, (total, 2)) for k in range(n)]
    mean = sum(ws) / n  # Horovod: average the gathered gradient, keep this rank's rows
    start = sum(rows[:r])
    check_grad(
        "allgather",
        lambda t: mpidp.allgather(t, name=name),
        x,
        ws[r],
        mean[start : start + rows[r]],
    )


@pytest.mark.mpi
def test_allgather_gradient_of_scalar():
    name = "test_allgather_gradient_of_scalar"
    r, n = rank(), size()
    ws = [weights(k, (n,)) for k in range(n)]
    check_grad(
        "allgather of a scalar",
        lambda t: mpidp.allgather(t, name=name),
        torch.tensor(float(r), dtype=torch.float64),
        ws[r],
        (sum(ws) / n)[r],
    )


@pytest.mark.mpi
def test_broadcast_gradient_every_root():
    name = "test_broadcast_gradient_every_root"
    r, n = rank(), size()
    ws = [weights(k, (2, 3)) for k in range(n)]
    x = torch.full((2, 3), float(r), dtype=torch.float64)
    for root in range(n):
        expected = sum(ws) / n if r == root else torch.zeros(2, 3, dtype=torch.float64)
        y, _ = check_grad(
            f"broadcast from {root}",
            lambda t: mpidp.broadcast(t, root, name=f"{name}.{root}"),
            x,
            ws[r],
            expected,
        )
        d = tensor_diff(y.detach(), torch.full((2, 3), float(root), dtype=torch.float64))
        assert_all(not d, f"broadcast from {root} forward: {d}")


def _code(sender, dest, k):
    return sender * 16 + dest * 4 + k + 0.5


@pytest.mark.mpi
@pytest.mark.parametrize("with_splits", [False, True], ids=["even", "splits"])
def test_alltoall_gradient(with_splits):
    name = f"test_alltoall_gradient.{with_splits}"
    r, n = rank(), size()

    def splits_of(k):
        return [(k + j) % 3 + 1 for j in range(n)] if with_splits else [2] * n

    splits = splits_of(r)
    x = torch.tensor([[float(j)] for j in range(n) for _ in range(splits[j])], dtype=torch.float64)
    # Upstream gradient of the received rows: row k from sender j carries code(j, r, k).
    w = torch.tensor(
        [[_code(j, r, k)] for j in range(n) for k in range(splits_of(j)[r])], dtype=torch.float64
    )
    # So the gradient of the row k this rank sent to j is code(r, j, k).
    expected = torch.tensor(
        [[_code(r, j, k)] for j in range(n) for k in range(splits[j])], dtype=torch.float64
    )

    def fn(t):
        if with_splits:
            return mpidp.alltoall(t, splits=splits, name=name)
        return mpidp.alltoall(t, name=name)

    y, _ = check_grad("alltoall", fn, x, w, expected)
    assert_all(
        isinstance(y, tuple) == with_splits,
        f"alltoall returned {type(y).__name__} with_splits={with_splits}",
    )


@pytest.mark.mpi
def test_alltoall_gradient_with_unsent_rows():
    """Splits may sum to less than dim 0 (API.md); the rows not sent get a zero gradient."""
    name = "test_alltoall_gradient_with_unsent_rows"
    r, n = rank(), size()
    splits = [1] * n
    x = torch.ones(n + 2, 1, dtype=torch.float64)  # two spare rows
    w = torch.tensor([[_code(j, r, 0)] for j in range(n)], dtype=torch.float64)
    expected = torch.tensor(
        [[_code(r, j, 0)] for j in range(n)] + [[0.0], [0.0]], dtype=torch.float64
    )
    check_grad(
        "alltoall with unsent rows",
        lambda t: mpidp.alltoall(t, splits=splits, name=name),
        x,
        w,
        expected,
    )


@pytest.mark.timeout(60)
@pytest.mark.mpi
def test_alltoall_gradient_without_splits_when_ranks_hold_different_row_counts():
    """No splits, dim 0 divisible on each rank but different per rank (rank r holds (r + 1) * n
    rows, r + 1 to each peer): the gradient goes back as each rank received, not as it sent."""
    name = "test_alltoall_gradient_without_splits_uneven_ranks"
    r, n = rank(), size()
    sent = [r + 1] * n
    x = torch.tensor([[float(j)] for j in range(n) for _ in range(sent[j])], dtype=torch.float64)
    w = torch.tensor(
        [[_code(j, r, k)] for j in range(n) for k in range(j + 1)], dtype=torch.float64
    )
    expected = torch.tensor(
        [[_code(r, j, k)] for j in range(n) for k in range(sent[j])], dtype=torch.float64
    )
    check_grad(
        "alltoall without splits, rows differing per rank",
        lambda t: mpidp.alltoall(t, name=name),
        x,
        w,
        expected,
    )


@pytest.mark.mpi
def test_alltoall_without_splits_refuses_uneven_rows_with_grad_too():
    """dim 0 not divisible by the size, no splits: refused as the plain call refuses it (with
    requires_grad, each rank's last rows were dropped silently)."""
    n = size()
    if n == 1:
        pytest.skip("any dim 0 divides among one rank")
    for grad in (False, True):
        x = torch.ones(n + 1, 1, requires_grad=grad)
        raises_all(
            ValueError, mpidp.alltoall, x, name=f"uneven.{grad}", match="does not divide evenly"
        )


@pytest.mark.mpi
@pytest.mark.parametrize("op", [mpidp.Sum, mpidp.Average], ids=lambda o: o.name.lower())
def test_reducescatter_gradient(op):
    name = f"test_reducescatter_gradient.{op.name.lower()}"
    r, n = rank(), size()
    dim0 = 2 * n + 1
    rows = [dim0 // n + (1 if k < dim0 % n else 0) for k in range(n)]
    x = torch.ones(dim0, 2, dtype=torch.float64) * (r + 1)
    ws = [weights(k, (rows[k], 2)) for k in range(n)]
    full = torch.cat(ws)
    expected = full * n if op == mpidp.Sum else full  # Horovod: size x for Sum, 1 x Average
    check_grad(
        "reducescatter", lambda t: mpidp.reducescatter(t, name=name, op=op), x, ws[r], expected
    )


@pytest.mark.mpi
def test_reducescatter_gradient_with_scale_factors():
    name = "test_reducescatter_gradient_with_scale_factors"
    r, n = rank(), size()
    rows = [2] * n
    x = torch.ones(2 * n, 2, dtype=torch.float64)
    ws = [weights(k, (rows[k], 2)) for k in range(n)]
    expected = torch.cat(ws) * n * 2.0 * 0.25  # Horovod: allgather(grad) * size * pre * post
    check_grad(
        "scaled reducescatter",
        lambda t: mpidp.reducescatter(
            t, name=name, op=mpidp.Sum, prescale_factor=2.0, postscale_factor=0.25
        ),
        x,
        ws[r],
        expected,
    )


@pytest.mark.mpi
def test_grouped_allreduce_gradient():
    name = "test_grouped_allreduce_gradient"
    r, n = rank(), size()
    ws = [weights(k, (3,)) for k in range(n)]

    def fn(t):
        return mpidp.grouped_allreduce([t, t * 2], op=mpidp.Sum, name=name)[1]

    check_grad("grouped_allreduce", fn, torch.ones(3, dtype=torch.float64), ws[r], sum(ws) * 2)


@pytest.mark.mpi
def test_grouped_allgather_gradient_is_allgathers_per_tensor():
    """Each tensor of the group gets allgather's gradient (the gathered gradient averaged over
    the ranks, this rank's rows), as Horovod's grouped_allgather does."""
    name = "test_grouped_allgather_gradient"
    r, n = rank(), size()
    rows = [[k + 1 for k in range(n)], [2 * (n - k) for k in range(n)]]
    xs = [
        torch.full((rows[0][r], 2), float(r), dtype=torch.float64, requires_grad=True),
        torch.full((rows[1][r],), float(r), dtype=torch.float64, requires_grad=True),
        torch.tensor(float(r), dtype=torch.float64, requires_grad=True),
    ]
    totals = [sum(rows[0]), sum(rows[1]), n]
    ws = [
        [weights(k, (totals[0], 2)), weights(k + 1, (totals[1],)), weights(k + 2, (n,))]
        for k in range(n)
    ]

    def run():
        outs = mpidp.grouped_allgather(xs, name=name)
        sum((o * w).sum() for o, w in zip(outs, ws[r])).backward()
        return [x.grad for x in xs]

    grads = run_all(run)
    means = [sum(ws[k][j] for k in range(n)) / n for j in range(3)]
    starts = [sum(rows[0][:r]), sum(rows[1][:r]), r]
    want = [
        means[0][starts[0] : starts[0] + rows[0][r]],
        means[1][starts[1] : starts[1] + rows[1][r]],
        means[2][r],
    ]
    d = "; ".join(tensor_diff(g, w) for g, w in zip(grads, want) if tensor_diff(g, w))
    assert_all(not d, d)


@pytest.mark.mpi
@pytest.mark.parametrize("op", [mpidp.Sum, mpidp.Average], ids=lambda o: o.name.lower())
def test_grouped_reducescatter_gradient_is_reducescatters_per_tensor(op):
    name = f"test_grouped_reducescatter_gradient.{op.name.lower()}"
    r, n = rank(), size()
    dims = [2 * n + 1, n]
    rows = [[d // n + (1 if k < d % n else 0) for k in range(n)] for d in dims]
    xs = [
        torch.ones(dims[0], 2, dtype=torch.float64, requires_grad=True),
        torch.ones(dims[1], dtype=torch.float64, requires_grad=True),
    ]
    ws = [[weights(k, (rows[0][k], 2)), weights(k + 3, (rows[1][k],))] for k in range(n)]

    def run():
        outs = mpidp.grouped_reducescatter(xs, name=name, op=op, prescale_factor=2.0)
        sum((o * w).sum() for o, w in zip(outs, ws[r])).backward()
        return [x.grad for x in xs]

    grads = run_all(run)
    scale = 2.0 * n if op == mpidp.Sum else 2.0  # as reducescatter's own rule
    want = [torch.cat([ws[k][j] for k in range(n)]) * scale for j in range(2)]
    d = "; ".join(tensor_diff(g, w) for g, w in zip(grads, want) if tensor_diff(g, w))
    assert_all(not d, d)
