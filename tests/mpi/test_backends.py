"""Data paths against the MPI host path: the gloo adapter and the CUDA staging path's CPU twin."""

import pytest
import torch
from backend_util import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    BROADCAST,
    REDUCE_OPS,
    REDUCESCATTER,
    Counting,
    bucket,
    fused,
    host_config,
    run_both,
    same,
    single,
    values,
)
from mpi4py import MPI
from mpi_util import DTYPES, assert_all, dtype_id, int_average, run_all

import mpidp
from mpidp import config as mpidp_config
from mpidp.engine.backends import Dispatch, available, make_backend
from mpidp.engine.backends.cuda import StagedBackend
from mpidp.engine.backends.host import HostBackend
from mpidp.engine.messages import ReduceOp
from mpidp.engine.mpi import Comms

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.fixture(scope="module")
def paths():
    """Host MPI backend, gloo adapter (through make_backend) and staged twin, on fresh Comms."""
    comms = Comms(MPI.COMM_WORLD)
    host = HostBackend(comms, host_config())
    gloo = run_all(make_backend, comms, host_config(backend="gloo"))
    staged = StagedBackend(HostBackend(comms, host_config()), pin_memory=False)
    yield {"host": host, "gloo": gloo, "staged": staged}
    gloo.close()
    comms.free()


@pytest.fixture(params=["gloo", "staged"])
def other(request, paths):
    return paths[request.param]


def _check(host, other, batch, entries, what):
    got_host, got_other = run_all(run_both, host, other, batch, entries)
    bad = [i for i, (a, b) in enumerate(zip(got_host, got_other)) if not same(a, b)]
    assert_all(not bad, f"{what}: results {bad} differ: host {got_host} vs {got_other}")


@pytest.mark.mpi
def test_make_backend_routes_cpu_to_gloo(paths):
    gloo = paths["gloo"]
    assert_all(isinstance(gloo, Dispatch) and gloo.names["cpu"] == "gloo", f"{gloo.names}")
    assert_all(available()["gloo"], f"{available()}")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", REDUCE_OPS, ids=lambda o: o.name)
def test_allreduce_matches_host(paths, other, dtype, op):
    if dtype == torch.bool and op == ReduceOp.AVERAGE:
        pytest.skip("Average of bool is refused by ops")
    for shape in [(), (1,), (5,), (3, 40)]:  # (3, 40) spans chunks of 256 bytes for wide types
        t = values(shape, dtype, RANK)
        batch, entries = single(f"ar{shape}", ALLREDUCE, t, reduce_op=op)
        _check(paths["host"], other, batch, entries, f"{dtype} {op.name} {shape}")
        # not in place: the result goes to a separate output tensor
        batch, entries = single(
            f"ar{shape}.out", ALLREDUCE, t, output=torch.empty_like(t), reduce_op=op
        )
        _check(paths["host"], other, batch, entries, f"{dtype} {op.name} {shape} out")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", FLOATS, ids=dtype_id)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE], ids=lambda o: o.name)
