"""Asynchrony (poll, timeouts), rank-dependent submission order, unnamed ops, duplicate names."""

import random
import time

import pytest
import torch
from mpi_util import assert_all, int_average, rank, run_all, size, tensor_diff

import mpidp


def _sum_of_ranks(n: int) -> int:
    return n * (n - 1) // 2


@pytest.mark.mpi
def test_poll_false_right_after_submission():
    """Rank 0 submits 0.2 s late, so nothing can be done at submission on the other ranks;
    on rank 0 the engine has not yet run a cycle for the new batch."""
    name = "test_poll_false_right_after_submission"
    r, n = rank(), size()

    def body():
        if r == 0:
            time.sleep(0.2)
        handles, early = [], []
        for i in range(8):
            h = mpidp.allreduce_async(
                torch.full((4,), float(r + i)), op=mpidp.Sum, name=f"{name}.{i}"
            )
            early.append(mpidp.poll(h))
            handles.append(h)
        results = [mpidp.synchronize(h) for h in handles]
        return early, results

    early, results = run_all(body)
    problems = []
    if all(early):
        problems.append(f"poll() was True right after submission for every op: {early}")
    for i, out in enumerate(results):
        d = tensor_diff(out, torch.full((4,), float(_sum_of_ranks(n) + n * i)))
        if d:
            problems.append(f"op {i}: {d}")
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
def test_poll_true_after_completion_and_handle_spent():
    name = "test_poll_true_after_completion_and_handle_spent"
    n = size()

    def body():
        h = mpidp.allreduce_async(torch.ones(3), op=mpidp.Sum, name=name)
        deadline = time.monotonic() + 30
        while not mpidp.poll(h) and time.monotonic() < deadline:
            time.sleep(0.001)
        done = mpidp.poll(h)
        out = mpidp.synchronize(h)
        try:
            mpidp.synchronize(h)
            spent = False
        except ValueError:
            spent = True
        return done, out, spent

    done, out, spent = run_all(body)
    d = tensor_diff(out, torch.full((3,), float(n)))
    assert_all(
        done and not d and spent,
        f"poll after completion={done}, result: {d or 'ok'}, handle spent={spent}",
    )


@pytest.mark.mpi(min_size=2)
def test_synchronize_timeout_while_peer_delays():
    name = "test_synchronize_timeout_while_peer_delays"
    r, n = rank(), size()
    late = n - 1

    def body():
        if r == late:
            time.sleep(0.6)
        h = mpidp.allreduce_async(torch.full((2,), float(r)), op=mpidp.Sum, name=name)
        timed_out = None
        if r != late:
            t0 = time.monotonic()
            try:
                mpidp.synchronize(h, timeout=0.05)
                timed_out = "synchronize(timeout=0.05) returned while a peer was 0.6 s late"
            except mpidp.OpTimeoutError as e:
                took = time.monotonic() - t0
                if not isinstance(e, TimeoutError) or not isinstance(e, mpidp.CollectiveError):
                    timed_out = f"OpTimeoutError has the wrong bases: {type(e).__mro__}"
                elif name not in str(e):
                    timed_out = f"OpTimeoutError does not name the op: {e}"
                elif took > 0.4:
                    timed_out = f"synchronize(timeout=0.05) took {took:.2f} s"
                if mpidp.poll(h):
                    timed_out = "poll() True while the late peer had not submitted"
        # The handle is still valid: wait for real.
        return timed_out, mpidp.synchronize(h)

    problem, out = run_all(body)
    d = tensor_diff(out, torch.full((2,), float(_sum_of_ranks(n))))
    assert_all(problem is None and not d, f"{problem or ''} {d}")


