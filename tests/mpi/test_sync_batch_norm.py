"""SyncBatchNorm on N ranks' shards equals torch's BatchNorm on the whole batch in one process."""

import copy

import pytest
import torch
from mpi_util import assert_all, gather, raises_all, rank, run_all, size
from torch import nn

import mpidp
from mpidp.training.sync_batch_norm import SyncBatchNorm, _sync_batch_norm

C = 3
STEPS = 3
SPATIAL = {2: (), 3: (5,), 4: (3, 4), 5: (2, 3, 2)}
REFERENCE = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
CONFIGS = {
    "default": {},
    "affine_false": {"affine": False},
    "momentum_none": {"momentum": None},
    "no_running_stats": {"track_running_stats": False},
}
ASYNC_OPS = (
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "allgather_async",
    "grouped_allgather_async",
    "broadcast_async",
    "broadcast_async_",
    "alltoall_async",
    "reducescatter_async",
)


def unequal_sizes(n):
    """Per-rank batch sizes that differ from rank to rank (2, 5, 3, 6, ...)."""
    return [2 + (3 * r) % 5 for r in range(n)]


def shard(t, sizes, r=None):
    """Rank r's rows of the global batch `t` (this rank's by default)."""
    r = rank() if r is None else r
    start = sum(sizes[:r])
    return t[start : start + sizes[r]]


def global_batch(seed, n, spatial, dtype=torch.float64, channels=C):
    """(input, upstream weights) for a global batch of n rows, identical on every rank; channels
    get different scales and offsets so the statistics are not trivial."""
    g = torch.Generator().manual_seed(seed)
    shape = (n, channels) + tuple(spatial)
    view = (1, channels) + (1,) * len(spatial)
    scale = (0.5 + 2 * torch.rand(channels, generator=g, dtype=torch.float64)).reshape(view)
    offset = (3 * torch.randn(channels, generator=g, dtype=torch.float64)).reshape(view)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale + offset
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    return x.to(dtype), w.to(dtype)


def make_pair(ndim, seed, dtype=torch.float64, device="cpu", **config):
    """(reference nn.BatchNorm, SyncBatchNorm) with the same random weight and bias."""
    ref = REFERENCE[ndim](C, **config).to(dtype)
    if ref.affine:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            ref.weight.copy_(1 + torch.randn(C, generator=g, dtype=torch.float64))
            ref.bias.copy_(torch.randn(C, generator=g, dtype=torch.float64))
    sync = SyncBatchNorm(C, **config).to(dtype)
    sync.load_state_dict(ref.state_dict())
    return ref.to(device), sync.to(device)


def forward_backward(module, x, w):
    """out = module(x), backward of sum(out * w); returns (out, x.grad)."""
    x = x.detach().clone().requires_grad_(True)
    out = module(x)
    (out * w).sum().backward()
    return out.detach(), x.grad


def diff(actual, expected, what, tol, exact=False):
    """'' if close (bitwise equal if exact), else a description."""
    if actual is None or expected is None:
        return "" if actual is None and expected is None else f"{what}: {actual} vs {expected}"
    if exact:
        return "" if torch.equal(actual, expected) else f"{what}: not bitwise equal"
    try:
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)
    except AssertionError as e:
        return f"{what}: {e}"
    return ""


def summed(t):
    """Sum over ranks, in rank order (mpi4py, independent of mpidp), on t's device."""
    return None if t is None else sum(gather(t.detach().cpu())).to(t.device)


def compare_step(ref, sync, sizes, x, w, tol, label):
    """One training step of both modules; collective check of outputs, input gradients (this
    rank's slice), weight/bias gradients (summed over ranks) and running statistics."""
    out_ref, gx_ref = forward_backward(ref, x, w)
    out, gx = run_all(forward_backward, sync, shard(x, sizes), shard(w, sizes))
    exact = size() == 1  # a world of one is plain BatchNorm, bit for bit
    problems = [
        diff(out, shard(out_ref, sizes), "output", tol, exact),
        diff(gx, shard(gx_ref, sizes), "input grad", tol, exact),
    ]
    for pname in ("weight", "bias"):
        p_ref, p = getattr(ref, pname), getattr(sync, pname)
        if p_ref is not None:
            problems.append(diff(summed(p.grad), p_ref.grad, f"{pname} grad", tol))
            p_ref.grad, p.grad = None, None
    problems += [
        diff(getattr(sync, b), getattr(ref, b), b, tol)
        for b in ("running_mean", "running_var", "num_batches_tracked")
    ]
    problems = [p for p in problems if p]
    assert_all(not problems, f"{label}: " + "; ".join(problems))
    if sync.running_mean is not None:
        stats = gather((sync.running_mean.tolist(), sync.running_var.tolist()))
        assert_all(all(s == stats[0] for s in stats), f"{label}: running stats differ: {stats}")


