"""init/shutdown/init, topology queries against mpi4py's COMM_WORLD, knobs, shutdown mid-op."""

import logging
import random
import time

import pytest
import torch
from mpi4py import MPI
from mpi_util import assert_all, gather, rank, run_all, size, tensor_diff

import mpidp

QUERIES = [
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_homogeneous",
    "mpi_threads_supported",
]


def _smoke(name):
    """A few ops of different kinds; returns a list of problems on this rank."""
    r, n = rank(), size()
    problems = []
    out = mpidp.allreduce(torch.full((3,), float(r)), op=mpidp.Sum, name=f"{name}.ar")
    if out.tolist() != [float(n * (n - 1) // 2)] * 3:
        problems.append(f"allreduce {out.tolist()}")
    g = mpidp.allgather(torch.tensor([r]), name=f"{name}.ag")
    if g.tolist() != list(range(n)):
        problems.append(f"allgather {g.tolist()}")
    b = mpidp.broadcast(torch.tensor([r]), n - 1, name=f"{name}.bc")
    if b.tolist() != [n - 1]:
        problems.append(f"broadcast {b.tolist()}")
    u = mpidp.allreduce(torch.ones(1), op=mpidp.Sum)  # unnamed: counters restart per init
    if u.tolist() != [float(n)]:
        problems.append(f"unnamed allreduce {u.tolist()}")
    mpidp.barrier()
    return problems


def _reinit(**knobs):
    mpidp.shutdown()
    mpidp.init(**knobs)


@pytest.mark.mpi
def test_queries_match_comm_world():
    world = MPI.COMM_WORLD
    r, n = world.Get_rank(), world.Get_size()
    got = {q: getattr(mpidp, q)() for q in QUERIES}
    # What MPI itself says shares memory (one host here, or one rank a "host" when MPICH is
    # forced onto TCP with MPIR_CVAR_NOLOCAL).
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=r)
    nodes = world.Split(color=node.Get_rank(), key=r)
    want = {
        "rank": r,
        "size": n,
        "local_rank": node.Get_rank(),
        "local_size": node.Get_size(),
        "cross_rank": nodes.Get_rank(),
        "cross_size": nodes.Get_size(),
        "is_homogeneous": len(set(world.allgather(node.Get_size()))) == 1,
        "mpi_threads_supported": MPI.Query_thread() == MPI.THREAD_MULTIPLE,
    }
    nodes.Free()
    node.Free()
    k = mpidp.runtime.world.state().config.simulated_local_size
    if k:  # MPIDP_SIMULATED_LOCAL_SIZE: nodes of k consecutive ranks, the last one maybe short
        want.update(
            local_rank=r % k,
            local_size=min(k, n - (r // k) * k),
            cross_rank=r // k,
            cross_size=len(range(r % k, n, k)),
            is_homogeneous=n % k == 0,
        )
    bad = {
        q: (got[q], want[q])
        for q in QUERIES
        if got[q] != want[q] or type(got[q]) is not type(want[q])
    }
    assert_all(not bad, f"(got, expected): {bad}")
    flags = {
        f: getattr(mpidp, f)()
        for f in (
            "mpi_enabled",
            "mpi_built",
            "gloo_enabled",
            "gloo_built",
            "nccl_built",
            "cuda_built",
            "rocm_built",
            "ddl_built",
            "ccl_built",
        )
    }
    import torch.distributed as dist

    want_flags = {
        "mpi_enabled": True,
        "mpi_built": True,
        "gloo_enabled": mpidp.runtime.world.state().config.backend == "gloo",
        "gloo_built": dist.is_available() and dist.is_gloo_available(),
        "nccl_built": dist.is_available() and dist.is_nccl_available(),
        "cuda_built": torch.backends.cuda.is_built(),
        "rocm_built": False,
        "ddl_built": False,
        "ccl_built": False,
    }
    assert_all(flags == want_flags, f"got {flags}, expected {want_flags}")
    assert_all(mpidp.is_initialized(), "not initialised inside the session")


@pytest.mark.mpi
def test_shutdown_then_init_again():
    name = "test_shutdown_then_init_again"
    n = size()

    def body():
        problems = []
        old = mpidp.allreduce_async(torch.ones(1), op=mpidp.Sum, name=f"{name}.old")
        mpidp.synchronize(old)
        mpidp.shutdown()
        if mpidp.is_initialized():
            problems.append("is_initialized() True after shutdown()")
        mpidp.shutdown()  # idempotent
        for q in QUERIES:
            try:
                getattr(mpidp, q)()
                problems.append(f"{q}() worked after shutdown()")
            except ValueError as e:
                if not isinstance(e, mpidp.NotInitializedError) or "init()" not in str(e):
                    problems.append(f"{q}() after shutdown: unhelpful {type(e).__name__}: {e}")
        for what, fn in (
            ("allreduce", lambda: mpidp.allreduce(torch.ones(1), name=name)),
            ("allreduce_async", lambda: mpidp.allreduce_async(torch.ones(1))),
            ("barrier", mpidp.barrier),
            ("join", mpidp.join),
            ("poll", lambda: mpidp.poll(old)),
        ):
            try:
                fn()
                problems.append(f"{what} worked after shutdown()")
            except mpidp.NotInitializedError:
                pass
        mpidp.init()
        mpidp.init()  # a second init() while initialised is a no-op
        if not mpidp.is_initialized():
            problems.append("is_initialized() False after init()")
        # Handle numbers go on across inits: the old one must not name this op (it did).
        new = mpidp.allreduce_async(torch.full((1,), 5.0), op=mpidp.Sum, name=f"{name}.new")
        try:
            mpidp.synchronize(old)
            problems.append("a handle from before shutdown() was accepted")
        except ValueError:
            pass
        if mpidp.synchronize(new).tolist() != [5.0 * n]:
            problems.append("the op after init() lost its result")
        problems += _smoke(f"{name}.after")
        # Names used before the restart are fresh again (the response cache starts empty).
        again = mpidp.allreduce(torch.ones(1), op=mpidp.Sum, name=f"{name}.old")
        if again.tolist() != [float(n)]:
            problems.append(f"name reused after restart: {again.tolist()}")
        return problems

    problems = run_all(body)
    assert_all(not problems, "; ".join(problems))
    test_queries_match_comm_world()


@pytest.mark.mpi
def test_init_shutdown_cycles():
    name = "test_init_shutdown_cycles"

    def body():
        problems = []
        for i in range(3):
            _reinit()
            problems += _smoke(f"{name}.{i}")
        return problems

    problems = run_all(body)
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
def test_init_with_user_communicator():
    name = "test_init_with_user_communicator"

    def body():
        comm = MPI.COMM_WORLD.Dup()
        try:
            mpidp.shutdown()
            mpidp.init(comm=comm)
            problems = _smoke(name)
            problems += (
                []
                if (mpidp.rank(), mpidp.size()) == (comm.Get_rank(), comm.Get_size())
                else ["rank/size differ from the communicator's"]
            )
            mpidp.shutdown()
            mpidp.init(comm=list(range(MPI.COMM_WORLD.Get_size())))
            problems += _smoke(f"{name}.list")
        finally:
            comm.Free()
        return problems

    try:
        problems = run_all(body)
    finally:
        _reinit()
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi(min_size=2)
def test_a_sub_world_of_one_rank_is_not_called_lonely(monkeypatch):
    """init(comm=...) on a communicator of one rank is deliberate: the warning that a world of
    size 1 runs under a launcher that announced more ranks is about COMM_WORLD only."""
    monkeypatch.setenv("PMI_SIZE", str(MPI.COMM_WORLD.Get_size()))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("mpidp").addHandler(handler)

    def body():
        comm = MPI.COMM_WORLD.Split(color=MPI.COMM_WORLD.Get_rank(), key=0)
        try:
            mpidp.shutdown()
            mpidp.init(comm=comm)
            alone = mpidp.size() == 1
            mpidp.shutdown()
        finally:
            comm.Free()
        return alone

    try:
        alone = run_all(body)
    finally:
        logging.getLogger("mpidp").removeHandler(handler)
        _reinit()
    lonely = [r.getMessage() for r in records if "world of size 1" in r.getMessage()]
    assert_all(alone and not lonely, lonely)


def _workload(name, rounds=3, names=12):
    """Named allreduces in rank-dependent order, several rounds (cache hits, evictions)."""
    r, n = rank(), size()
    problems = []
    for k in range(rounds):
        order = list(range(names))
        random.Random(100 * k + r).shuffle(order)
        hs = {
            i: mpidp.allreduce_async(
                torch.full((i % 4 + 1,), float(i + r)).to(
                    torch.bfloat16 if i % 3 == 0 else torch.float32
                ),
                op=mpidp.Sum,
                name=f"{name}.{i}",
            )
            for i in order
        }
        for i, h in hs.items():
            out = mpidp.synchronize(h)
            want = float(n * i + n * (n - 1) // 2)
            if out.float().tolist() != [want] * (i % 4 + 1):
                problems.append(f"round {k} tensor {i}: {out.tolist()} != {want}")
        # Same names, changed shapes (cache invalidation on every rank at once).
        if k == 1:
            outs = [
                mpidp.allreduce(torch.ones(5), op=mpidp.Sum, name=f"{name}.{i}") for i in range(3)
            ]
            if any(o.tolist() != [float(n)] * 5 for o in outs):
                problems.append(f"changed shapes: {outs}")
    problems += _smoke(f"{name}.smoke")
    return problems


@pytest.mark.mpi
@pytest.mark.parametrize(
    "knobs",
    [
        dict(cache_capacity=2),
        dict(cache_capacity=0),
        dict(fusion_threshold_bytes=0),
        dict(fuse_below_bytes=1 << 30, fusion_threshold_bytes=24),
        dict(chunk_bytes=8),
        dict(cycle_time_ms=2.0),
    ],
    ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()),
)
def test_knobs_change_nothing_observable(knobs):
    name = "test_knobs_change_nothing_observable." + "_".join(knobs)

    def body():
        _reinit(**knobs)
        return _workload(name)

    try:
        problems = run_all(body)
    finally:
        _reinit()
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi(min_size=2)
def test_shutdown_on_one_rank_fails_pending_ops_everywhere():
    """The last rank shuts down while the others wait on an op it never submits: their op
    fails with EngineShutdownError (not a hang); after shutdown/init on every rank all works."""
    name = "test_shutdown_on_one_rank_fails_pending_ops_everywhere"
    r, n = rank(), size()

    def body():
        problem = None
        if r == n - 1:
            time.sleep(0.2)
            mpidp.shutdown()
        else:
            h = mpidp.allreduce_async(torch.ones(1), op=mpidp.Sum, name=name)
            try:
                mpidp.synchronize(h, timeout=60)
                problem = "the op completed without the last rank"
            except mpidp.EngineShutdownError as e:
                if "shut down" not in str(e) or "init()" not in str(e):
                    problem = f"unhelpful message: {e}"
            except mpidp.OpTimeoutError:
                problem = "the pending op was not failed by a peer's shutdown() within 60 s"
            # The engine has stopped: new submissions are refused until init() again.
            try:
                mpidp.allreduce_async(torch.ones(1), name=f"{name}.refused")
                problem = problem or "a submission after the engine stopped was accepted"
            except mpidp.EngineShutdownError:
                pass
            mpidp.shutdown()
        mpidp.init()
        return problem, _smoke(f"{name}.after")

    try:
        problem, problems = run_all(body)
    finally:
        if not mpidp.is_initialized():
            mpidp.init()
    assert_all(problem is None and not problems, f"{problem}; {problems}")
    same = gather(mpidp.is_initialized())
    assert_all(all(same), f"initialised: {same}")


@pytest.mark.mpi
def test_results_stay_valid_after_shutdown():
    """Tensors returned before shutdown() are ordinary tensors that outlive the engine."""
    name = "test_results_stay_valid_after_shutdown"
    n = size()
    out = run_all(mpidp.allreduce, torch.ones(4), op=mpidp.Sum, name=name)
    run_all(_reinit)
    d = tensor_diff(out, torch.full((4,), float(n)))
    assert_all(not d, d)


@pytest.mark.mpi(min_size=2)
def test_stall_shutdown_fails_every_rank_with_one_message():
    """With stall_shutdown_s set, ops that some ranks never submit end the engine on every rank
    with the same clear EngineShutdownError (naming op and missing ranks) instead of a hang."""
    name = "test_stall_shutdown_fails_every_rank_with_one_message"
    r, n = rank(), size()

    def body():
        _reinit(stall_warning_s=0.5, stall_shutdown_s=1.0)
        # The last rank submits a different name: each op waits for ranks that never come.
        mine = f"{name}.{'y' if r == n - 1 else 'x'}"
        h = mpidp.allreduce_async(torch.ones(1), op=mpidp.Sum, name=mine)
        t0 = time.monotonic()
        try:
            mpidp.synchronize(h, timeout=60)
            return None, "the stalled op completed"
        except mpidp.EngineShutdownError as e:
            took = time.monotonic() - t0
            return str(e), (None if took < 30 else f"took {took:.1f} s")
        except mpidp.OpTimeoutError:
            return None, "no stall shutdown within 60 s"

    try:
        msg, problem = run_all(body)
    finally:
        _reinit()
    assert_all(problem is None, problem)
    msgs = gather(msg)
    assert_all(all(m == msgs[0] for m in msgs), f"different messages: {msgs}")
    words = ["stall", name, "1"]
    assert_all(all(w in msg for w in words), f"message {msg!r} lacks one of {words}")
    problems = run_all(_smoke, f"{name}.after")
    assert_all(not problems, "; ".join(problems))


def _forked_child(queue):
    try:
        got = [mpidp.rank(), mpidp.size()]
        try:
            mpidp.allreduce(torch.ones(1), name="from_a_forked_child")
            got.append("allreduce ran")
        except mpidp.MpidpError as exc:
            got.append(str(exc))
        queue.put(got)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        queue.put([repr(exc)])


@pytest.mark.mpi
def test_collectives_in_a_forked_child_are_refused_clearly():
    """A DataLoader worker (fork) calling a collective used its parent's MPI state: it talked
    to the other ranks' workers, or hung. It is refused; rank() and size() still work."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_forked_child, args=(queue,))
    child.start()
    got = queue.get(timeout=60)
    child.join(60)
    ok = got[:2] == [mpidp.rank(), mpidp.size()] and "forked" in got[2] and child.exitcode == 0
    assert_all(ok, f"child saw {got}, exit code {child.exitcode}")
    run_all(mpidp.allreduce, torch.ones(1), name="after_the_fork")  # the parent goes on
