"""Hierarchical allreduce on simulated 2-rank nodes equals the flat allreduce, fused and unfused."""

import pytest
import torch
from backend_util import ALLREDUCE, REDUCE_OPS, Counting, fused, run_both, same, single, values
from mpi4py import MPI
from mpi_util import assert_all, dtype_id, int_average, run_all

import mpidp
from mpidp import config as mpidp_config
from mpidp.engine.backends.host import HostBackend
from mpidp.engine.messages import ReduceOp
from mpidp.engine.mpi import Comms

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
NODE = 2  # simulated ranks per node
FITS = SIZE % NODE == 0 and SIZE // NODE > 1
needs_nodes = pytest.mark.skipif(
    not FITS,
    reason=f"hierarchy needs >1 simulated node of {NODE} ranks and {NODE} | size; size is {SIZE}",
)
DTYPES = [
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
]
LENGTHS = [1, 2, 3, 5, 64, 1001]  # odd lengths leave local ranks with unequal slices


def _config(hierarchical, **kw):
    return mpidp_config.load(
        backend="mpi",
        hierarchical_allreduce=int(hierarchical),
        simulated_local_size=NODE,
        chunk_bytes=kw.pop("chunk_bytes", 0),
        **kw,
    )


@pytest.fixture(scope="module")
def pair():
    """(hierarchical, flat) host backends on simulated nodes of NODE consecutive ranks."""
    if SIZE < NODE:
        pytest.skip(f"{SIZE} rank(s) cannot form a node of {NODE}")
    comms = Comms(MPI.COMM_WORLD, simulated_local_size=NODE)
    yield (
        HostBackend(comms, _config(True)),
        HostBackend(comms, _config(False)),
        HostBackend(comms, _config(True, chunk_bytes=64)),
        comms,
    )
    comms.free()


def _check(pair, batch, entries, what, chunked=False):
    hier, flat, hier_chunked, _ = pair
    got_h, got_f = run_all(run_both, hier_chunked if chunked else hier, flat, batch, entries)
    bad = [i for i, (a, b) in enumerate(zip(got_h, got_f)) if not same(a, b)]
    assert_all(not bad, f"{what}: hierarchical {got_h} vs flat {got_f}")


