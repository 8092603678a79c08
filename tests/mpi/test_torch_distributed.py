"""torch.distributed over backend "mpidp": every collective, groups, point to point, DDP."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from devices import DEVICE_PARAMS, use_device
from mpi_util import assert_all, ddp_beside_one_process, raises_all, rank, size, tensor_diff

import mpidp
import mpidp.distributed

R = dist.ReduceOp


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """The default group on backend "mpidp" for this module (mpidp itself stays up)."""
    assert "MASTER_ADDR" not in os.environ and "RANK" not in os.environ
    dist.init_process_group("mpidp")
    yield
    dist.destroy_process_group()


def check(pairs):
    problems = [
        f"{what}: {d}" for what, actual, expected in pairs if (d := tensor_diff(actual, expected))
    ]
    assert_all(not problems, "; ".join(problems))


def values(dtype, shift: int = 0) -> torch.Tensor:
    base = torch.arange(1, 7).reshape(2, 3) + rank() + shift
    if dtype == torch.bool:
        return (base % 2).bool()
    return base.to(dtype)


def every(dtype, shift: int = 0):
    return [values(dtype, shift) if r == rank() else _at(r, dtype, shift) for r in range(size())]


def _at(r, dtype, shift):
    base = torch.arange(1, 7).reshape(2, 3) + r + shift
    return (base % 2).bool() if dtype == torch.bool else base.to(dtype)


def test_the_group_comes_from_mpi():
    assert_all(
        dist.get_rank() == mpidp.rank() and dist.get_world_size() == mpidp.size(),
        f"{dist.get_rank()}/{dist.get_world_size()} vs {mpidp.rank()}/{mpidp.size()}",
    )
    assert_all(dist.is_mpi_available() and dist.get_backend() == "mpi", dist.get_backend())
    assert_all(isinstance(c10d._get_default_group(), mpidp.distributed.ProcessGroupMpidp))


REDUCTIONS = [
    (
        R.SUM,
        [
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.int32,
            torch.int64,
            torch.int8,
            torch.uint8,
            torch.int16,
        ],
        lambda xs: sum(xs),
    ),
    (R.AVG, [torch.float32, torch.float64], lambda xs: sum(xs) / len(xs)),
    (R.MIN, [torch.float32, torch.int64, torch.bfloat16], lambda xs: torch.stack(xs).min(0).values),
    (R.MAX, [torch.float32, torch.int32, torch.float16], lambda xs: torch.stack(xs).max(0).values),
    (R.PRODUCT, [torch.float64, torch.int64], lambda xs: torch.stack(xs).prod(0)),
    (R.BAND, [torch.int64, torch.uint8, torch.bool], lambda xs: _fold(xs, torch.bitwise_and)),
    (R.BOR, [torch.int32, torch.bool], lambda xs: _fold(xs, torch.bitwise_or)),
    (R.BXOR, [torch.int16, torch.bool], lambda xs: _fold(xs, torch.bitwise_xor)),
]


def _fold(xs, fn):
    out = xs[0].clone()
    for x in xs[1:]:
        out = fn(out, x)
    return out


@pytest.mark.parametrize(
    "op,dtypes,expect", REDUCTIONS, ids=[str(r[0]).split(".")[-1] for r in REDUCTIONS]
)
def test_all_reduce_every_op(op, dtypes, expect):
    pairs = []
    for dtype in dtypes:
        for async_op in (False, True):
            t = values(dtype)
            work = dist.all_reduce(t, op=op, async_op=async_op)
            if async_op:
                got = work.get_future().wait()
                pairs.append((f"{dtype} future", got[0], t))
                work.wait()
            want = expect(
                [
                    x.double() if dtype.is_floating_point and dtype.itemsize == 2 else x
                    for x in every(dtype)
                ]
            ).to(dtype)
            pairs.append((f"{op} {dtype} async={async_op}", t, want))
    check(pairs)


def test_premul_sum_complex_and_strided():
    t = values(torch.float32)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    c = torch.complex(values(torch.float32), -values(torch.float32))
    dist.all_reduce(c)
    wide = torch.zeros(2, 6)
    strided = wide[:, ::2]
    strided.copy_(values(torch.float32))
    dist.all_reduce(strided)
    total = sum(every(torch.float32))
    check(
        [
            ("premul", t, 0.5 * total),
            ("complex", c, torch.complex(total, -total)),
            ("strided", strided, total),
            ("strided's gaps", wide[:, 1::2], torch.zeros(2, 3)),
        ]
    )


def test_bad_reductions_raise_everywhere_and_the_next_call_works():
    raises_all(TypeError, dist.all_reduce, torch.ones(2), op=R.BAND, match="bitwise")
    t = torch.ones(2)
    dist.all_reduce(t)
    check([("after the errors", t, torch.full((2,), float(size())))])


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.int64, torch.complex64, torch.uint16, torch.bool, torch.bfloat16],
    ids=str,
)
def test_broadcast_from_every_root(dtype):
    pairs = []
    for root in range(size()):
        t = values(torch.int64).to(dtype)
        dist.broadcast(t, src=root)
        pairs.append((f"root {root}", t, _at(root, torch.int64, 0).to(dtype)))
    check(pairs)


def test_gathers_and_scatters():
    n, r = size(), rank()
    outs = [torch.empty(2, 3) for _ in range(n)]
    dist.all_gather(outs, values(torch.float32))
    into = torch.empty(2 * n, 3, dtype=torch.complex64)
    dist.all_gather_into_tensor(into, values(torch.float32).to(torch.complex64))
    pairs = [(f"all_gather {i}", o, _at(i, torch.float32, 0)) for i, o in enumerate(outs)]
    pairs.append(
        ("all_gather_into_tensor", into, torch.cat(every(torch.float32)).to(torch.complex64))
    )
    # In place, as FSDP2 does: the input is this rank's block of the output.
    buf = torch.zeros(n, 4)
    buf[r] = r + 1.0
    dist.all_gather_into_tensor(buf, buf[r])
    pairs.append(
        ("in place", buf, (torch.arange(n, dtype=torch.float32) + 1)[:, None].expand(n, 4))
    )
    rs = torch.empty(3)
    dist.reduce_scatter(rs, [torch.full((3,), float(i + r)) for i in range(n)])
    pairs.append(("reduce_scatter", rs, torch.full((3,), float(sum(r + j for j in range(n))))))
    rst = torch.empty(2, 2)
    dist.reduce_scatter_tensor(rst, torch.arange(4.0 * n).reshape(2 * n, 2), op=R.AVG)
    pairs.append(("reduce_scatter_tensor", rst, torch.arange(4.0 * n).reshape(n, 2, 2)[r]))
    for dst in range(n):
        t = values(torch.float64)
        dist.reduce(t, dst=dst)
        want = sum(every(torch.float64)) if r == dst else values(torch.float64)
        pairs.append((f"reduce to {dst}", t, want))
        got = [torch.empty(2, 3) for _ in range(n)] if r == dst else None
        dist.gather(values(torch.float32), got, dst=dst)
        if r == dst:
            pairs += [(f"gather {i}", g, _at(i, torch.float32, 0)) for i, g in enumerate(got)]
        mine = torch.empty(2)
        dist.scatter(
            mine,
            [torch.full((2,), 10.0 * i + dst) for i in range(n)] if r == dst else None,
            src=dst,
        )
        pairs.append((f"scatter from {dst}", mine, torch.full((2,), 10.0 * r + dst)))
    check(pairs)


def test_all_to_all_even_and_uneven():
    n, r = size(), rank()
    a = torch.arange(n, dtype=torch.int64) + 10 * r
    b = torch.empty(n, dtype=torch.int64)
    dist.all_to_all_single(b, a)
    pairs = [("even", b, torch.tensor([10 * i + r for i in range(n)]))]
    # Rank r sends j+1 rows to rank j; so it receives r+1 rows from everyone.
    send = torch.cat([torch.full((j + 1, 2), float(100 * r + j)) for j in range(n)])
    recv = torch.empty((r + 1) * n, 2)
    dist.all_to_all_single(
        recv, send, output_split_sizes=[r + 1] * n, input_split_sizes=[j + 1 for j in range(n)]
    )
    pairs.append(
        ("uneven", recv, torch.cat([torch.full((r + 1, 2), float(100 * i + r)) for i in range(n)]))
    )
    outs = [torch.empty(i + 1) for i in range(n)]
    dist.all_to_all(outs, [torch.full((r + 1,), float(r * n + j)) for j in range(n)])
    pairs += [
        (f"all_to_all {i}", o, torch.full((i + 1,), float(i * n + r))) for i, o in enumerate(outs)
    ]
    check(pairs)


def test_objects_barrier_and_coalesced():
    n, r = size(), rank()
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r, "text": "x" * r})
    got = [None]
    dist.broadcast_object_list(got if r else [("from", 0)], src=0)
    if r == 0:
        got = [("from", 0)]
    dist.barrier()
    ts = [values(torch.float32), values(torch.float32, 1)[0]]
    dist.all_reduce_coalesced(ts)
    assert_all(objs == [{"rank": i, "text": "x" * i} for i in range(n)], objs)
    assert_all(got == [("from", 0)], got)
    check(
        [
            ("coalesced f", ts[0], sum(every(torch.float32))),
            ("coalesced 2", ts[1], sum(x[0] for x in every(torch.float32, 1))),
        ]
    )


def test_functional_collectives():
    import torch.distributed._functional_collectives as funcol

    n = size()
    reduced = funcol.all_reduce(values(torch.float32), "sum", dist.group.WORLD)
    gathered = funcol.all_gather_tensor(values(torch.float32), 0, dist.group.WORLD)
    check(
        [
            (
                "funcol all_reduce",
                reduced.wait() if hasattr(reduced, "wait") else reduced,
                sum(every(torch.float32)),
            ),
            ("funcol all_gather", gathered, torch.cat(every(torch.float32))),
        ]
    )
    assert_all(gathered.shape[0] == 2 * n)


def test_point_to_point_ring():
    n, r = size(), rank()
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    got = torch.empty(3)
    ops = [
        dist.P2POp(dist.isend, torch.full((3,), float(r)), right),
        dist.P2POp(dist.irecv, got, left),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    # Blocking send/recv, and a receive from any source.
    if r == 0:
        anyone = torch.empty(1, dtype=torch.int64)
        sources = set()
        for _ in range(n - 1):
            work = dist.irecv(anyone, tag=7)
            work.wait()
            sources.add(work._source_rank() if hasattr(work, "_source_rank") else -1)
        ok = sources == set(range(1, n))
    else:
        dist.send(torch.tensor([r]), dst=0, tag=7)
        ok = True
    check([("ring", got, torch.full((3,), float(left)))])
    assert_all(ok, f"any-source receives came from {sources if r == 0 else ''}")


def test_subgroups_on_members_only():
    n, r = size(), rank()
    evens = list(range(0, n, 2))
    group = dist.new_group(evens)
    if r in evens:
        t = torch.ones(2) * r
        dist.all_reduce(t, group=group)
        check_local = tensor_diff(t, torch.full((2,), float(sum(evens))))
    else:
        check_local = "" if group == dist.GroupMember.NON_GROUP_MEMBER else f"got {group}"
    assert_all(not check_local, check_local)
    mine, groups = dist.new_subgroups(group_size=1)
    t = torch.full((1,), float(r))
    dist.all_reduce(t, group=mine)
    check([("group of one", t, torch.full((1,), float(r)))])
    for g in groups:
        dist.destroy_process_group(g)
    if r in evens:
        dist.destroy_process_group(group)


def test_gloo_groups_beside_the_mpidp_world():
    """A gloo group made by the same script rendezvous through the world's store (served by
    rank 0, connected to on first use): the whole world, and the ranks but 0 (so rank 0 serves
    a store it never uses itself); the mpidp world still works between and after."""
    n, r = size(), rank()
    whole = dist.new_group(backend="gloo")
    t = torch.ones(3) * (r + 1)
    dist.all_reduce(t, group=whole)
    u = torch.ones(2)
    dist.all_reduce(u)
    results = [
        ("gloo world", t, torch.full((3,), n * (n + 1) / 2)),
        ("mpidp", u, torch.full((2,), float(n))),
    ]
    assert_all(dist.get_backend(whole) == "gloo", dist.get_backend(whole))
    rest = list(range(1, n))
    if rest:
        others = dist.new_group(rest, backend="gloo")
        if r in rest:
            v = torch.full((2,), float(r))
            dist.all_reduce(v, group=others)
            results.append(("gloo ranks 1..n-1", v, torch.full((2,), float(sum(rest)))))
            dist.destroy_process_group(others)
    check(results)
    dist.destroy_process_group(whole)


def test_device_mesh_and_dtensor():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    n = size()
    mesh = init_device_mesh("cpu", (n,))
    full = torch.arange(4.0 * n).reshape(2 * n, 2)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    back = sharded.redistribute(mesh, [Replicate()]).to_local()
    check(
        [
            ("redistribute", back, full),
            ("local shard", sharded.to_local(), full.reshape(n, 2, 2)[rank()]),
        ]
    )
    if n == 4:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        t = torch.ones(1)
        dist.all_reduce(t, group=mesh2.get_group("tp"))
        check([("2-D mesh, tp group", t, torch.full((1,), 2.0))])


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


DDP_CASES = {
    "plain": {},
    "find_unused": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
    "bucket_view": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0001},
    "fp16_hook": {"hook": "fp16"},
    "no_sync": {"no_sync": True},
}


@pytest.mark.parametrize("case", list(DDP_CASES))
def test_ddp_trains_as_one_process_on_the_whole_batch(case):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    opts = dict(DDP_CASES[case])
    hook, no_sync = opts.pop("hook", None), opts.pop("no_sync", False)
    n, r = size(), rank()
    ref = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(ref), **opts)
    if hook is not None:
        # (torch's bf16_compress_hook refuses to run without CUDA and NCCL.)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4 * n, 4, generator=gen), torch.randint(0, 3, (4 * n,), generator=gen)
        mine = slice(4 * r, 4 * r + 4)
        if no_sync:  # two half batches, the first under no_sync
            with ddp.no_sync():
                (torch.nn.functional.cross_entropy(ddp(x[mine][:2]), y[mine][:2]) / 2).backward()
            (torch.nn.functional.cross_entropy(ddp(x[mine][2:]), y[mine][2:]) / 2).backward()
        else:
            torch.nn.functional.cross_entropy(ddp(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
        # Each rank's mean over its rows, averaged over ranks: the whole batch's mean (so
        # too for no_sync's two halves, each weighted a half).
        loss = torch.nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    tol = 2e-3 if hook else 1e-5
    worst = max(
        (a - b).abs().max().item() for a, b in zip(ddp.module.parameters(), ref.parameters())
    )
    assert_all(worst <= tol, f"{case}: parameters differ from one process by {worst:.2e}")


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("view", [False, True], ids=["copies", "bucket_view"])
def test_ddp_on_the_device_trains_as_one_process(device, view):
    """DDP over "mpidp" with the model on `device` (make gpu-check runs the cuda case: the
    buckets go through the engine's CUDA path) equals one process on the whole batch."""
    dev = use_device(device)
    ref = _model().to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(ref), gradient_as_bucket_view=view, bucket_cap_mb=0.0001
    )
    worst = ddp_beside_one_process(ddp, ref, steps=3, seed=1, device=dev)
    on = {str(p.device) for p in ddp.module.parameters()}
    assert_all(
        worst <= 1e-5 and on == {str(dev)},
        f"on {dev}: parameters differ from one process by {worst:.2e}, live on {on}",
    )


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_ranks_that_call_differently_get_a_mismatch_error_and_go_on(blocking):
    """Different shapes, then different collectives: a MismatchError on every rank within
    seconds (MPIDP_ORDER_CHECK_S), naming the calls and ranks; the next calls work."""
    if size() == 1:
        return
    r = rank()

    def differing_shapes():
        t = torch.ones(3 if r == 0 else 4)
        work = dist.all_reduce(t, async_op=not blocking)
        if work is not None:
            work.wait()

    err = raises_all(mpidp.MismatchError, differing_shapes, match="different collectives")
    assert_all(err is not None and "rank 0 called allreduce float32[3]" in str(err), str(err))

    def differing_collectives():
        t = torch.ones(2)
        work = (
            dist.all_reduce(t, async_op=True) if r == 0 else dist.broadcast(t, src=0, async_op=True)
        )
        work.wait()

    raises_all(mpidp.MismatchError, differing_collectives, match="broadcast")
    t = torch.ones(3)
    dist.all_reduce(t)
    u = torch.ones(4)
    dist.all_reduce(u)
    check(
        [
            ("after the mismatches", t, torch.full((3,), float(size()))),
            ("and again", u, torch.full((4,), float(size()))),
        ]
    )


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_collectives_on_the_device(device):
    """The calls DDP and FSDP2 make, on `device` tensors (make gpu-check runs the cuda case:
    CUDA-aware MPI, NCCL or host staging, per MPIDP_BACKEND); results stay on the device."""
    dev = use_device(device)
    n, r = size(), rank()
    t = values(torch.float32).to(dev)
    dist.all_reduce(t)
    w = dist.all_reduce(values(torch.bfloat16).to(dev), op=R.MAX, async_op=True)
    got_max = w.get_future().wait()[0]
    b = values(torch.int64).to(dev)
    dist.broadcast(b, src=n - 1)
    into = torch.empty(2 * n, 3, device=dev)
    dist.all_gather_into_tensor(into, values(torch.float32).to(dev))
    rs = torch.empty(2, 2, device=dev)
    dist.reduce_scatter_tensor(rs, torch.arange(4.0 * n, device=dev).reshape(2 * n, 2))
    a2a = torch.empty(n, dtype=torch.int64, device=dev)
    dist.all_to_all_single(a2a, (torch.arange(n) + 10 * r).to(dev))
    ring = torch.empty(2, device=dev)
    if n > 1:
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, torch.full((2,), float(r), device=dev), (r + 1) % n),
                dist.P2POp(dist.irecv, ring, (r - 1) % n),
            ]
        )
        for work in works:
            work.wait()
    else:
        ring.fill_(0.0)
    results = [t, got_max, b, into, rs, a2a, ring]
    assert_all(
        all(x.device == dev for x in results),
        f"results on {[str(x.device) for x in results]}, not {dev}",
    )
    check(
        [
            ("all_reduce", t.cpu(), sum(every(torch.float32))),
            ("max bf16", got_max.cpu(), torch.stack(every(torch.bfloat16)).max(0).values),
            ("broadcast", b.cpu(), _at(n - 1, torch.int64, 0)),
            ("all_gather", into.cpu(), torch.cat(every(torch.float32))),
            ("reduce_scatter", rs.cpu(), n * torch.arange(4.0 * n).reshape(n, 2, 2)[r]),
            ("all_to_all", a2a.cpu(), torch.tensor([10 * i + r for i in range(n)])),
            ("ring", ring.cpu(), torch.full((2,), float((r - 1) % n)) if n > 1 else torch.zeros(2)),
        ]
    )