def test_allreduce_scale_factors_match_host(paths, other, dtype, op):
    t = values((17,), dtype, RANK)
    batch, entries = single("scaled", ALLREDUCE, t, reduce_op=op, prescale=2.0, postscale=0.25)
    _check(paths["host"], other, batch, entries, f"{dtype} {op.name}")
    batch, entries = fused(
        "scaled.f",
        [values((n,), dtype, RANK, n) for n in (1, 4, 9)],
        reduce_op=op,
        prescale=0.5,
        postscale=4.0,
    )
    _check(paths["host"], other, batch, entries, f"fused {dtype} {op.name}")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_fused_allreduce_with_a_joined_rank_matches_host(paths, other, dtype):
    tensors = [values((n,), dtype, RANK, n) for n in (3, 1, 8, 2)]
    # rank 0 has "joined" for the second tensor: it contributes zeros and gets no result
    mask = [False, RANK == 0, False, False]
    op = ReduceOp.MAX if dtype == torch.bool else ReduceOp.SUM
    batch, entries = fused("joined", tensors, joined_mask=mask, reduce_op=op)
    got_host, got_other = run_all(run_both, paths["host"], other, batch, entries)
    keep = [i for i in range(len(tensors)) if not mask[i]]
    bad = [i for i in keep if not same(got_host[i], got_other[i])]
    assert_all(not bad, f"{dtype}: fused results {bad} differ")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_allgather_with_different_first_dims_matches_host(paths, other, dtype):
    # The MPI path pads near-equal blocks for Allgather and sends lopsided ones with Allgatherv.
    for dims in (
        [(r % 3) + (r // 3) for r in range(SIZE)],  # includes a rank with 0 rows
        [10 if r == 0 else 0 for r in range(SIZE)],
    ):
        t = values((dims[RANK], 3), dtype, RANK)
        batch, entries = single("ag", ALLGATHER, t, first_dims=dims)
        _check(paths["host"], other, batch, entries, f"{dtype} dims {dims}")
    s = values((), dtype, RANK)
    batch, entries = single("ag0", ALLGATHER, s, first_dims=[1] * SIZE)
    _check(paths["host"], other, batch, entries, f"{dtype} scalar")


@pytest.mark.mpi
@pytest.mark.parametrize("path", ["host", "gloo", "staged"])
@pytest.mark.parametrize("dtype", FLOATS + [torch.int64])
def test_allgather_into_an_output_in_place_and_apart(paths, path, dtype):
    backend = paths[path]
    expect = torch.cat([values((3, 2), dtype, r) for r in range(SIZE)])
    out = torch.zeros(3 * SIZE, 2, dtype=dtype)
    out[3 * RANK : 3 * RANK + 3] = values((3, 2), dtype, RANK)
    mine = out[3 * RANK : 3 * RANK + 3]  # this rank's block of the output: nothing moves locally
    batch, entries = single("ag.in", ALLGATHER, mine, output=out, first_dims=[3] * SIZE)
    got = run_all(backend.execute, batch, entries)[0]
    assert_all(got is out and torch.equal(out, expect), f"{path} in place: {got}")
    apart = torch.zeros(3 * SIZE, 2, dtype=dtype)
    batch, entries = single(
        "ag.apart", ALLGATHER, values((3, 2), dtype, RANK), output=apart, first_dims=[3] * SIZE
    )
    got = run_all(backend.execute, batch, entries)[0]
    assert_all(got is apart and torch.equal(apart, expect), f"{path} apart: {got}")


@pytest.mark.mpi
@pytest.mark.parametrize("path", ["host", "gloo", "staged"])
def test_allgather_into_an_output_with_unequal_first_dims_is_refused(paths, path):
    # ops.allgather_into_async checks shapes locally; a rank whose rows differ from the others'
    # is found here, on every rank alike (the engine then ends the job with this message).
    t = values((1 + RANK % 2, 2), torch.float32, RANK)
    dims = [1 + r % 2 for r in range(SIZE)]
    batch, entries = single(
        "ag.bad", ALLGATHER, t, output=torch.zeros(sum(dims), 2), first_dims=dims
    )
    if len(set(dims)) == 1:
        pytest.skip("one rank: every first dimension is equal")
    err = run_all(lambda: _raised(backend=paths[path], batch=batch, entries=entries))
    assert_all(isinstance(err, ValueError) and "same first dimension" in str(err), f"{err!r}")


def _raised(backend, batch, entries):
    try:
        backend.execute(batch, entries)
    except Exception as exc:  # noqa: BLE001 (the test inspects it)
        return exc
    return None


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int32])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE], ids=lambda o: o.name)
def test_reducescatter_into_an_output_matches_host(paths, other, dtype, op):
    rows = 2 * SIZE + 1
    t = values((rows, 3), dtype, RANK)
    mine = rows // SIZE + (RANK < rows % SIZE)
    outs = {}
    for name, backend in (("host", paths["host"]), ("other", other)):
        out = torch.full((mine, 3), 7, dtype=dtype)
        batch, entries = single("rs.into", REDUCESCATTER, t.clone(), output=out, reduce_op=op)
        got = run_all(backend.execute, batch, entries)[0]
        assert_all(got is out, f"{name}: the result is not the given output")
        outs[name] = out
    batch, entries = single("rs.new", REDUCESCATTER, t.clone(), reduce_op=op)
    fresh = run_all(paths["host"].execute, batch, entries)[0]
    assert_all(
        same(outs["host"], fresh) and same(outs["other"], fresh),
        f"{dtype} {op.name}: {outs} vs {fresh}",
    )


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_broadcast_matches_host(paths, other, dtype):
    root = SIZE - 1
    t = values((4, 5), dtype, RANK)
    batch, entries = single("bc", BROADCAST, t, root=root)
    _check(paths["host"], other, batch, entries, f"{dtype} in place")
    batch, entries = single("bc.out", BROADCAST, t, output=torch.zeros_like(t), root=root)
    _check(paths["host"], other, batch, entries, f"{dtype} to output")
    got = run_all(other.execute, batch, entries)
    assert_all(torch.equal(got[0], values((4, 5), dtype, root)), "not root's tensor")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_alltoall_matches_host(paths, other, dtype):
    splits = torch.tensor([(RANK + d) % 3 for d in range(SIZE)], dtype=torch.int32)
    t = values((int(splits.sum()) + 1, 2), dtype, RANK)  # one trailing row is never sent
    batch, entries = single("a2a", ALLTOALL, t, extra=splits.numpy())
    _check(paths["host"], other, batch, entries, f"{dtype} splits {splits.tolist()}")
    t = values((2 * SIZE,), dtype, RANK)
    batch, entries = single("a2a.even", ALLTOALL, t)
    _check(paths["host"], other, batch, entries, f"{dtype} even")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", REDUCE_OPS, ids=lambda o: o.name)