@pytest.mark.mpi
def test_simulated_nodes_are_consecutive_ranks(pair):
    comms = pair[3]
    want_local = min(NODE, SIZE - (RANK // NODE) * NODE)
    assert_all(
        comms.local.Get_size() == want_local and comms.local.Get_rank() == RANK % NODE,
        f"local {comms.local.Get_rank()}/{comms.local.Get_size()}",
    )
    assert_all(comms.cross.Get_rank() == RANK // NODE, f"cross rank {comms.cross.Get_rank()}")
    assert_all(pair[0].hierarchical == FITS, f"hierarchical {pair[0].hierarchical}, fits {FITS}")


@pytest.mark.mpi
def test_16_bit_floats_take_the_hierarchy_unless_the_knob_is_set(pair):
    """MPICH runs the user-defined op of 16-bit floats by whole-buffer rounds, which send twice
    the bytes over each node's link: unless the knob says otherwise, they go hierarchical
    (the same bits as the hierarchical backend), while other dtypes stay flat."""
    hier, flat, _, comms = pair
    plain = dict(backend="mpi", simulated_local_size=NODE, chunk_bytes=0)
    auto = HostBackend(comms, mpidp_config.load(env={}, **plain))
    off = HostBackend(comms, mpidp_config.load(env={}, hierarchical_allreduce=0, **plain))
    assert_all(
        not auto.hierarchical and auto.hierarchical_half == FITS and not off.hierarchical_half,
        f"auto {auto.hierarchical}/{auto.hierarchical_half}, off {off.hierarchical_half}",
    )
    for dtype, like in [
        (torch.float16, hier if FITS else flat),
        (torch.bfloat16, hier if FITS else flat),
        (torch.float32, flat),
    ]:
        for n in LENGTHS:
            t = values((n,), dtype, RANK)
            batch, entries = single(f"auto{n}", ALLREDUCE, t, reduce_op=ReduceOp.AVERAGE)
            got, want = run_all(run_both, auto, like, batch, entries)
            assert_all(same(got, want), f"{dtype} n={n}: auto {got} vs {want}")


class _CrossCounted:
    """`comms` with its cross-node communicator's Iallreduce calls counted."""

    def __init__(self, comms):
        self._comms, self.cross = comms, Counting(comms.cross)

    def __getattr__(self, name):
        return getattr(self._comms, name)


@needs_nodes
@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=dtype_id)
def test_whole_buffers_cross_nodes_in_pieces_on_the_hierarchy(pair, dtype):
    """Across hosts the hierarchy's cross-node step sends a buffer that goes whole (no chunks)
    in pieces, as the flat path does (host.py says why): one collective per piece, the same
    bits as whole."""
    hier, _, _, comms = pair
    plain = dict(backend="mpi", simulated_local_size=NODE, chunk_bytes=0, hierarchical_allreduce=1)
    pieced = HostBackend(comms, mpidp_config.load(env={}, **plain))
    pieced.network, pieced.piece_bytes = True, 8 * dtype.itemsize  # 8 elements a piece
    pieced.comms = counted = _CrossCounted(comms)
    for n in LENGTHS:
        t = values((n,), dtype, RANK)
        batch, entries = single(f"hp{n}", ALLREDUCE, t, reduce_op=ReduceOp.SUM)
        counted.cross.calls = 0
        got, want = run_all(run_both, pieced, hier, batch, entries)
        assert_all(same(got, want), f"{dtype} n={n}: in pieces {got} vs whole {want}")
        # Each rank's share of the node's elements crosses in pieces of 8 elements.
        share = (n - n % NODE) // NODE
        pieces = -(-share // 8)
        assert_all(
            counted.cross.calls == pieces,
            f"n={n}: {counted.cross.calls} cross-node collectives, not {pieces}",
        )


@pytest.mark.mpi(min_size=3)
def test_uneven_nodes_fall_back_to_flat(pair):
    if SIZE % NODE == 0:
        pytest.skip(f"{NODE} divides {SIZE}: every node is full")
    assert_all(
        not pair[3].homogeneous and not pair[0].hierarchical, f"local sizes {pair[3].local_sizes}"
    )
    t = values((7,), torch.int32, RANK)
    batch, entries = single("fallback", ALLREDUCE, t)
    _check(pair, batch, entries, "fallback")


@needs_nodes
@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", REDUCE_OPS, ids=lambda o: o.name)
def test_unfused_equals_flat(pair, dtype, op):
    if dtype == torch.bool and op == ReduceOp.AVERAGE:
        pytest.skip("Average of bool is refused by ops")
    for n in LENGTHS:
        t = values((n,), dtype, RANK)
        batch, entries = single(f"h{n}", ALLREDUCE, t, reduce_op=op)
        _check(pair, batch, entries, f"{dtype} {op.name} n={n}")
        _check(pair, batch, entries, f"{dtype} {op.name} n={n} chunked", chunked=True)
        batch, entries = single(f"h{n}.out", ALLREDUCE, t, output=torch.empty_like(t), reduce_op=op)
        _check(pair, batch, entries, f"{dtype} {op.name} n={n} to output")


@needs_nodes
@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", REDUCE_OPS, ids=lambda o: o.name)
def test_fused_equals_flat(pair, dtype, op):
    if dtype == torch.bool and op == ReduceOp.AVERAGE:
        pytest.skip("Average of bool is refused by ops")
    tensors = [values((n,), dtype, RANK, n) for n in LENGTHS]
    batch, entries = fused("hf", tensors, reduce_op=op)
    _check(pair, batch, entries, f"fused {dtype} {op.name}")
    mask = [i == 1 and RANK == 0 for i in range(len(tensors))]  # rank 0 joined for one
    batch, entries = fused("hj", tensors, joined_mask=mask, reduce_op=op)
    _check(pair, batch, entries, f"fused joined {dtype} {op.name}")


@needs_nodes
@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=dtype_id
)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE], ids=lambda o: o.name)
def test_scale_factors_equal_flat(pair, dtype, op):
    t = values((13,), dtype, RANK)
    batch, entries = single("hs", ALLREDUCE, t, reduce_op=op, prescale=2.0, postscale=0.25)
    _check(pair, batch, entries, f"{dtype} {op.name}")
    batch, entries = fused(
        "hsf",
        [values((n,), dtype, RANK, n) for n in (3, 5)],
        reduce_op=op,
        prescale=0.5,
        postscale=3.0,
    )
    _check(pair, batch, entries, f"fused {dtype} {op.name}")


