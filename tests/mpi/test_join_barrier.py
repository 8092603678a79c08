"""join() for uneven inputs (joined ranks contribute zeros, last joiner returned) and barrier()."""

import time

import pytest
import torch
from mpi_util import assert_all, gather, rank, run_all, size, tensor_diff

import mpidp


def _uneven_round(name, steps):
    """This rank does `steps` Sum-allreduces of ones named <name>.step<k>, then joins. Returns
    (results, join's return value). The rank with the most steps joins last: its last
    allreduce, submitted by it alone, completes only once every other rank has joined."""
    outs = []
    for k in range(steps):
        outs.append(mpidp.allreduce(torch.ones(3), op=mpidp.Sum, name=f"{name}.step{k}"))
    return outs, mpidp.join()


def _after_the_others_joined(name):
    """A Sum-allreduce of one on this rank alone: it completes once every other rank has
    joined (they contribute zeros), so this rank's join() comes last. Returns its value."""
    return mpidp.allreduce(torch.ones(1), op=mpidp.Sum, name=f"{name}.alone").item()


@pytest.mark.mpi
def test_join_uneven_allreduces_then_normal_ops():
    name = "test_join_uneven_allreduces_then_normal_ops"
    r, n = rank(), size()

    def body():
        # Round 1: rank r does r+1 steps, so step k has the n-k ranks r >= k; rank n-1 is last.
        round1 = _uneven_round(f"{name}.r1", r + 1)
        after = mpidp.allreduce(torch.ones(2), op=mpidp.Sum, name=f"{name}.after")
        # Names first negotiated while ranks were joined, now used by every rank (cache hits).
        reuse = [
            mpidp.allreduce(torch.ones(3), op=mpidp.Sum, name=f"{name}.r1.step{k}")
            for k in range(n)
        ]
        # Round 2, the other way round: rank r does n-r steps; rank 0 joins last.
        round2 = _uneven_round(f"{name}.r2", n - r)
        after2 = mpidp.allgather(torch.tensor([r]), name=f"{name}.after2")
        return round1, after, reuse, round2, after2

    (outs1, last1), after, reuse, (outs2, last2), after2 = run_all(body)
    problems = []
    for k, out in enumerate(outs1):
        d = tensor_diff(out, torch.full((3,), float(n - k)))  # ranks k..n-1 contribute ones
        if d:
            problems.append(f"round 1 step {k}: {d}")
    for k, out in enumerate(outs2):
        d = tensor_diff(out, torch.full((3,), float(n - k)))  # ranks 0..n-1-k contribute ones
        if d:
            problems.append(f"round 2 step {k}: {d}")
    if last1 != n - 1:
        problems.append(f"round 1: join() returned {last1}, expected {n - 1}")
    if last2 != 0:
        problems.append(f"round 2: join() returned {last2}, expected 0")
    for what, got, want in [
        ("allreduce after join", after, torch.full((2,), float(n))),
        ("allgather after join", after2, torch.arange(n)),
    ] + [(f"reused step {k}", out, torch.full((3,), float(n))) for k, out in enumerate(reuse)]:
        d = tensor_diff(got, want)
        if d:
            problems.append(f"{what}: {d}")
    assert_all(not problems, "; ".join(problems))
    joins = gather((last1, last2))
    assert_all(all(j == joins[0] for j in joins), f"join() returned different ranks: {joins}")