def test_reducescatter_uneven_matches_host(paths, other, dtype, op):
    if dtype == torch.bool and op == ReduceOp.AVERAGE:
        pytest.skip("Average of bool is refused by ops")
    for rows in (SIZE, 2 * SIZE + 1, SIZE - 1):
        t = values((rows, 3), dtype, RANK)
        batch, entries = single("rs", REDUCESCATTER, t, reduce_op=op)
        _check(paths["host"], other, batch, entries, f"{dtype} {op.name} rows {rows}")
    if dtype in FLOATS:
        t = values((2 * SIZE + 1,), dtype, RANK)
        batch, entries = single("rs.s", REDUCESCATTER, t, reduce_op=op, prescale=2.0, postscale=0.5)
        _check(paths["host"], other, batch, entries, f"{dtype} {op.name} scaled")


@pytest.mark.mpi
def test_barrier_runs_on_every_path(paths, other):
    batch, entries = single("barrier", BARRIER, torch.empty(0))
    got = run_all(other.execute, batch, entries)
    assert_all(got == [None], f"{got}")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", FLOATS + [torch.int32], ids=dtype_id)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE], ids=lambda o: o.name)
def test_bucket_matches_host_and_the_sum(paths, other, dtype, op):
    """A multi-tensor op (a gradient bucket): small parts packed, large ones reduced alone (the
    host config's chunk_bytes=256 chunks them); exact against the sum of every rank's values."""
    shapes = [(3,), (200,), (2, 2), (), (70,), (1,)]
    tensors = [values(s, dtype, RANK, i) for i, s in enumerate(shapes)]
    for fuse_below, threshold in ((64, 4096), (1 << 20, 4096), (64, 0), (1 << 20, 24)):
        batch, entries = bucket("b", tensors, reduce_op=op)
        got_host, got_other = run_all(
            run_both, paths["host"], other, batch, entries, fuse_below, threshold
        )
        ok = same(got_host, got_other)
        want = [
            sum(values(s, dtype, r, i).double() for r in range(SIZE)) for i, s in enumerate(shapes)
        ]
        if op == ReduceOp.AVERAGE:
            want = [w / SIZE if dtype.is_floating_point else int_average(w, SIZE) for w in want]
        exact = all(torch.allclose(g.double(), w, atol=1e-2) for g, w in zip(got_host[0], want))
        assert_all(
            ok and exact,
            f"{dtype} {op.name} limits {fuse_below}/{threshold}: "
            f"host {got_host} other {got_other} want {want}",
        )
    batch, entries = bucket("bj", tensors, joined=RANK == 0 and SIZE > 1, reduce_op=ReduceOp.SUM)
    got_host, got_other = run_all(run_both, paths["host"], other, batch, entries)
    assert_all(same(got_host, got_other), f"joined: {got_host} vs {got_other}")