@needs_nodes
@pytest.mark.mpi(min_size=4)
def test_through_mpidp_ops():
    """mpidp re-initialised with the knobs: hierarchical on, and ops give the flat sums."""
    mpidp.shutdown()
    mpidp.init(hierarchical_allreduce=1, simulated_local_size=NODE)
    try:
        state = mpidp.runtime.world.state()
        routes = state.engine.backend.routes
        assert_all(
            mpidp.local_size() == NODE
            and mpidp.cross_size() == SIZE // NODE
            and routes["cpu"].hierarchical,
            f"local_size {mpidp.local_size()} cross_size {mpidp.cross_size()}",
        )
        for n in LENGTHS:
            t = values((n,), torch.float32, RANK)
            got = mpidp.allreduce(t, op=mpidp.Sum, name=f"test_through_mpidp_ops.{n}")
            want = sum(values((n,), torch.float32, r) for r in range(SIZE))
            assert_all(torch.equal(got, want), f"n={n}: {got} vs {want}")
        handles = [
            mpidp.allreduce_async(
                values((n,), torch.int64, RANK),
                op=mpidp.Average,
                name=f"test_through_mpidp_ops.f{n}",
            )
            for n in LENGTHS
        ]
        got = [mpidp.synchronize(h) for h in handles]
        want = [
            int_average(sum(values((n,), torch.int64, r) for r in range(SIZE)), SIZE)
            for n in LENGTHS
        ]
        assert_all(all(torch.equal(a, b) for a, b in zip(got, want)), f"{got} vs {want}")
    finally:
        mpidp.shutdown()
        mpidp.init()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("cores", [1, 64], ids=["no_spare_core", "spare_cores"])
def test_auto_overlap_across_hosts_without_a_trial_needs_a_spare_core(monkeypatch, cores):
    """Across hosts with the timed trial off (MPIDP_OVERLAP_TRIAL_STEPS=0; the trial itself:
    test_optimizer.py), `auto` overlaps only where a rank has a core to spare beside torch's
    threads, as on one host, whatever the link: the engine's measure of the link (it times the
    link when it starts) changes how large tensors are cut and the buckets, not the overlap."""
    from mpidp.engine import link
    from mpidp.training import overlap

    monkeypatch.setattr(overlap, "host_cores", lambda: cores)
    mpidp.shutdown()
    # Every rank a host of its own.
    mpidp.init(simulated_local_size=1, backend="mpi", overlap_trial_steps=0)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(1100, 1000)  # a 4.4 MB gradient: more than one 4 MiB chunk
        opt = mpidp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01),
            named_parameters=model.named_parameters(),
        )
        seen = [opt._overlap]
        for _ in range(link.SAMPLES + 1):  # past the link's verdict
            model(torch.ones(2, 1100)).sum().backward()
            opt.step()
            opt.zero_grad()
            seen.append(opt._overlap)
        want = [cores > 1] * (link.SAMPLES + 2)
        assert_all(seen == want, f"overlap after each step: {seen}, want {want}")
    finally:
        mpidp.shutdown()
        mpidp.init()