@pytest.mark.mpi
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("ndim", [2, 3, 4, 5], ids=lambda d: f"{d}d")
def test_matches_batchnorm_on_the_whole_batch(ndim, config, device):
    sizes = unequal_sizes(size())
    ref, sync = make_pair(ndim, seed=ndim, device=device, **CONFIGS[config])
    for step in range(STEPS):
        x, w = (t.to(device) for t in global_batch(100 * ndim + step, sum(sizes), SPATIAL[ndim]))
        compare_step(ref, sync, sizes, x, w, 1e-10, f"step {step}")


@pytest.mark.mpi
@pytest.mark.parametrize("ndim", [2, 4], ids=lambda d: f"{d}d")
def test_matches_batchnorm_float32(ndim, device):
    sizes = unequal_sizes(size())
    ref, sync = make_pair(ndim, seed=7, dtype=torch.float32, device=device)
    for step in range(STEPS):
        x, w = (
            t.to(device) for t in global_batch(200 + step, sum(sizes), SPATIAL[ndim], torch.float32)
        )
        compare_step(ref, sync, sizes, x, w, 1e-5, f"step {step}")


@pytest.mark.mpi
def test_rank_with_an_empty_batch():
    # Rank 0 has no rows when there are other ranks; it must still take part in both collectives.
    n = size()
    sizes = [0] + [2 + r for r in range(1, n)] if n > 1 else [4]
    ref, sync = make_pair(4, seed=3, momentum=None)
    for step in range(STEPS):
        x, w = global_batch(300 + step, sum(sizes), SPATIAL[4])
        compare_step(ref, sync, sizes, x, w, 1e-10, f"step {step}")


@pytest.mark.mpi
def test_one_value_per_channel_raises_on_every_rank():
    # One row in the whole world: torch's BatchNorm refuses it; so must every rank, none hanging.
    sizes = [1] + [0] * (size() - 1)
    _, sync = make_pair(2, seed=4)
    x, _ = global_batch(400, 1, ())
    raises_all(ValueError, sync, shard(x, sizes), match="Expected more than 1 value per channel")
    sizes = unequal_sizes(size())  # the layer still works afterwards
    ref, sync = make_pair(2, seed=4)
    x, w = global_batch(401, sum(sizes), ())
    compare_step(ref, sync, sizes, x, w, 1e-10, "after the error")


@pytest.fixture
def collective_names(monkeypatch):
    """Names of the mpidp collectives submitted during the test (every async op is spied on)."""
    names = []
    for op_name in ASYNC_OPS:
        real = getattr(mpidp.ops, op_name)

        def spy(*args, _real=real, **kwargs):
            names.append(kwargs.get("name"))
            return _real(*args, **kwargs)

        monkeypatch.setattr(mpidp.ops, op_name, spy)
    return names


@pytest.mark.mpi
def test_eval_mode_matches_batchnorm_without_communication(collective_names):
    sizes = unequal_sizes(size())
    ref, sync = make_pair(4, seed=5)
    for step in range(2):
        x, w = global_batch(500 + step, sum(sizes), SPATIAL[4])
        compare_step(ref, sync, sizes, x, w, 1e-10, f"training step {step}")
    ref.eval()
    sync.eval()
    del collective_names[:]
    x, w = global_batch(510, sum(sizes), SPATIAL[4])
    out, gx = run_all(forward_backward, sync, shard(x, sizes), shard(w, sizes))
    out_ref, gx_ref = forward_backward(ref, x, w)
    problems = [
        diff(out, shard(out_ref, sizes), "eval output", 1e-10),
        diff(gx, shard(gx_ref, sizes), "eval input grad", 1e-10),
        diff(sync.num_batches_tracked, ref.num_batches_tracked, "num_batches_tracked", 0),
    ]
    # Without running statistics, eval mode normalises with this rank's own batch (like torch).
    ref_local, sync_local = make_pair(4, seed=5, track_running_stats=False)
    ref_local.eval()
    sync_local.eval()
    mine = shard(x, sizes)
    problems.append(diff(sync_local(mine), ref_local(mine), "untracked eval output", 1e-10))
    problems.append("" if not collective_names else f"eval mode communicated: {collective_names}")
    problems = [p for p in problems if p]
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
@pytest.mark.parametrize("input_grad", [True, False], ids=["input_grad", "no_input_grad"])
def test_collectives_per_training_step(collective_names, input_grad):
    """Forward: one allreduce '<layer>.stats'; backward: one '<layer>.grad' only if the input
    needs a gradient; same names on every rank. A world of one communicates nothing."""
    sizes = unequal_sizes(size())
    _, sync = make_pair(3, seed=6)
    layer = sync._collective_name
    x, w = global_batch(600, sum(sizes), SPATIAL[3])
    mine = shard(x, sizes).requires_grad_(input_grad)
    out = sync(mine)
    after_forward = list(collective_names)
    (out * shard(w, sizes)).sum().backward()
    after_backward = collective_names[len(after_forward) :]
    if size() == 1:
        want_forward, want_backward = [], []
    else:
        want_forward = [f"{layer}.stats"]
        want_backward = [f"{layer}.grad"] if input_grad else []
    ok = after_forward == want_forward and after_backward == want_backward
    assert_all(
        ok,
        f"forward {after_forward} (want {want_forward}), backward {after_backward} "
        f"(want {want_backward})",
    )
    names = gather(collective_names)
    assert_all(all(v == names[0] for v in names), f"collective names differ: {names}")