@pytest.mark.mpi
def test_staged_path_copies_into_the_callers_output(paths):
    """The twin stages: the inner backend sees host copies, the caller's tensors get results."""
    t = values((6,), torch.float32, RANK)
    out = torch.full_like(t, -1.0)
    batch, entries = single("st", ALLREDUCE, t, output=out)
    got = run_all(paths["staged"].execute, batch, entries)
    want = sum(values((6,), torch.float32, r) for r in range(SIZE))
    assert_all(
        got[0][0] is out
        and torch.equal(out, want)
        and torch.equal(t, values((6,), torch.float32, RANK)),
        f"{got} {out} {want}",
    )


@pytest.mark.mpi
def test_session_backend_runs_the_ops():
    """Whatever MPIDP_BACKEND the session runs with, an op through mpidp gives the exact sum."""
    t = values((33,), torch.int32, RANK)
    got = mpidp.allreduce(t, op=mpidp.Sum, name="test_session_backend_runs_the_ops")
    want = sum(values((33,), torch.int32, r) for r in range(SIZE))
    assert_all(torch.equal(got, want), f"{got} vs {want}")


@pytest.mark.mpi
def test_data_allreduce_completes_whether_or_not_a_user_waits():
    """mpi.allreduce tests and yields while nobody waits and waits outright once someone does;
    ranks that decide differently (one waits, one yields, one switches half-way) still match,
    since the call itself is the same non-blocking collective everywhere."""
    import numpy as np

    from mpidp.engine import mpi as mpi_mod

    comm = MPI.COMM_WORLD.Dup()
    calls = []

    def switching():  # yields a few times, then a user "arrives"
        calls.append(1)
        return len(calls) > 3

    policies = [None, lambda: True, lambda: False, switching]
    bad = []
    for i in range(3):
        busy = policies[(RANK + i) % len(policies)]
        for n in (1, 1000, 300_000):
            a = np.full(n, float(RANK + 1), dtype=np.float32)
            mpi_mod.allreduce(comm, None, a, MPI.SUM, busy)
            want = SIZE * (SIZE + 1) / 2
            if not np.all(a == want):
                bad.append((i, n, float(a[0]), want))
    comm.Free()
    assert_all(not bad, f"wrong sums: {bad}")


