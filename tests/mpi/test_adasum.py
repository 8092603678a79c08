"""op=Adasum: every allreduce form, fused tensors, dtypes, zeros, process sets, data paths, the
optimizer; checked against the paper's formula applied over the rank tree in float64."""

import pytest
import torch
import torch.nn as nn
from backend_util import bucket, fused
from mpi4py import MPI
from mpi_util import assert_all, dtype_id, gather, raises_all, rank, run_all, size

import mpidp
from mpidp import config as mpidp_config
from mpidp.engine.backends import make_backend
from mpidp.engine.backends.cuda import StagedBackend
from mpidp.engine.backends.host import HostBackend
from mpidp.engine.messages import ReduceOp
from mpidp.engine.mpi import Comms

WORLD = MPI.COMM_WORLD.Get_size()  # at import, before mpidp.init()
POW2 = WORLD & (WORLD - 1) == 0
needs_pow2 = pytest.mark.skipif(
    not POW2,
    reason="Adasum needs a power-of-2 world (refusal: test_non_power_of_2_world_is_refused)",
)
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# Rounding of the result into the dtype once per tree level, against float64 throughout.
TOL = {torch.float16: 1e-2, torch.bfloat16: 4e-2, torch.float32: 1e-5, torch.float64: 1e-11}


# ---- the reference: the paper's formula, pairs of neighbours, then pairs of pairs ----


def adasum_pair(a, b):
    dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 - dot / aa * 0.5 if aa >= 1e-8 else 1.0  # a zero vector keeps coefficient 1
    cb = 1.0 - dot / bb * 0.5 if bb >= 1e-8 else 1.0
    return ca * a + cb * b


def adasum_tree(vectors):
    """Every rank's tensor (flattened, float64), rank order; a power-of-2 count of them."""
    vs = [v.double().reshape(-1) for v in vectors]
    while len(vs) > 1:
        vs = [adasum_pair(vs[i], vs[i + 1]) for i in range(0, len(vs), 2)]
    return vs[0]


def inputs(r, shape, dtype=torch.float64, salt=0):
    """Rank r's tensor: a component shared by every rank plus one of its own, so that the
    ranks' tensors are neither parallel nor orthogonal."""
    n = 1
    for d in shape:
        n *= d
    common = torch.Generator().manual_seed(1000 + salt)
    own = torch.Generator().manual_seed(r * 7919 + salt)
    x = 0.8 * torch.randn(n, generator=common, dtype=torch.float64) + torch.randn(
        n, generator=own, dtype=torch.float64
    ) * (1 + r % 3)
    return x.reshape(shape).to(dtype)


def expected(shape, dtype, ranks, salt=0, scale=1.0):
    return adasum_tree([inputs(r, shape, dtype, salt).double() * scale for r in ranks]).reshape(
        shape
    )


def check(got, want, dtype, what, group=0):
    """Collective: `got` is close to the float64 reference and bitwise the same on every rank
    of the same `group` (a process set's ranks)."""
    tol = TOL[dtype]
    diff = ""
    if got.dtype != dtype or tuple(got.shape) != tuple(want.shape):
        diff = f"dtype/shape {got.dtype}{tuple(got.shape)}, want {dtype}{tuple(want.shape)}"
    else:
        err = (got.double() - want).abs() - tol * (1 + want.abs())
        if err.numel() and err.max() > 0:
            diff = f"off by {(got.double() - want).abs().max():.3g}: {got} vs {want}"
    assert_all(not diff, f"{what}: {diff}")
    raw = gather((group, bytes(got.contiguous().view(-1).view(torch.uint8).numpy())))
    mine = [b for g, b in raw if g == group]
    assert_all(all(b == mine[0] for b in mine), f"{what}: results differ bitwise across ranks")


# ---- every allreduce form, every float dtype ----