@pytest.mark.mpi
def test_collective_path_in_any_world():
    # The module is plain BatchNorm in a world of one; drive the collective path directly.
    sizes = unequal_sizes(size())
    x, w = global_batch(700, sum(sizes), SPATIAL[4])
    gen = torch.Generator().manual_seed(70)
    weight, bias, rm_ref, rv_ref = [
        torch.randn(C, generator=gen, dtype=torch.float64) for _ in range(4)
    ]
    rv_ref = rv_ref.abs() + 0.5
    rm, rv = rm_ref.clone(), rv_ref.clone()

    def grads(fn, inp, up):
        leaves = [t.detach().clone().requires_grad_(True) for t in (inp, weight, bias)]
        out = fn(*leaves)
        (out * up).sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    ref = grads(
        lambda i, wt, b: nn.functional.batch_norm(i, rm_ref, rv_ref, wt, b, True, 0.3, 1e-5), x, w
    )
    got = run_all(
        grads,
        lambda i, wt, b: _sync_batch_norm(
            i, rm, rv, wt, b, 0.3, 1e-5, "test_collective_path_in_any_world"
        ),
        shard(x, sizes),
        shard(w, sizes),
    )
    problems = [
        diff(got[0], shard(ref[0], sizes), "output", 1e-10),
        diff(got[1], shard(ref[1], sizes), "input grad", 1e-10),
        diff(summed(got[2]), ref[2], "weight grad", 1e-10),
        diff(summed(got[3]), ref[3], "bias grad", 1e-10),
        diff(rm, rm_ref, "running_mean", 1e-10),
        diff(rv, rv_ref, "running_var", 1e-10),
    ]
    problems = [p for p in problems if p]
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
def test_joined_rank_counts_as_an_empty_batch():
    # The last rank runs one step fewer and calls join(); the others' extra step normalises over
    # their batches only (the joined rank contributes zeros to both allreduces).
    n, r = size(), rank()
    sizes = unequal_sizes(n)
    ref, sync = make_pair(4, seed=8)
    my_steps = STEPS - 1 if n > 1 and r == n - 1 else STEPS
    problems = []
    for step in range(STEPS):
        x, w = global_batch(800 + step, sum(sizes), SPATIAL[4])
        active = list(range(n)) if step < STEPS - 1 or n == 1 else list(range(n - 1))
        rows = torch.cat([shard(x, sizes, k) for k in active])
        ups = torch.cat([shard(w, sizes, k) for k in active])
        out_ref, gx_ref = forward_backward(ref, rows, ups)
        if step >= my_steps:
            continue
        out, gx = forward_backward(sync, shard(x, sizes), shard(w, sizes))
        start = sum(sizes[k] for k in active if k < r)
        problems += [
            diff(out, out_ref[start : start + sizes[r]], f"step {step} output", 1e-10),
            diff(gx, gx_ref[start : start + sizes[r]], f"step {step} input grad", 1e-10),
            diff(sync.running_mean, ref.running_mean, f"step {step} running_mean", 1e-10),
            diff(sync.running_var, ref.running_var, f"step {step} running_var", 1e-10),
        ]
    lasts = gather(mpidp.join())  # the last to join is one of the ranks that ran every step
    if len(set(lasts)) != 1 or not (lasts[0] < n - 1 or n == 1):
        problems.append(f"join() returned {lasts}")
    problems = [p for p in problems if p]
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
def test_layer_used_twice_per_step():
    sizes = unequal_sizes(size())
    ref, sync = make_pair(2, seed=9, momentum=None)

    def twice(bn):
        return lambda t: bn(t) + 2 * bn(t * t)

    for step in range(STEPS):
        x, w = global_batch(900 + step, sum(sizes), ())
        out_ref, gx_ref = forward_backward(twice(ref), x, w)
        out, gx = run_all(forward_backward, twice(sync), shard(x, sizes), shard(w, sizes))
        problems = [
            diff(out, shard(out_ref, sizes), "output", 1e-10),
            diff(gx, shard(gx_ref, sizes), "input grad", 1e-10),
            diff(summed(sync.weight.grad), ref.weight.grad, "weight grad", 1e-10),
            diff(sync.running_var, ref.running_var, "running_var", 1e-10),
            diff(sync.num_batches_tracked, ref.num_batches_tracked, "batches", 0),
        ]
        sync.weight.grad = sync.bias.grad = ref.weight.grad = ref.bias.grad = None
        problems = [p for p in problems if p]
        assert_all(not problems, f"step {step}: " + "; ".join(problems))


