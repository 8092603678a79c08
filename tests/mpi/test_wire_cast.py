"""Values that travel cast: an op whose request names a narrower dtype than its tensors hold."""

import pytest
import torch
import torch.nn as nn
from backend_util import Counting, host_config, same
from mpi4py import MPI
from mpi_util import assert_all, dtype_id, run_all

import mpidp
from mpidp import ops
from mpidp.engine import lane, scaling
from mpidp.engine.backends import make_backend
from mpidp.engine.backends.cuda import StagedBackend
from mpidp.engine.backends.host import HostBackend
from mpidp.engine.messages import OpType, ReduceOp, Request, Response
from mpidp.engine.mpi import Comms
from mpidp.engine.tensor_queue import Entry
from mpidp.ops import compression as compression_mod

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
WIRES = [torch.float16, torch.bfloat16]
# Parts a bucket may hold: small ones packed together, large ones reduced alone (in chunks of
# the host config's 256 bytes, or in pieces of 16 across "hosts").
SHAPES = [(3,), (300,), (2, 2), (), (70,), (1,), (129,)]


@pytest.fixture(scope="module")
def paths():
    """Every data path a cast op can meet on a host: MPI on one host (chunks), MPI across
    "hosts" (16-byte pieces; 1 MiB pieces in 256-byte chunks), the gloo adapter, and the CUDA
    staging path's CPU twin."""
    comms = Comms(MPI.COMM_WORLD)
    pieced = HostBackend(comms, host_config())
    pieced.network, pieced.piece_bytes = True, 16
    across = HostBackend(comms, host_config())  # chunks (256 B) smaller than a piece (1 MiB)
    across.network = True
    gloo = run_all(make_backend, comms, host_config(backend="gloo"))
    staged = StagedBackend(HostBackend(comms, host_config()), pin_memory=False)
    yield {
        "host": HostBackend(comms, host_config()),
        "pieced": pieced,
        "across": across,
        "gloo": gloo,
        "staged": staged,
    }
    gloo.close()
    comms.free()


def _grads(dtype, salt=0):
    """Values that 16 bits cannot hold exactly, different on each rank and part."""
    g = torch.Generator().manual_seed(1000 * RANK + salt)
    return [(torch.randn(s, generator=g, dtype=torch.float64) * 3).to(dtype) for s in SHAPES]


def _batch(name, tensors, dtype, joined, **kw):
    req = Request(
        name,
        OpType.ALLREDUCE,
        str(dtype).replace("torch.", ""),
        (sum(t.numel() for t in tensors),),
        "cpu",
        parts=tuple(tuple(t.shape) for t in tensors),
        **kw,
    )
    entry = None if joined else Entry(req, list(tensors), list(tensors))
    return [Response(name, OpType.ALLREDUCE, req)], [entry]


@pytest.mark.mpi
@pytest.mark.parametrize("wire", WIRES, ids=dtype_id)
@pytest.mark.parametrize("path", ["host", "pieced", "across", "gloo", "staged"])
@pytest.mark.parametrize(
    "reduce_op, pre, post",
    [(ReduceOp.SUM, 1.0, 1.0), (ReduceOp.AVERAGE, 1.0, 1.0), (ReduceOp.SUM, 0.5, 3.0)],
    ids=["sum", "average", "scaled"],
)
def test_a_cast_bucket_gives_the_bucket_of_the_cast_tensors_cast_back(
    paths, path, wire, reduce_op, pre, post
):
    """On every path, a bucket of float32 (and float64) tensors whose request says `wire` gives,
    bitwise, what the same bucket submitted in `wire` gives, cast back: the values are cast
    before the reduction, scaled in `wire`, and cast back after it, as Compression.fp16 did on
    the caller's thread (the CUDA staging path scales after the cast back, in the tensors'
    dtype). With every fusion limit (packed and alone) and a joined rank."""
    backend = paths[path]
    bad = []
    for dtype in (torch.float32, torch.float64):
        for fuse_below, threshold in ((64, 4096), (1 << 20, 4096), (64, 0)):
            for joined in (False, True) if SIZE > 1 else (False,):
                gone = joined and RANK == 0
                grads = _grads(dtype)
                cast = [g.to(wire) for g in grads]  # before the op reduces grads in place
                kw = dict(reduce_op=reduce_op, prescale=pre, postscale=post)
                batch, entries = _batch("c", grads, wire, gone, **kw)
                got = run_all(backend.execute, batch, entries, fuse_below, threshold)[0]
                ref_kw = kw
                if path == "staged" and not gone:
                    # The staging path scales on the device, after the cast back.
                    ref_kw = dict(reduce_op=ReduceOp.SUM, prescale=pre, postscale=1.0)
                ref_batch, ref_entries = _batch("c", cast, wire, gone, **ref_kw)
                ref = run_all(backend.execute, ref_batch, ref_entries, fuse_below, threshold)[0]
                # A joined rank has no tensors: it gets the others' result in the wire's dtype.
                want = ref if gone else [r.to(dtype) for r in ref]
                if ref_kw is not kw:
                    factor = scaling.after_factor(reduce_op, post, SIZE)
                    want = [scaling.scale_(w, factor) for w in want]
                in_place = gone or all(a is b for a, b in zip(got, grads))
                if not (same(got, want) and in_place):
                    bad.append((str(dtype), fuse_below, threshold, joined))
    assert_all(not bad, f"{path}: cast buckets differ from the cast tensors' buckets: {bad}")


