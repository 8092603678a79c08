"""Hierarchical allreduce on simulated 2-rank nodes equals the flat allreduce, fused and unfused."""

import pytest
import torch
from backend_util import ALLREDUCE, REDUCE_OPS, fused, run_both, same, single, values
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
@pytest.mark.parametrize("slow", [False, True], ids=["fast_link", "slow_link"])
def test_across_nodes_chunks_follow_the_measured_link(monkeypatch, slow):
    """Across hosts a chunk's collective leaves a slow link idle at its start and end: unless
    the knob is set, the first link.SAMPLES chunked reductions measure the link, the ranks agree
    on its pace, and below link.SLOW_LINK_BYTES_PER_S large tensors go whole from then on (on
    every rank alike: the results stay exact). Set, the knob applies as given; on one node
    nothing is measured."""
    from mpidp.engine import link

    monkeypatch.setattr(link, "SLOW_LINK_BYTES_PER_S", 1e30 if slow else 0.0)
    across = Comms(MPI.COMM_WORLD, simulated_local_size=1)
    one_node = Comms(MPI.COMM_WORLD, simulated_local_size=SIZE)
    default = mpidp_config.load(backend="mpi").chunk_bytes
    # A few chunks a reduction: thousands of tiny collectives made this test take 1 to 40 s
    # with 3 ranks on 2 cores, at the scheduler's whim.
    chosen = default // 4
    try:
        measured = HostBackend(across, mpidp_config.load(backend="mpi"))
        given = HostBackend(across, mpidp_config.load(backend="mpi", chunk_bytes=chosen))
        local = HostBackend(one_node, mpidp_config.load(backend="mpi"))
        for backend in (measured, given, local):
            # As in the engine while nobody waits: MPICH's blocking wait spins, and with more
            # ranks than cores the peer it waits for runs only when a time slice ends.
            backend.busy = lambda: False
        n = default // 4 + 5  # float32: more than one chunk
        seen, bad = [], []
        for k in range(link.SAMPLES + 1):
            for backend in (measured, given, local):
                batch, entries = single(f"link.{k}", ALLREDUCE, values((n,), torch.float32, RANK))
                got = backend.execute(batch, entries)[0]
                got = got[0] if isinstance(got, list) else got  # an allreduce's parts
                want = sum(values((n,), torch.float32, r) for r in range(SIZE))
                if not torch.equal(got, want):
                    bad.append(k)
            seen.append(measured.chunk_bytes)
        after = default if not slow else 0
        want_seen = [default] * (link.SAMPLES - 1) + [after, after]
        got = (seen, given.chunk_bytes, local.chunk_bytes, bad)
        assert_all(got == (want_seen, chosen, default, []), f"got {got}")
    finally:
        across.free()
        one_node.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("slow", [False, True], ids=["fast_link", "slow_link"])
def test_auto_overlap_across_hosts_follows_the_measured_link(monkeypatch, slow):
    """With no core to spare, `auto` overlaps across hosts until the engine has measured the
    link (engine/link.py), then keeps overlapping on a slow link only (a fast one leaves the
    pace to the cores, as on one host). The optimizer asks again after each step until then."""
    from mpidp.engine import link
    from mpidp.training import overlap

    monkeypatch.setattr(link, "SLOW_LINK_BYTES_PER_S", 1e30 if slow else 0.0)
    monkeypatch.setattr(overlap, "host_cores", lambda: 1)
    mpidp.shutdown()
    # Every rank a host of its own, on the MPI data path (the one that measures the link;
    # a gloo path across hosts never measures, and auto then overlaps as before).
    mpidp.init(simulated_local_size=1, backend="mpi")
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(1100, 1000)  # a 4.4 MB gradient: more than one 4 MiB chunk
        opt = mpidp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01),
            named_parameters=model.named_parameters(),
        )
        other = torch.nn.Linear(1100, 1000)
        forced = mpidp.DistributedOptimizer(
            torch.optim.SGD(other.parameters(), lr=0.01),
            named_parameters=[(f"other.{k}", v) for k, v in other.named_parameters()],
        )
        forced._overlap = True  # as MPIDP_OVERLAP=1 would: never asked again
        seen = [(opt._overlap, opt._overlap_final)]
        for o, m in [(opt, model)] * (link.SAMPLES + 1) + [(forced, other)] * 2:
            m(torch.ones(2, 1100)).sum().backward()  # forced: after the verdict
            o.step()
            o.zero_grad()
            if o is opt:
                seen.append((opt._overlap, opt._overlap_final))
        want = [(True, False)] * link.SAMPLES + [(slow, True)] * 2
        got = (seen, forced._overlap)
        assert_all(got == (want, True), f"(overlap, final) after each step, forced: {got}")
    finally:
        mpidp.shutdown()
        mpidp.init()