def small_model():
    """Conv -> BatchNorm2d -> ... -> Linear -> BatchNorm1d (momentum None), with non-default
    state: trained running stats, a frozen BN weight, a BN left in eval mode."""
    torch.manual_seed(10)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 5),
        nn.Sequential(nn.BatchNorm1d(5, momentum=None), nn.Tanh()),
        nn.Linear(5, 4),
        nn.BatchNorm1d(4, affine=False),
    ).double()
    with torch.no_grad():
        model(torch.randn(6, 2, 3, 3, dtype=torch.float64))  # move running stats off 0 and 1
    model[1].weight.requires_grad_(False)
    model[7].eval()
    return model


@pytest.mark.mpi
def test_convert_sync_batchnorm_copies_state():
    model = small_model()
    original, frozen = copy.deepcopy(model), model[1]
    converted = SyncBatchNorm.convert_sync_batchnorm(model)
    problems = []
    for (name, before), after in zip(original.named_modules(), converted.modules()):
        is_bn = isinstance(before, nn.modules.batchnorm._BatchNorm)
        if type(after) is not (SyncBatchNorm if is_bn else type(before)):
            problems.append(f"{name}: {type(before).__name__} became {type(after).__name__}")
        if after.training != before.training:
            problems.append(f"{name}: training {after.training}, was {before.training}")
        for key, value in before.state_dict(keep_vars=True).items():
            new = after.state_dict(keep_vars=True)[key]
            if not torch.equal(new, value) or new.requires_grad != value.requires_grad:
                problems.append(f"{name}.{key} changed")
    if converted[1].weight is not frozen.weight or converted[1].weight.requires_grad:
        problems.append("frozen weight not carried over")
    bare = SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm3d(2))
    if type(bare) is not SyncBatchNorm or SyncBatchNorm.convert_sync_batchnorm(bare) is not bare:
        problems.append("a bare BatchNorm3d is not converted to one SyncBatchNorm")
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
def test_converted_model_trains_like_one_process():
    # SGD with the rank-summed gradients on N shards == SGD on the whole batch in one process.
    sizes = unequal_sizes(size())
    ref = small_model()
    sync = SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    lr = 0.05
    for step in range(STEPS):
        x, _ = global_batch(1000 + step, sum(sizes), (3, 3), channels=2)
        w = torch.randn(
            sum(sizes), 4, generator=torch.Generator().manual_seed(step), dtype=torch.float64
        )
        out_ref, gx_ref = forward_backward(ref, x, w)
        out, gx = run_all(forward_backward, sync, shard(x, sizes), shard(w, sizes))
        problems = [
            diff(out, shard(out_ref, sizes), "output", 1e-10),
            diff(gx, shard(gx_ref, sizes), "input grad", 1e-10),
        ]
        with torch.no_grad():
            for (name, p_ref), p in zip(ref.named_parameters(), sync.parameters()):
                if p_ref.requires_grad:
                    total = summed(p.grad)
                    problems.append(diff(total, p_ref.grad, f"{name} grad", 1e-10))
                    p_ref -= lr * p_ref.grad
                    p -= lr * total
                    p_ref.grad = p.grad = None
        for (name, b_ref), b in zip(ref.named_buffers(), sync.buffers()):
            problems.append(diff(b, b_ref, name, 1e-10))
        problems = [p for p in problems if p]
        assert_all(not problems, f"step {step}: " + "; ".join(problems))