@pytest.mark.mpi
def test_join_with_fused_async_batches_of_mixed_dtypes(device):
    """Joined ranks contribute zeros to fused and widened (bfloat16) allreduces too, made on
    the device of the others' tensors."""
    name = f"test_join_with_fused_async_batches_of_mixed_dtypes.{device.type}"
    r, n = rank(), size()
    dtypes = [torch.float32, torch.bfloat16, torch.int32, torch.float64]

    def body():
        results = []
        for k in range(r + 1):
            hs = [
                mpidp.allreduce_async(
                    torch.full((j + 2,), 2, device=device).to(d),
                    op=mpidp.Sum,
                    name=f"{name}.{k}.{j}",
                )
                for j, d in enumerate(dtypes)
            ]
            hs.append(
                mpidp.grouped_allreduce_async(
                    [torch.ones(2, device=device), torch.ones(3, device=device)],
                    op=mpidp.Sum,
                    name=f"{name}.{k}.g",
                )
            )
            results.append([mpidp.synchronize(h) for h in hs])
        # Rank n-1's last step is its own alone: it ends once every other rank has joined.
        return results, mpidp.join()

    results, last = run_all(body)
    problems = [] if last == n - 1 else [f"join() returned {last}"]
    for k, outs in enumerate(results):
        for j, d in enumerate(dtypes):
            diff = tensor_diff(outs[j], torch.full((j + 2,), 2 * (n - k), device=device).to(d))
            if diff:
                problems.append(f"step {k} {d}: {diff}")
        g = outs[-1]
        if [t.tolist() for t in g] != [[float(n - k)] * 2, [float(n - k)] * 3]:
            problems.append(f"step {k} grouped: {g}")
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
def test_join_alone_or_all_at_once():
    """Every rank joins without doing anything: join() returns a valid rank, the same everywhere."""
    r, n = rank(), size()
    if r == n - 1:
        time.sleep(0.4)
    last = run_all(mpidp.join)
    lasts = gather(last)
    assert_all(
        all(x == lasts[0] for x in lasts) and last == n - 1,
        f"join() returned {lasts}, expected {n - 1} everywhere",
    )
    out = run_all(
        mpidp.allreduce, torch.ones(1), op=mpidp.Sum, name="test_join_alone_or_all_at_once.after"
    )
    assert_all(out.item() == n, f"after join: {out}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "kind", ["max", "min", "product", "allgather", "broadcast", "reducescatter", "alltoall"]
)
def test_ops_refused_while_ranks_are_joined(kind):
    """Min/Max/Product (zeros would change them) and non-allreduce ops fail on the ranks still
    working while a rank has joined; the joined rank is not disturbed."""
    name = f"test_ops_refused_while_ranks_are_joined.{kind}"
    r, n = rank(), size()
    submit = {
        "max": lambda: mpidp.allreduce_async(torch.ones(2), op=mpidp.Max, name=name),
        "min": lambda: mpidp.allreduce_async(torch.ones(2), op=mpidp.Min, name=name),
        "product": lambda: mpidp.allreduce_async(torch.ones(2), op=mpidp.Product, name=name),
        "allgather": lambda: mpidp.allgather_async(torch.ones(1), name=name),
        "broadcast": lambda: mpidp.broadcast_async(torch.ones(1), n - 1, name=name),
        "reducescatter": lambda: mpidp.reducescatter_async(torch.ones(n, 2), name=name),
        "alltoall": lambda: mpidp.alltoall_async(torch.ones(n), name=name),
    }[kind]

    def body():
        msg = None
        if r != 0:
            try:
                mpidp.synchronize(submit())
                msg = "op completed although rank 0 had joined"
            except mpidp.MismatchError as e:
                msg = str(e)
            # Sum still works while rank 0 is joined.
            s = mpidp.allreduce(torch.ones(2), op=mpidp.Sum, name=f"{name}.sum")
            if s.tolist() != [float(n - 1)] * 2:
                msg = f"Sum while rank 0 joined gave {s.tolist()}"
        alone = _after_the_others_joined(name) if r == n - 1 else 1.0
        return msg, alone, mpidp.join()

    msg, alone, last = run_all(body)
    ok = last == n - 1 and alone == 1.0
    ok = ok and (r == 0 or (msg is not None and "join" in msg and name in msg))
    # Sparse gradients are gathered: the message says how to train them with join().
    ok = ok and (r == 0 or kind != "allgather" or "sparse_as_dense=True" in msg)
    assert_all(ok, f"join() returned {last}; alone {alone}; message: {msg!r}")
    msgs = gather(msg)[1:]
    assert_all(all(m == msgs[0] for m in msgs), f"different messages: {msgs}")


@pytest.mark.mpi
def test_barrier_waits_for_every_rank():
    r, n = rank(), size()

    def body():
        entered = None
        if r == 0:
            time.sleep(0.4)
            entered = time.time()
        mpidp.barrier()
        return entered, time.time()

    entered, left = run_all(body)
    times = gather((entered, left))
    start0 = times[0][0]
    early = [k for k, (_, lft) in enumerate(times) if lft < start0]
    assert_all(not early, f"ranks {early} left the barrier before rank 0 entered it")
    # Several barriers in a row, and a barrier beside pending async work.
    h = mpidp.allreduce_async(
        torch.ones(2), op=mpidp.Sum, name="test_barrier_waits_for_every_rank.pending"
    )
    run_all(lambda: [mpidp.barrier() for _ in range(3)])
    out = run_all(mpidp.synchronize, h)
    assert_all(out.tolist() == [float(n)] * 2, f"allreduce beside barriers: {out}")


@pytest.mark.mpi(min_size=2)
def test_barrier_while_a_rank_is_joined():
    """A barrier among the ranks still working does not disturb the joined rank's engine, and
    unnamed ops match again after the join (join() resynchronises their numbering)."""
    name = "test_barrier_while_a_rank_is_joined"
    r, n = rank(), size()

    def body():
        if r != 0:
            mpidp.barrier()
            mpidp.allreduce(torch.ones(1), op=mpidp.Sum)
        alone = _after_the_others_joined(name) if r == n - 1 else 1.0
        last = mpidp.join()
        out = mpidp.allreduce(torch.ones(1), op=mpidp.Sum, name=f"{name}.after")
        unnamed = mpidp.synchronize(mpidp.allreduce_async(torch.ones(1), op=mpidp.Sum), timeout=30)
        return last, alone, out.item() + unnamed.item() - n

    last, alone, after = run_all(body)
    assert_all(
        last == n - 1 and alone == 1.0 and after == n,
        f"join() -> {last}, alone -> {alone}, allreduce after -> {after}",
    )