@pytest.mark.mpi
def test_the_pieces_cast_one_at_a_time_and_the_express_lane_declines():
    """Across hosts a cast tensor goes as one collective a piece (each cast just before it
    starts), and the express lane, which reduces a tensor as it is, leaves a cast op alone."""
    comms = Comms(MPI.COMM_WORLD)
    try:
        pieced = HostBackend(comms, host_config(chunk_bytes=0))
        pieced.network, pieced.piece_bytes = True, 16  # 8 elements of float16 a piece
        pieced.reduce_comm = counting = Counting(pieced.reduce_comm)
        grads = [torch.randn(300, generator=torch.Generator().manual_seed(RANK))]
        batch, entries = _batch("p", grads, torch.float16, False)
        run_all(pieced.execute, batch, entries)
        small = torch.ones(4)  # one MPI call on one host: what the lane takes as it is
        here = HostBackend(comms, host_config())
        req = Request("l", OpType.ALLREDUCE, "float16", (4,), "cpu")
        declined = lane.plan(here, req, small, SIZE).op is None
        plain = lane.plan(here, req._replace(dtype="float32"), small, SIZE).op
        assert_all(
            counting.calls == 38 and declined and plain is not None,
            f"{counting.calls} collectives for 300 elements in pieces of 8 (want 38); "
            f"lane declined the cast op: {declined}, took the plain one: {plain is not None}",
        )
    finally:
        comms.free()


