"""Loops written for DDP: what runs between backward() and step() sees averaged gradients."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mpi_util import assert_all, gather, max_deviation, my_rows, raises_all, row_batches, run_all

import mpidp
from mpidp.training.step_state import Phase

ROWS = 3  # rows per rank


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _batches(steps):
    return row_batches(steps, ROWS, seed=4)


def _mine(t):
    return my_rows(t, ROWS)


_deviation = max_deviation


def _bitwise_alike(model):
    mine = [p.detach().clone() for p in model.parameters()]
    return all(all(torch.equal(a, b) for a, b in zip(mine, other)) for other in gather(mine))


def _wrapped(model, make, overlapping):
    opt = mpidp.DistributedOptimizer(
        make(model.parameters()), named_parameters=model.named_parameters()
    )
    opt._overlap = overlapping
    return opt


@pytest.mark.mpi
@pytest.mark.parametrize("overlapping", [False, True], ids=["at_end", "overlapped"])
def test_clipping_between_backward_and_step_without_synchronize(overlapping):
    """The DDP loop: backward, clip_grad_norm_, step. The clip sees the averaged gradients
    (overlapping, it raced the reductions and the replicas drifted apart)."""
    model = _model()
    ref = copy.deepcopy(model)
    opt = _wrapped(model, lambda ps: torch.optim.SGD(ps, lr=0.5), overlapping)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for x, y in _batches(3):
        opt.zero_grad()
        (F.cross_entropy(model(_mine(x)), _mine(y)) * 50).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        run_all(opt.step)
        ref_opt.zero_grad()
        (F.cross_entropy(ref(x), y) * 50).backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
    err = _deviation(model, ref)
    assert_all(err < 1e-10 and _bitwise_alike(model), f"deviation {err}")


@pytest.mark.mpi
@pytest.mark.parametrize("overlapping", [False, True], ids=["at_end", "overlapped"])
@pytest.mark.parametrize("kind", ["sgd", "lbfgs"])
def test_step_with_a_closure_averages_each_evaluation(kind, overlapping):
    """step(closure): the closure's gradients are averaged (they were stepped unreduced, and
    the replicas drifted apart), and so is its loss, so that LBFGS's line search decides alike
    on every rank: the run equals one process on the whole batch."""
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.3, momentum=0.5),
        "lbfgs": lambda ps: torch.optim.LBFGS(
            ps, lr=0.5, max_iter=4, line_search_fn="strong_wolfe"
        ),
    }[kind]
    model = _model()
    ref = copy.deepcopy(model)
    opt = _wrapped(model, make, overlapping)
    ref_opt = make(ref.parameters())
    losses = []
    for x, y in _batches(3):

        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(_mine(x)), _mine(y))
            loss.backward()
            return loss

        def ref_closure():
            ref_opt.zero_grad()
            loss = F.cross_entropy(ref(x), y)
            loss.backward()
            return loss

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "reduced a second time"
            got = run_all(opt.step, closure)
        want = ref_opt.step(ref_closure)
        losses.append((float(got), want.item()))
    err = _deviation(model, ref)
    loss_err = max(abs(a - b) for a, b in losses)
    assert_all(
        err < 1e-9 and loss_err < 1e-12 and _bitwise_alike(model),
        f"deviation {err}, losses {losses}",
    )


@pytest.mark.mpi
@pytest.mark.parametrize("overlapping", [False, True], ids=["at_end", "overlapped"])
def test_autograd_grad_after_backward_is_not_a_second_pass(overlapping):
    """torch.autograd.grad on the parameters after backward (gradient-norm logging, GradNorm)
    accumulates nothing into .grad: it was refused as another backward pass."""
    model = _model()
    ref = copy.deepcopy(model)
    opt = _wrapped(model, lambda ps: torch.optim.SGD(ps, lr=0.1), overlapping)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in _batches(2):
        opt.zero_grad()
        loss = F.cross_entropy(model(_mine(x)), _mine(y))
        loss.backward(retain_graph=True)
        norms = run_all(torch.autograd.grad, loss, list(model.parameters()))
        run_all(opt.step)
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    err = _deviation(model, ref)
    assert_all(err < 1e-10 and len(norms) == 4, f"deviation {err}")


@pytest.mark.mpi
def test_a_user_hook_returning_a_value_is_named():
    model = _model()
    model[0].weight.register_post_accumulate_grad_hook(lambda p: p.grad * 1)
    opt = _wrapped(model, lambda ps: torch.optim.SGD(ps, lr=0.1), False)
    x, y = _batches(1)[0]
    err = raises_all(
        RuntimeError,
        lambda: F.cross_entropy(model(_mine(x)), _mine(y)).backward(),
        match="must return None",
    )
    assert_all(err is not None)
    del opt


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b = nn.Linear(4, 2).double(), nn.Linear(4, 2).double()


@pytest.mark.mpi
@pytest.mark.parametrize("overlapping", [False, True], ids=["at_end", "overlapped"])
def test_ranks_reaching_different_parameters_over_two_backward_passes(overlapping):
    """Two backward passes per step; the first reaches head b on rank 0 only (data-dependent),
    the second reaches b everywhere. Each pass's end reduces every gradient on every rank (zeros
    where it reached none), so the ranks stay in step whatever their losses reach (when only
    complete ranks reduced at the end, rank 0 reduced once more than the others: a hang)."""
    model = _TwoHeads()
    ref = copy.deepcopy(model)
    opt = _wrapped(model, lambda ps: torch.optim.SGD(ps, lr=0.1), overlapping)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    n = mpidp.size()

    def first(m, x, r):
        return (m.a(x) + (m.b(x) if r == 0 else 0)).pow(2).mean()

    def second(m, x):
        return m.b(x).sin().mean()

    for x, _ in _batches(3):
        opt.zero_grad()
        first(model, _mine(x), mpidp.rank()).backward()
        second(model, _mine(x)).backward()
        run_all(opt.step)
        ref_opt.zero_grad()
        rows = [x[k * ROWS : (k + 1) * ROWS] for k in range(n)]
        (sum(first(ref, xr, k) + second(ref, xr) for k, xr in enumerate(rows)) / n).backward()
        ref_opt.step()
    err = _deviation(model, ref)
    assert_all(err < 1e-10 and _bitwise_alike(model), f"deviation {err}")


@pytest.mark.mpi
@pytest.mark.parametrize("whole", [False, True], ids=["head_outside", "all_inside"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_segments_reduce_once_at_the_outer_end(reentrant, whole):
    """A reentrant checkpoint runs a backward pass nested in the outer one: its end is not the
    step's (the outer pass's is), so nothing is reduced before every gradient is there."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(2)
    model = nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)
    ).double()
    ref = copy.deepcopy(model)
    opt = _wrapped(model, lambda ps: torch.optim.SGD(ps, lr=0.2), True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    for x, y in _batches(3):
        opt.zero_grad()
        xin = _mine(x).clone().requires_grad_(True)
        h = checkpoint(model[:2], xin, use_reentrant=reentrant)
        h = checkpoint(model[2:] if whole else model[2:4], h, use_reentrant=reentrant)
        F.cross_entropy(h if whole else model[4](h), _mine(y)).backward()
        reduced = opt.step_state.phase is Phase.REDUCED
        run_all(opt.step)
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    err = _deviation(model, ref)
    assert_all(
        err < 1e-10 and reduced and _bitwise_alike(model),
        f"deviation {err}, reduced in backward {reduced}",
    )


class _EmbedAndHead(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.emb = nn.Embedding(10, 4, sparse=True).double()
        self.head = nn.Linear(4, 2).double()


@pytest.mark.mpi
@pytest.mark.parametrize("overlapping", [False, True], ids=["at_end", "overlapped"])
def test_two_optimizers_whose_gradients_come_in_a_different_order_on_each_rank(overlapping):
    """One optimizer per part (one sparse); each rank's loss reaches them in its own order.
    The backward pass's end completes them in creation order on every rank (in the order their
    gradients came, each rank waited for the other's first optimizer: a hang), and each one's
    sparse kinds are agreed under its own name (the two agreements were matched across ranks)."""
    model = _EmbedAndHead()
    ref = copy.deepcopy(model)
    opts = [
        _wrapped(m, lambda ps: torch.optim.SGD(ps, lr=0.1), overlapping)
        for m in (model.emb, model.head)
    ]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    n, r = mpidp.size(), mpidp.rank()
    g = torch.Generator().manual_seed(9)

    def loss(m, ids, k):
        e = m.emb(ids).sum(0)
        return (m.head(e).pow(2).sum() + e.sum()) if k % 2 else (e.sum() + m.head(e).pow(2).sum())

    for _ in range(3):
        ids = torch.randint(0, 10, (n, 3), generator=g)
        for o in opts:
            o.zero_grad()
        loss(model, ids[r], r).backward()
        for o in opts:
            run_all(o.step)
        ref_opt.zero_grad()
        (sum(loss(ref, ids[k], k) for k in range(n)) / n).backward()
        ref_opt.step()
    err = _deviation(model, ref)
    assert_all(err < 1e-10 and _bitwise_alike(model), f"deviation {err}")


@pytest.mark.mpi
@pytest.mark.parametrize("in_backward", [True, False])
def test_a_disabled_sharded_grad_scaler_still_reduces(in_backward):
    """ShardedGradScaler(enabled=False) stepped inside skip_synchronize() without having
    reduced anything: the replicas drifted apart when backward did not reduce."""
    from test_optimizer import _reinit

    try:
        run_all(_reinit, reduce_in_backward=in_backward)
        model = _model()
        ref = copy.deepcopy(model)
        opt = _wrapped(model, lambda ps: torch.optim.SGD(ps, lr=0.1), False)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        scaler = mpidp.ShardedGradScaler("cpu", enabled=False)
        for x, y in _batches(2):
            opt.zero_grad()
            scaler.scale(F.cross_entropy(model(_mine(x)), _mine(y))).backward()
            run_all(scaler.step, opt)
            scaler.update()
            ref_opt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            ref_opt.step()
        err = _deviation(model, ref)
        assert_all(err < 1e-10 and _bitwise_alike(model), f"deviation {err}")
    finally:
        run_all(_reinit)