@pytest.mark.mpi
@needs_pow2
@pytest.mark.parametrize("dtype", FLOATS, ids=dtype_id)
@pytest.mark.parametrize("form", ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_"])
def test_allreduce_matches_the_tree_of_pairs(form, dtype):
    shape = (5, 7)
    x = inputs(rank(), shape, dtype)
    name = f"adasum.{form}.{dtype_id(dtype)}"
    fn = getattr(mpidp, form)
    out = run_all(fn, x, name=name, op=mpidp.Adasum)
    if form.startswith("allreduce_async"):
        out = run_all(mpidp.synchronize, out)
    inplace = form.endswith("_")
    check(x if inplace else out, expected(shape, dtype, range(size())), dtype, form)
    if not inplace:
        assert_all(torch.equal(x, inputs(rank(), shape, dtype)), f"{form} changed its input")
        # The same name again: a cached response (and for allreduce the express lane).
        again = run_all(fn, x, name=name, op=mpidp.Adasum)
        if form == "allreduce_async":
            again = run_all(mpidp.synchronize, again)
        assert_all(torch.equal(again, out), f"{form} repeated: {again} vs {out}")


@pytest.mark.mpi
@needs_pow2
@pytest.mark.parametrize("dtype", FLOATS, ids=dtype_id)
@pytest.mark.parametrize(
    "form", ["grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_"]
)
def test_grouped_tensors_each_get_their_own_dot_products(form, dtype):
    shapes = [(3,), (), (4, 5), (1000,), (1,), (2, 3, 4)]
    xs = [inputs(rank(), s, dtype, salt=i) for i, s in enumerate(shapes)]
    n = size()
    # Parallel on every rank: Adasum averages them; orthogonal ones: it adds them. Reduced
    # together with the others, one dot product over the whole buffer would do neither.
    xs.append(torch.full((4,), 3.0, dtype=dtype))
    xs.append(torch.eye(max(n, 2), dtype=dtype)[rank()] * 2)
    out = run_all(
        getattr(mpidp, form), xs, name=f"adasum.{form}.{dtype_id(dtype)}", op=mpidp.Adasum
    )
    if form.endswith("_async"):
        out = run_all(mpidp.synchronize, out)
    if form.endswith("_"):
        out = xs
    for i, s in enumerate(shapes):
        check(out[i], expected(s, dtype, range(n), salt=i), dtype, f"{form} tensor {i} {s}")
    check(out[-2], torch.full((4,), 3.0, dtype=torch.float64), dtype, "parallel: the average")
    ortho = torch.zeros(max(n, 2), dtype=torch.float64)
    ortho[:n] = 2.0
    check(out[-1], ortho, dtype, "orthogonal: the sum")


@pytest.mark.mpi
@needs_pow2
def test_zero_tensors_and_scale_factors():
    n, r = size(), rank()
    zero = run_all(mpidp.allreduce, torch.zeros(6), name="adasum.zeros", op=mpidp.Adasum)
    check(zero, torch.zeros(6, dtype=torch.float64), torch.float32, "all zeros")
    # Rank 0 (and, at 4 ranks, rank 3) contribute zeros: adasum(a, 0) = a, no division by 0.
    some = inputs(r, (9,)) * (0.0 if r in (0, 3) else 1.0)
    got = run_all(mpidp.allreduce, some, name="adasum.some_zero", op=mpidp.Adasum)
    want = adasum_tree([inputs(q, (9,)) * (0.0 if q in (0, 3) else 1.0) for q in range(n)])
    check(got, want, torch.float64, "some ranks zero")
    tiny = torch.full((4,), 1e-5, dtype=torch.float64)  # |x|^2 = 4e-10 < 1e-8: counts as zero
    got = run_all(mpidp.allreduce, tiny, name="adasum.tiny", op=mpidp.Adasum)
    check(got, tiny * n, torch.float64, "norms under Horovod's floor add up")
    x = inputs(r, (11,))
    got = run_all(
        mpidp.allreduce,
        x,
        name="adasum.scaled",
        op=mpidp.Adasum,
        prescale_factor=3.0,
        postscale_factor=0.25,
    )
    check(
        got,
        expected((11,), torch.float64, range(n), scale=3.0) * 0.25,
        torch.float64,
        "prescale 3, postscale 0.25 (no division by the size)",
    )


@pytest.mark.mpi
@needs_pow2
def test_small_ops_fused_in_one_batch():
    """Unnamed async ops in flight together: the engine may fuse them into one batch."""
    n = size()
    xs = [inputs(rank(), (i + 1,), salt=i) for i in range(12)]
    handles = run_all(lambda: [mpidp.allreduce_async(x, op=mpidp.Adasum) for x in xs])
    outs = run_all(lambda: [mpidp.synchronize(h) for h in handles])
    for i, out in enumerate(outs):
        check(out, expected((i + 1,), torch.float64, range(n), salt=i), torch.float64, f"op {i}")


# ---- refusals ----


@pytest.mark.mpi
@pytest.mark.skipif(POW2, reason="this world is a power of 2")
def test_non_power_of_2_world_is_refused():
    for fn in (mpidp.allreduce, mpidp.allreduce_async, mpidp.allreduce_):
        raises_all(
            NotImplementedError,
            fn,
            torch.ones(3),
            name="adasum.np3",
            op=mpidp.Adasum,
            match="power-of-2",
        )
    raises_all(
        NotImplementedError,
        mpidp.grouped_allreduce,
        [torch.ones(3)],
        op=mpidp.Adasum,
        match="power-of-2",
    )
    model = nn.Linear(2, 1)
    raises_all(
        NotImplementedError,
        mpidp.DistributedOptimizer,
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        op=mpidp.Adasum,
        match="power-of-2",
    )
    out = run_all(mpidp.allreduce, torch.ones(3), name="adasum.np3.after", op=mpidp.Sum)
    assert_all(torch.equal(out, torch.full((3,), float(size()))), "Sum after the refusal")


@pytest.mark.mpi
def test_what_adasum_does_not_take():
    name = "adasum.refused"
    # Where the world is not a power of 2, that is what is refused first.
    exc, match = (TypeError, "float") if POW2 else (NotImplementedError, "power-of-2")
    for dtype in (torch.int32, torch.int64, torch.uint8, torch.bool):
        raises_all(
            exc,
            mpidp.allreduce,
            torch.ones(2, dtype=dtype),
            name=name,
            op=mpidp.Adasum,
            match=match,
        )
        raises_all(
            exc,
            mpidp.grouped_allreduce_async,
            [torch.ones(2, dtype=dtype)],
            name=name,
            op=mpidp.Adasum,
            match=match,
        )
    raises_all(
        ValueError,
        mpidp.sparse_allreduce_async,
        torch.eye(2).to_sparse(),
        name=name,
        op=mpidp.Adasum,
        match="Average and Sum",
    )
    raises_all(
        ValueError,
        mpidp.reducescatter,
        torch.ones(size()),
        name=name,
        op=mpidp.Adasum,
        match="Average",
    )


# ---- process sets ----


@pytest.mark.mpi(min_size=2)
def test_on_a_process_set():
    """Even and odd ranks, each set on its own communicator (sizes 1, 2 or 2 and 2 at n=2..4);
    a set of 3 ranks at n=4 is refused."""
    r, n = rank(), size()
    evens = run_all(mpidp.add_process_set, list(range(0, n, 2)))
    odds = run_all(mpidp.add_process_set, list(range(1, n, 2)))
    try:
        mine = evens if r % 2 == 0 else odds
        x = inputs(r, (3, 4), torch.float32)
        out = run_all(mpidp.allreduce, x, name="adasum.set", op=mpidp.Adasum, process_set=mine)
        check(
            out, expected((3, 4), torch.float32, mine.ranks), torch.float32, "set allreduce", r % 2
        )
        outs = run_all(
            mpidp.grouped_allreduce,
            [x, x[0] * 2],
            name="adasum.set.grouped",
            op=mpidp.Adasum,
            process_set=mine,
        )
        check(
            outs[0], expected((3, 4), torch.float32, mine.ranks), torch.float32, "grouped 0", r % 2
        )
    finally:
        run_all(mpidp.remove_process_set, odds)
        run_all(mpidp.remove_process_set, evens)
    if n == 4:
        three = run_all(mpidp.add_process_set, [0, 1, 2])
        err = ""
        try:
            if r < 3:
                mpidp.allreduce(
                    torch.ones(2), name="adasum.set3", op=mpidp.Adasum, process_set=three
                )
                err = "a set of 3 ranks ran Adasum"
        except NotImplementedError as e:
            err = "" if "power-of-2" in str(e) else str(e)
        finally:
            assert_all(not err, err)
            run_all(mpidp.remove_process_set, three)


# ---- the data paths: host MPI, gloo, staged (the CUDA route's CPU twin), hierarchical ----


def _config(**kw):
    base = dict(backend="mpi", hierarchical_allreduce=0, simulated_local_size=0)
    base.update(kw)
    return mpidp_config.load(**base)


@pytest.fixture(scope="module")
def paths():
    comms = Comms(MPI.COMM_WORLD)
    hier_comms = Comms(MPI.COMM_WORLD, 2 if size() % 2 == 0 and size() > 2 else 0)
    gloo = run_all(make_backend, comms, _config(backend="gloo"))
    yield {
        "host": HostBackend(comms, _config()),
        "gloo": gloo,
        "staged": StagedBackend(HostBackend(comms, _config()), pin_memory=False),
        "hierarchical": HostBackend(hier_comms, _config(hierarchical_allreduce=1)),
    }
    gloo.close()
    hier_comms.free()
    comms.free()


@pytest.mark.mpi
@needs_pow2
@pytest.mark.parametrize("path", ["host", "gloo", "staged", "hierarchical"])
@pytest.mark.parametrize("threshold", [1 << 20, 64, 0])
def test_every_data_path_runs_adasum(paths, path, threshold):
    """A bucket (a multi-tensor op), then fused single ops with rank 0 joined (it adds zeros)."""
    r, n = rank(), size()
    shapes = [(3,), (50,), (2, 2), (), (70,)]
    tensors = [inputs(r, s, torch.float32, salt=i) for i, s in enumerate(shapes)]
    backend = paths[path]
    batch, entries = bucket("b", tensors, reduce_op=ReduceOp.ADASUM)
    got = run_all(backend.execute, batch, entries, 64, threshold)[0]
    for i, s in enumerate(shapes):
        check(
            got[i],
            expected(s, torch.float32, range(n), salt=i),
            torch.float32,
            f"{path} bucket part {i}",
        )
    joined = [r == 0 and n > 1] * 3
    batch, entries = fused("f", tensors[:3], joined, reduce_op=ReduceOp.ADASUM)
    got = run_all(backend.execute, batch, entries, 64, threshold)
    for i, s in enumerate(shapes[:3]):
        want = adasum_tree(
            [
                torch.zeros(s) if q == 0 and n > 1 else inputs(q, s, torch.float32, salt=i)
                for q in range(n)
            ]
        ).reshape(s)
        check(got[i][0], want, torch.float32, f"{path} fused op {i}, rank 0 joined")


# ---- DistributedOptimizer(op=Adasum) ----


def _regression(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 1, generator=g, dtype=torch.float64)
    x = torch.randn(64 * size(), 6, generator=g, dtype=torch.float64)
    return x, x @ w + 0.01 * torch.randn(x.shape[0], 1, generator=g, dtype=torch.float64)


def _model():
    torch.manual_seed(3)
    return nn.Linear(6, 1).double()


@pytest.mark.mpi
@needs_pow2
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("passes", [1, 2])
def test_optimizer_step_is_old_value_plus_adasum_of_local_updates(kind, passes):
    """One step: each rank's local step on its own gradient, the updates Adasum-reduced per
    parameter and added to the old values; against a rank-by-rank replay of the same."""
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5),
        "adam": lambda ps: torch.optim.Adam(ps, lr=0.05),
    }[kind]
    x, y = _regression()
    shard = slice(rank() * 64, (rank() + 1) * 64)
    model = _model()
    opt = mpidp.DistributedOptimizer(
        make(model.parameters()),
        named_parameters=model.named_parameters(),
        op=mpidp.Adasum,
        backward_passes_per_step=passes,
    )
    before = [p.detach().clone() for p in model.parameters()]
    replay = _model()
    replay_opt = make(replay.parameters())
    for k in range(passes):
        half = slice(shard.start + 32 * k // passes, shard.start + 32 * (k + 1) // passes)
        ((model(x[half]) - y[half]) ** 2).mean().backward()
        ((replay(x[half]) - y[half]) ** 2).mean().backward()
    run_all(opt.step)
    replay_opt.step()
    deltas = gather([(q.detach() - b).clone() for q, b in zip(replay.parameters(), before)])
    for i, (p, b) in enumerate(zip(model.parameters(), before)):
        want = b + adasum_tree([d[i] for d in deltas]).reshape(b.shape)
        check(p.detach(), want, torch.float64, f"{kind} parameter {i}")


@pytest.mark.mpi
@needs_pow2
@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_optimizer_converges_and_keeps_replicas_identical(compression):
    x, y = _regression(seed=5)
    shard = slice(rank() * 64, (rank() + 1) * 64)
    model = _model()
    opt = mpidp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        op=mpidp.Adasum,
        compression=getattr(mpidp.Compression, compression),
    )

    def loss_all():
        with torch.no_grad():
            return float(((model(x) - y) ** 2).mean())

    start = loss_all()
    for _ in range(60):
        opt.zero_grad()
        ((model(x[shard]) - y[shard]) ** 2).mean().backward()
        run_all(opt.step)
    end = loss_all()
    assert_all(end < 0.02 * start, f"loss {start:.4g} -> {end:.4g}")
    raw = gather([bytes(p.detach().numpy().tobytes()) for p in model.parameters()])
    assert_all(all(b == raw[0] for b in raw), "parameters differ bitwise across ranks")
    if size() > 1:
        opt.synchronize()  # a no-op, as in Horovod
        raises_all(RuntimeError, opt.skip_synchronize, match="skip_synchronize")