@pytest.mark.mpi
def test_synchronize_timeout_on_grouped_handle_keeps_it_usable():
    """A grouped handle that times out stays valid (at n=1 the op may simply finish in time)."""
    name = "test_synchronize_timeout_on_grouped_handle_keeps_it_usable"
    r, n = rank(), size()

    def body():
        if r == 0:
            time.sleep(0.3)
        h = mpidp.grouped_allreduce_async(
            [torch.ones(2), torch.ones(3, dtype=torch.int32)], op=mpidp.Sum, name=name
        )
        timeouts = 0
        while True:
            try:
                return mpidp.synchronize(h, timeout=0.01), timeouts
            except mpidp.OpTimeoutError:
                timeouts += 1
                if timeouts > 10000:
                    raise

    outs, timeouts = run_all(body)
    problems = [
        d
        for d in (
            tensor_diff(outs[0], torch.full((2,), float(n))),
            tensor_diff(outs[1], torch.full((3,), n, dtype=torch.int32)),
        )
        if d
    ]
    if n > 1 and r != 0 and timeouts == 0:
        problems.append("never timed out although rank 0 was 0.3 s late")
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
def test_rank_dependent_order_named_allreduces():
    name = "test_rank_dependent_order_named_allreduces"
    r, n = rank(), size()
    order = list(range(20))
    random.Random(1000 + r).shuffle(order)
    if r % 2:
        order.reverse()

    def body():
        handles = {}
        for i in order:
            handles[i] = mpidp.allreduce_async(
                torch.full((i + 1,), float(i * 10 + r)), op=mpidp.Sum, name=f"{name}.{i}"
            )
        # Synchronize in yet another order.
        return {i: mpidp.synchronize(handles[i]) for i in sorted(handles, reverse=r % 2 == 0)}

    outs = run_all(body)
    problems = []
    for i in range(20):
        d = tensor_diff(outs[i], torch.full((i + 1,), float(n * i * 10 + _sum_of_ranks(n))))
        if d:
            problems.append(f"tensor {i}: {d}")
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
def test_rank_dependent_order_mixed_op_types():
    name = "test_rank_dependent_order_mixed_op_types"
    r, n = rank(), size()

    submit = {
        "allreduce": lambda: mpidp.allreduce_async(
            torch.full((3,), float(r)), op=mpidp.Sum, name=f"{name}.allreduce"
        ),
        "allreduce_int": lambda: mpidp.allreduce_async_(
            torch.full((5,), r, dtype=torch.int64), op=mpidp.Max, name=f"{name}.arint"
        ),
        "allgather": lambda: mpidp.allgather_async(
            torch.full((r + 1, 2), float(r)), name=f"{name}.allgather"
        ),
        "broadcast": lambda: mpidp.broadcast_async(
            torch.full((4,), float(r)), n - 1, name=f"{name}.broadcast"
        ),
        "alltoall": lambda: mpidp.alltoall_async(
            torch.arange(2 * n, dtype=torch.int32) + 100 * r, name=f"{name}.alltoall"
        ),
        "reducescatter": lambda: mpidp.reducescatter_async(
            torch.ones(2 * n + 1, 3), op=mpidp.Sum, name=f"{name}.reducescatter"
        ),
        "grouped": lambda: mpidp.grouped_allreduce_async(
            [torch.ones(2), torch.ones(1)], op=mpidp.Sum, name=f"{name}.grouped"
        ),
        "grouped_allgather": lambda: mpidp.grouped_allgather_async(
            [torch.tensor([r]), torch.tensor([[r, r]])], name=f"{name}.grouped_allgather"
        ),
    }
    order = sorted(submit)
    random.Random(7 * r + 1).shuffle(order)

    def body():
        handles = {k: submit[k]() for k in order}
        return {k: mpidp.synchronize(handles[k]) for k in reversed(order)}

    outs = run_all(body)
    rs_rows = (2 * n + 1) // n + (1 if r < (2 * n + 1) % n else 0)
    expected = {
        "allreduce": torch.full((3,), float(_sum_of_ranks(n))),
        "allreduce_int": torch.full((5,), n - 1, dtype=torch.int64),
        "allgather": torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)]),
        "broadcast": torch.full((4,), float(n - 1)),
        "alltoall": torch.tensor(
            [100 * k + 2 * r + j for k in range(n) for j in range(2)], dtype=torch.int32
        ),
        "reducescatter": torch.full((rs_rows, 3), float(n)),
    }
    problems = []
    for k, want in expected.items():
        d = tensor_diff(outs[k], want)
        if d:
            problems.append(f"{k}: {d}")
    g = outs["grouped"]
    if tensor_diff(g[0], torch.full((2,), float(n))) or tensor_diff(
        g[1], torch.full((1,), float(n))
    ):
        problems.append(f"grouped: {g}")
    ga = outs["grouped_allgather"]
    if not torch.equal(ga[0], torch.arange(n)) or not torch.equal(
        ga[1], torch.arange(n).repeat_interleave(2).reshape(n, 2)
    ):
        problems.append(f"grouped_allgather: {ga}")
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
def test_many_small_mixed_dtype_allreduces_fuse_correctly():
    """Many small async allreduces (fusion candidates) of interleaved dtypes, ops and scales."""
    name = "test_many_small_mixed_dtype_allreduces_fuse_correctly"
    r, n = rank(), size()
    specs = []
    for i in range(30):
        dtype = [torch.float32, torch.int32, torch.float64, torch.bfloat16, torch.int16][i % 5]
        op = [mpidp.Sum, mpidp.Max, mpidp.Average][i % 3]
        pre = 2.0 if dtype.is_floating_point and i % 4 == 0 else 1.0
        specs.append((i, dtype, op, pre))
    order = list(range(30))
    random.Random(r).shuffle(order)

    def value(i, k):
        return float((i + k) % 5)

    def body():
        handles = {}
        for i in order:
            _, dtype, op, pre = specs[i]
            t = torch.full((i % 7 + 1,), value(i, r)).to(dtype)
            handles[i] = mpidp.allreduce_async_(t, op=op, name=f"{name}.{i}", prescale_factor=pre)
        return {i: mpidp.synchronize(h) for i, h in handles.items()}

    outs = run_all(body)
    problems = []
    for i, dtype, op, pre in specs:
        vals = torch.tensor([value(i, k) * pre for k in range(n)], dtype=torch.float64)
        if op == mpidp.Sum:
            v = vals.sum()
        elif op == mpidp.Max:
            v = vals.max()
        else:
            v = vals.sum() / n if dtype.is_floating_point else int_average(vals.sum(), n)
        d = tensor_diff(outs[i], torch.full((i % 7 + 1,), float(v)).to(dtype))
        if d:
            problems.append(f"tensor {i} ({dtype}, {op.name}): {d}")
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
def test_unnamed_ops_match_by_submission_order():
    r, n = rank(), size()

    def body():
        handles = []
        for i in range(6):
            handles.append(
                mpidp.allreduce_async(torch.full((i + 1,), float(r * (i + 1))), op=mpidp.Sum)
            )
        handles.append(mpidp.allgather_async(torch.full((1, 2), r)))
        handles.append(mpidp.broadcast_async(torch.full((2,), float(r)), 0))
        outs = [mpidp.synchronize(h) for h in reversed(handles)]
        outs.reverse()
        blocking = mpidp.allreduce(torch.ones(2), op=mpidp.Sum)
        return outs, blocking

    outs, blocking = run_all(body)
    problems = []
    for i in range(6):
        d = tensor_diff(outs[i], torch.full((i + 1,), float(_sum_of_ranks(n) * (i + 1))))
        if d:
            problems.append(f"unnamed allreduce {i}: {d}")
    for what, got, want in (
        ("allgather", outs[6], torch.arange(n).repeat_interleave(2).reshape(n, 2)),
        ("broadcast", outs[7], torch.zeros(2)),
        ("blocking", blocking, torch.full((2,), float(n))),
    ):
        d = tensor_diff(got, want)
        if d:
            problems.append(f"unnamed {what}: {d}")
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
def test_unnamed_ops_interleaved_with_rank_dependent_named_ops():
    name = "test_unnamed_ops_interleaved_with_rank_dependent_named_ops"
    r, n = rank(), size()
    named = list(range(5))
    random.Random(r + 50).shuffle(named)

    def body():
        handles = []
        for j, i in enumerate(named):
            handles.append(
                (
                    "named",
                    i,
                    mpidp.allreduce_async(
                        torch.full((2,), float(i)), op=mpidp.Sum, name=f"{name}.{i}"
                    ),
                )
            )
            # The j-th unnamed op has the same shape on every rank whatever the named order.
            handles.append(
                (
                    "unnamed",
                    j,
                    mpidp.allreduce_async(torch.full((j + 1,), float(j + r)), op=mpidp.Sum),
                )
            )
        return [(kind, i, mpidp.synchronize(h)) for kind, i, h in handles]

    problems = []
    for kind, i, out in run_all(body):
        if kind == "named":
            want = torch.full((2,), float(n * i))
        else:
            want = torch.full((i + 1,), float(n * i + _sum_of_ranks(n)))
        d = tensor_diff(out, want)
        if d:
            problems.append(f"{kind} {i}: {d}")
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
def test_duplicate_name_in_flight_raises_then_reusable():
    """A name still in flight on this rank is refused at once; after synchronize it is reusable.

    The op is guaranteed in flight on a rank only while some other rank has not submitted it,
    so each rank checks in the round where another rank is late (at n=1: best effort)."""
    base = "test_duplicate_name_in_flight_raises_then_reusable"
    r, n = rank(), size()
    rounds = [0] if n == 1 else [0, 1]

    def body():
        verdicts = []
        for late in rounds:
            name = f"{base}.{late}"
            if r == late:
                time.sleep(0.3)
            h = mpidp.allreduce_async(torch.ones(2), op=mpidp.Sum, name=name)
            # Only a rank that is certainly still waiting tries (a late rank's op may already
            # be done, and an accepted duplicate there would be matched by nobody).
            if n == 1 or r != late:
                for what, fn in (
                    (
                        "allreduce",
                        lambda: mpidp.allreduce_async(torch.ones(2), op=mpidp.Sum, name=name),
                    ),
                    ("broadcast", lambda: mpidp.broadcast_async(torch.ones(2), 0, name=name)),
                    ("allgather", lambda: mpidp.allgather_async(torch.ones(2), name=name)),
                ):
                    try:
                        accepted = fn()
                        if n == 1:  # alone, the first op may have finished already
                            mpidp.synchronize(accepted)
                        else:
                            verdicts.append(
                                f"round {late}: {what} under an in-flight name was accepted"
                            )
                            break
                    except ValueError as e:
                        if name not in str(e) or "in flight" not in str(e):
                            verdicts.append(f"round {late}: unhelpful message: {e}")
            out = mpidp.synchronize(h)
            if not torch.equal(out, torch.full((2,), float(n))):
                verdicts.append(f"round {late}: result {out.tolist()}")
            # Reusable now, with the same and with different metadata.
            again = mpidp.allreduce(torch.ones(2), op=mpidp.Sum, name=name)
            other = mpidp.allreduce(torch.ones(3, dtype=torch.int32), op=mpidp.Max, name=name)
            if not torch.equal(again, torch.full((2,), float(n))) or not torch.equal(
                other, torch.ones(3, dtype=torch.int32)
            ):
                verdicts.append(f"round {late}: reuse gave {again.tolist()}, {other.tolist()}")
        return verdicts

    verdicts = run_all(body)
    assert_all(not verdicts, "; ".join(verdicts))