def _train(compression, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 300), nn.Tanh(), nn.Linear(300, 5))
    opt = mpidp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=compression,
    )
    g = torch.Generator().manual_seed(7 + RANK)
    for _ in range(steps):
        x = torch.randn(8, 40, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        run_all(opt.step)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_compressed_training_casts_in_the_data_path_with_the_callers_results(name, monkeypatch):
    """DistributedOptimizer with Compression.fp16 (bf16) hands float32 gradients to the data
    path, which casts them (compress() is never called), and trains bitwise as the compressor
    of a user's own (compress and decompress on the caller's thread) does."""
    builtin = getattr(mpidp.Compression, name)
    calls, own_calls = [], []
    real = compression_mod._CastCompressor.compress.__func__

    def counted(cls, tensor):
        calls.append(tensor.numel())
        return real(cls, tensor)

    class Own(builtin):  # the same casts, as a user's compressor: the caller's thread does them
        @classmethod
        def compress(cls, tensor):
            own_calls.append(tensor.numel())
            return real(cls, tensor)

    monkeypatch.setattr(compression_mod._CastCompressor, "compress", classmethod(counted))
    got = _train(builtin)
    in_engine = not calls
    want = _train(Own)
    same_params = all(torch.equal(a, b) for a, b in zip(got, want))
    assert_all(
        in_engine and same_params and own_calls,
        f"{name}: compress() called {len(calls)} times with the built-in compressor "
        f"(want 0), {len(own_calls)} with the user's; parameters bitwise as the user "
        f"compressor's: {same_params}",
    )


@pytest.mark.mpi
@pytest.mark.filterwarnings("ignore:average= is deprecated")
@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize(
    "kw",
    [dict(op=mpidp.Sum), dict(op=mpidp.Average), dict(op=mpidp.Min), dict(average=False)]
    + [dict(op=mpidp.Sum, prescale_factor=0.5, postscale_factor=3.0)],
    ids=["sum", "average", "min", "average_false", "scaled"],
)
def test_public_allreduce_with_a_cast_compressor_casts_in_the_data_path(name, kw, monkeypatch):
    """allreduce and grouped_allreduce with Compression.fp16 (bf16) reduce a float copy whose
    values the data path casts (compress() is never called), bitwise as a user's compressor
    doing the same casts on the caller's thread; the input is left as it was, a strided one
    too. Tensors the casts cannot take whole (a gradient wanted, mixed dtypes, Adasum's own
    values) still get compress and decompress."""
    builtin = getattr(mpidp.Compression, name)
    calls = []
    real = compression_mod._CastCompressor.compress.__func__

    class Own(builtin):
        @classmethod
        def compress(cls, tensor):
            return real(cls, tensor)

    def counted(cls, tensor):
        calls.append(tensor.numel())
        return real(cls, tensor)

    monkeypatch.setattr(compression_mod._CastCompressor, "compress", classmethod(counted))
    tag = f"public.{name}.{'.'.join(f'{k}{v}' for k, v in kw.items())}"
    xs = _grads(torch.float32, salt=3)
    wide = torch.randn(6, 8, generator=torch.Generator().manual_seed(RANK))[:, ::2]
    kept = [x.clone() for x in xs] + [wide.clone()]
    got, want = [], []
    for i, x in enumerate(xs + [wide]):
        got.append(run_all(mpidp.allreduce, x, name=f"{tag}.{i}", compression=builtin, **kw))
        want.append(run_all(mpidp.allreduce, x, name=f"{tag}.own{i}", compression=Own, **kw))
    got += run_all(mpidp.grouped_allreduce, xs, name=f"{tag}.g", compression=builtin, **kw)
    want += run_all(mpidp.grouped_allreduce, xs, name=f"{tag}.og", compression=Own, **kw)
    in_engine = not calls
    unchanged = all(torch.equal(a, b) for a, b in zip(xs + [wide], kept))
    same_values = all(
        a.dtype == torch.float32 and a.shape == b.shape and torch.equal(a, b)
        for a, b in zip(got, want)
    )
    # Where the casts cannot run in the data path, compress() is called as before.
    w = xs[1].clone().requires_grad_()
    run_all(mpidp.allreduce, w, name=f"{tag}.grad", compression=builtin, **kw)
    mixed = [xs[0], xs[1].double()]
    run_all(mpidp.grouped_allreduce, mixed, name=f"{tag}.mixed", compression=builtin, **kw)
    assert_all(
        in_engine and unchanged and same_values and len(calls) == 3,
        f"{name} {kw}: compress() calls {calls} (want none, then 3 for the gradient and "
        f"mixed cases); inputs unchanged {unchanged}; bitwise as the user's casts {same_values}",
    )


@pytest.mark.mpi
def test_a_cast_op_refuses_what_it_cannot_cast():
    """cast_allreduce_async_ says what was wrong, on every rank, before anything is submitted."""
    f32 = torch.ones(4)
    cases = [
        ([f32], torch.float32, "wire_dtype must be"),
        ([torch.ones(4, dtype=torch.int32)], torch.float16, "one floating dtype"),
        ([f32, torch.ones(2, dtype=torch.float64)], torch.float16, "one floating dtype"),
        ([torch.ones(4, dtype=torch.float16)], torch.float16, "one floating dtype"),
    ]
    bad = []
    for tensors, wire, says in cases:
        try:
            ops.cast_allreduce_async_(tensors, wire, name="refused")
            bad.append((str(wire), "accepted"))
        except ValueError as e:
            if says not in str(e):
                bad.append((str(wire), str(e)))
    try:
        ops.cast_allreduce_async_([f32], torch.float16, name="refused", op=mpidp.Adasum)
        bad.append(("adasum", "accepted"))
    except (ValueError, NotImplementedError) as e:  # the latter: not a power-of-2 size
        if "Adasum" not in str(e):
            bad.append(("adasum", str(e)))
    handle = ops.cast_allreduce_async_([f32.clone()], torch.float16, name="fine", op=mpidp.Sum)
    out = ops.synchronize(handle)[0]
    assert_all(
        not bad and out.dtype == torch.float32 and torch.equal(out, torch.full((4,), SIZE * 1.0)),
        f"{bad}; the fine op gave {out}",
    )


@pytest.mark.mpi
def test_pieces_are_filled_before_they_start_and_drained_in_order_once_done():
    """mpi.allreduce with `fill` and `drain`: each piece's elements are written just before its
    collective starts and read, in order, once it is done, whether a user thread waits (the
    blocking wait) or not (tests between short or long sleeps, or yields on one host)."""
    from mpidp.engine import half
    from mpidp.engine import mpi as mpi_mod

    comm = Counting(MPI.COMM_WORLD.Dup())
    sum16 = half.mpi_reduce_op(torch.float16, ReduceOp.SUM)
    waits = [(None, 0.0), (lambda: False, 0.0), (lambda: False, mpi_mod.NETWORK_SLEEP_LONG_S)]
    bad = []
    for busy, sleep in waits:
        for n, piece in ((1, 7), (7, 7), (8, 7), (1000, 7), (3001, 1000)):
            src = torch.randn(n, generator=torch.Generator().manual_seed(RANK)).half()
            want = sum(
                torch.randn(n, generator=torch.Generator().manual_seed(r)).half().float()
                for r in range(SIZE)
            )
            work = torch.full((n,), float("nan"), dtype=torch.float16)
            got = torch.full((n,), float("nan"))
            filled, drained = [], []

            def fill(lo, hi, src=src, work=work, filled=filled):
                filled.append(lo)
                work[lo:hi].copy_(src[lo:hi])

            def drain(lo, hi, work=work, got=got, drained=drained):
                drained.append(lo)
                got[lo:hi].copy_(work[lo:hi])

            comm.calls = 0
            recv = work.view(torch.int16).numpy()
            mpi_mod.allreduce(comm, None, recv, sum16, busy, sleep, piece, fill, drain)
            starts = list(range(0, n, piece))
            # Two ranks' sums are one rounding from float32's; more ranks add their own.
            close = torch.allclose(got, want, rtol=2e-3 * SIZE, atol=2e-3 * SIZE)
            if not (close and filled == starts and drained == starts and comm.calls == len(starts)):
                bad.append((n, piece, sleep, busy is None, filled[:4], drained[:4], comm.calls))
    comm.comm.Free()
    assert_all(not bad, f"wrong results, fills, drains or collective counts: {bad}")