@pytest.mark.mpi(min_size=2)
def test_optimizer_on_a_process_set():
    """Ranks 0 and 1 reduce their updates with Adasum (the global set at 2 ranks, a set of its
    own at 3 and 4); a rank outside the set steps on its own gradients alone."""
    r, n = rank(), size()
    pair = mpidp.global_process_set if n == 2 else run_all(mpidp.add_process_set, [0, 1])
    try:
        x, y = _regression()
        rows = slice(r * 64, r * 64 + 32)
        model, replay = _model(), _model()
        opt = mpidp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            op=mpidp.Adasum,
            process_set=pair,
        )
        replay_opt = torch.optim.SGD(replay.parameters(), lr=0.1)
        before = [p.detach().clone() for p in model.parameters()]
        ((model(x[rows]) - y[rows]) ** 2).mean().backward()
        ((replay(x[rows]) - y[rows]) ** 2).mean().backward()
        run_all(opt.step)
        replay_opt.step()
        deltas = gather([(q.detach() - b).clone() for q, b in zip(replay.parameters(), before)])
        for i, (p, b) in enumerate(zip(model.parameters(), before)):
            want = b + (
                adasum_tree([deltas[0][i], deltas[1][i]]).reshape(b.shape)
                if r < 2
                else deltas[r][i]
            )
            # Members hold the same bits; each rank outside the set its own.
            check(p.detach(), want, torch.float64, f"parameter {i}", group=0 if r < 2 else r)
    finally:
        if pair is not mpidp.global_process_set:
            run_all(mpidp.remove_process_set, pair)