@pytest.mark.mpi
def test_data_allreduce_in_pieces_matches_one_collective():
    """mpi.allreduce with `piece` starts one collective per piece, all at once, and gives what
    one collective gives, for MPI's own op and for the 16-bit user-defined op, in place and
    not, whether a user waits (Waitall) or not (tests between sleeps, short or long)."""
    from mpidp.engine import half
    from mpidp.engine import mpi as mpi_mod

    comm = Counting(MPI.COMM_WORLD.Dup())
    sum16 = half.mpi_reduce_op(torch.float16, ReduceOp.SUM)
    bad = []
    waits = [(None, 0.0), (lambda: False, mpi_mod.NETWORK_SLEEP_MAX_S)]
    waits.append((lambda: False, mpi_mod.NETWORK_SLEEP_LONG_S))
    for busy, sleep in waits:
        for n, piece in ((1, 7), (7, 7), (8, 7), (1000, 7), (3001, 1000), (3001, 0)):
            for dtype, op in ((torch.float32, MPI.SUM), (torch.float16, sum16)):
                t = values((n,), dtype, RANK)
                want = sum(values((n,), dtype, r) for r in range(SIZE))
                buf = t.view(torch.int16).numpy() if dtype == torch.float16 else t.numpy()
                for in_place in (True, False):
                    got = t.clone()
                    dst = got.view(torch.int16).numpy() if dtype == torch.float16 else got.numpy()
                    comm.calls = 0
                    mpi_mod.allreduce(comm, None if in_place else buf, dst, op, busy, sleep, piece)
                    calls = -(-n // piece) if piece else 1
                    if not torch.equal(got, want) or comm.calls != calls:
                        bad.append((n, piece, str(dtype), in_place, comm.calls, calls))
    comm.comm.Free()
    assert_all(not bad, f"wrong results or collective counts: {bad}")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("op", REDUCE_OPS, ids=lambda o: o.name)
def test_16_bit_floats_across_hosts_go_in_pieces_with_the_host_result(paths, dtype, op):
    """Where the ranks span hosts, 16-bit floats go to the flat allreduce in pieces (host.py
    says why): the results equal the one-collective host path's, chunks and pieces together."""
    comms = Comms(MPI.COMM_WORLD)
    try:
        pieced = HostBackend(comms, host_config())
        pieced.network, pieced.piece_bytes = True, 16  # 8 elements a piece
        pieced.reduce_comm = counting = Counting(pieced.reduce_comm)
        for shape in [(), (5,), (9,), (3, 40), (300,)]:  # (300,): 600 bytes, past a 256 B chunk
            t = values(shape, dtype, RANK)
            batch, entries = single(f"pc{shape}", ALLREDUCE, t, reduce_op=op)
            counting.calls = 0
            _check(paths["host"], pieced, batch, entries, f"{dtype} {op.name} {shape} pieces")
        # 300 elements in chunks of 128, 128 and 44 elements: 16 + 16 + 6 pieces of 8.
        assert_all(counting.calls == 38, f"{counting.calls} collectives for 300 elements, not 38")
    finally:
        comms.free()


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32], ids=dtype_id)
@pytest.mark.parametrize("op", REDUCE_OPS, ids=lambda o: o.name)
def test_whole_buffers_across_hosts_go_in_pieces_and_chunks_do_not(paths, dtype, op):
    """Where the ranks span hosts, a buffer that goes whole (chunk_bytes 0: what a slow link's
    verdict sets) goes to the flat allreduce in pieces, and a chunked one goes one collective a
    chunk (host.py says why): the results equal the one-collective host path's either way."""
    comms = Comms(MPI.COMM_WORLD)
    try:
        for chunk_bytes, calls in (
            (0, -(-300 * dtype.itemsize // 32)),
            (256, -(-300 * dtype.itemsize // 256)),
        ):
            pieced = HostBackend(comms, host_config(chunk_bytes=chunk_bytes))
            pieced.network, pieced.piece_bytes = True, 32
            pieced.reduce_comm = counting = Counting(pieced.reduce_comm)
            for shape in [(), (5,), (3, 40), (300,)]:
                t = values(shape, dtype, RANK)
                batch, entries = single(f"wp{chunk_bytes}{shape}", ALLREDUCE, t, reduce_op=op)
                counting.calls = 0
                what = f"{dtype} {op.name} {shape} chunk_bytes={chunk_bytes}"
                _check(paths["host"], pieced, batch, entries, what)
            assert_all(
                counting.calls == calls,
                f"{counting.calls} collectives for 300 elements in chunks of {chunk_bytes} "
                f"bytes, not {calls}",
            )
    finally:
        comms.free()


@pytest.mark.mpi
def test_the_express_lane_leaves_a_buffer_that_crosses_a_slow_link_to_the_pieces():
    """The express lane runs a lone allreduce as one MPI call; across hosts, where a buffer
    that goes whole goes in pieces, a buffer longer than a piece takes the general path."""
    from types import SimpleNamespace

    from mpidp.engine import lane

    req = SimpleNamespace(prescale=1.0, postscale=1.0, reduce_op=ReduceOp.SUM, dtype="float32")
    comms = Comms(MPI.COMM_WORLD)
    try:
        route = HostBackend(comms, host_config(chunk_bytes=0))
        route.piece_bytes = 32
        found = []
        for network in (False, True):
            route.network = network
            found += [lane.plan(route, req, torch.ones(n), SIZE).op is not None for n in (8, 9)]
        want = [True, True, True, False]
        assert_all(found == want, f"lane taken (one host 8, 9 floats; across): {found}")
    finally:
        comms.free()


@pytest.mark.mpi
def test_allgather_of_a_transposed_column_matches_host(paths, other):
    """An (n, 1) tensor made by transposing a row is contiguous but keeps stride n on its last
    dimension (a sparse gradient's indices are such): every path gathers it, 0 rows included."""
    dims = [(r % 2) * 3 for r in range(SIZE)]  # rank 0 has no rows
    col = (torch.arange(dims[RANK], dtype=torch.int64) + 10 * RANK).reshape(1, -1).t()
    col = col.contiguous()
    assert col.is_contiguous() and (dims[RANK] < 2 or col.stride(-1) != 1)
    batch, entries = single("ag.col", ALLGATHER, col, first_dims=dims)
    _check(paths["host"], other, batch, entries, f"transposed column, dims {dims}")


@pytest.mark.mpi
def test_a_rendezvous_host_that_does_not_resolve_fails_every_rank_at_once():
    """The other ranks retried connecting to it for minutes, with only c10d's warnings."""
    comms = Comms(MPI.COMM_WORLD)
    try:
        err = ""
        try:
            make_backend(comms, host_config(backend="gloo", rendezvous_host="no-such-host.invalid"))
        except mpidp.MpidpError as exc:
            err = str(exc)
        assert_all(
            "no-such-host.invalid" in err and "MPIDP_RENDEZVOUS_HOST" in err, f"error {err!r}"
        )
    finally:
        comms.free()


@pytest.mark.mpi
def test_the_wait_sleeps_only_across_hosts_and_long_only_after_a_slow_verdict():
    """mpi.allreduce's longest sleep between tests (HostBackend.network_sleep): none where the
    ranks share a node (they yield); across nodes the ranks measure the link when the path is
    made, and the long sleep follows only a slow verdict (chunks then stop), where a test reads
    a large segment; with chunk_bytes set there is no measure and the short sleep stays."""
    from mpidp.engine import link, mpi

    comms = Comms(MPI.COMM_WORLD)
    spread = Comms(MPI.COMM_WORLD, simulated_local_size=1)  # a node per rank
    try:
        here = HostBackend(comms, host_config())
        want_here = mpi.NETWORK_SLEEP_MAX_S if comms.spans_hosts else 0.0
        assert_all(here.network_sleep == want_here, f"this layout: {here.network_sleep}")
        cfg = mpidp_config.load(backend="mpi", hierarchical_allreduce=0)  # chunk_bytes unset
        across = HostBackend(spread, cfg)
        across.segment = 2 * link.LONG_SLEEP_SEGMENT
        got = across.network_sleep
        fixed = HostBackend(spread, mpidp_config.load(backend="mpi", chunk_bytes=cfg.chunk_bytes))
        fixed.segment = across.segment
        # A threshold no link reaches: the slow verdict, whatever this machine's link is.
        threshold, link.SLOW_LINK_BYTES_PER_S = link.SLOW_LINK_BYTES_PER_S, float("inf")
        try:
            slowed = HostBackend(spread, cfg)
        finally:
            link.SLOW_LINK_BYTES_PER_S = threshold
        slowed.segment = across.segment
        multi = spread.spans_hosts and "chunk_bytes" not in cfg.explicit
        assert_all(
            slowed.link_slow == multi
            and (slowed.chunk_bytes == 0) == multi
            and slowed.network_sleep
            == (
                mpi.NETWORK_SLEEP_LONG_S
                if multi
                else 0.0
                if not spread.spans_hosts
                else mpi.NETWORK_SLEEP_MAX_S
            ),
            f"a slow verdict: link_slow {slowed.link_slow}, chunk_bytes {slowed.chunk_bytes}, "
            f"sleep {slowed.network_sleep}",
        )
        if not spread.spans_hosts:  # one rank: no node but its own
            want, want_fixed = 0.0, 0.0
        elif "chunk_bytes" in cfg.explicit:  # set for the session: no measure
            want = want_fixed = mpi.NETWORK_SLEEP_MAX_S
        else:
            slow = across.chunk_bytes == 0  # the ranks' verdict
            want = mpi.NETWORK_SLEEP_LONG_S if slow else mpi.NETWORK_SLEEP_MAX_S
            want_fixed = mpi.NETWORK_SLEEP_MAX_S
        assert_all(
            got == want
            and across.link_slow == (want == mpi.NETWORK_SLEEP_LONG_S)
            and fixed.network_sleep == want_fixed
            and not fixed.link_slow
            and fixed.chunk_bytes == cfg.chunk_bytes,
            f"across nodes: sleep {got} (chunk_bytes now {across.chunk_bytes}, link_slow "
            f"{across.link_slow}), want {want}; chunk_bytes set: sleep {fixed.network_sleep}, "
            f"want {want_fixed}",
        )
    finally:
        spread.free()
        comms.free()