@pytest.mark.mpi
def test_grouped_op_is_atomic_on_duplicate():
    """A grouped op clashing with an in-flight name is refused as a whole: nothing is enqueued.
    (A group of mixed dtypes is one op per tensor, named '<name>.<index>'; a group of one dtype
    is one op under its own name.)"""
    name = "test_grouped_op_is_atomic_on_duplicate"
    n = size()

    def group():
        return [torch.ones(1), torch.ones(1, dtype=torch.float64)]

    def body():
        if rank() == 0:
            time.sleep(0.2)
        h = mpidp.allreduce_async(torch.ones(1), op=mpidp.Sum, name=f"{name}.1")
        refused = None
        if rank() != 0 or n == 1:  # rank 0 is late: its op may be done already
            try:
                g = mpidp.grouped_allreduce_async(group(), op=mpidp.Sum, name=name)
                refused = False
                if n == 1:
                    mpidp.synchronize(g)
            except ValueError:
                refused = True
        first = mpidp.synchronize(h)
        # If the group had been half-enqueued, '<name>.0' would now be in flight.
        g2 = mpidp.synchronize(mpidp.grouped_allreduce_async(group(), op=mpidp.Sum, name=name))
        return refused, first, g2

    refused, first, g2 = run_all(body)
    problems = []
    if n > 1 and rank() != 0 and not refused:
        problems.append("grouped op clashing with in-flight name was accepted")
    if not torch.equal(first, torch.full((1,), float(n))):
        problems.append(f"first {first}")
    if [t.item() for t in g2] != [float(n)] * 2:
        problems.append(f"grouped after refusal: {g2}")
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
def test_unusual_names():
    """Names are opaque keys: unicode, dots, spaces and long names all work and stay distinct."""
    base = "test_unusual_names"
    n = size()
    names = [
        f"{base}.ünïcødé.名前",
        f"{base}.with space/and:colon",
        f"{base}." + "x" * 5000,
        f"{base}.noname.1",
        f"{base}.mpidp.join",
    ]

    def body():
        hs = [
            mpidp.allreduce_async(torch.full((2,), float(i)), op=mpidp.Sum, name=nm)
            for i, nm in enumerate(names)
        ]
        return [mpidp.synchronize(h) for h in hs]

    outs = run_all(body)
    bad = [i for i, o in enumerate(outs) if o.tolist() != [float(n * i)] * 2]
    assert_all(not bad, f"names {[names[i][:40] for i in bad]} gave wrong results")


@pytest.mark.mpi
def test_submission_from_several_threads():
    """Two user threads submit and synchronize named ops concurrently."""
    import threading

    name = "test_submission_from_several_threads"
    n = size()
    results, errors = {}, []

    def worker(t):
        try:
            hs = {
                i: mpidp.allreduce_async(
                    torch.full((3,), float(t * 100 + i)), op=mpidp.Sum, name=f"{name}.{t}.{i}"
                )
                for i in range(10)
            }
            for i, h in hs.items():
                results[(t, i)] = mpidp.synchronize(h)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    problems = list(errors)
    if any(th.is_alive() for th in threads):
        problems.append("a thread did not finish within 60 s")
    for t in range(2):
        for i in range(10):
            got = results.get((t, i))
            if got is None or got.tolist() != [float(n * (t * 100 + i))] * 3:
                problems.append(f"thread {t} op {i}: {got}")
    assert_all(not problems, "; ".join(problems[:5]))
