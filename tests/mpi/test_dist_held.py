"""torch.distributed over "mpidp": async allreduces called in a backward pass are held to its end
where the overlap rule says overlapping does not pay, are completed on its thread when it ends, and
whatever waits on them still gets them."""

import copy
import dataclasses
import logging
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist
from mpi_util import assert_all, ddp_beside_one_process, gather, rank, size, tensor_diff

import mpidp.distributed  # noqa: F401  (registers backend "mpidp")
from mpidp.distributed import held
from mpidp.distributed import work as work_module
from mpidp.training import overlap


@pytest.fixture(scope="module", autouse=True)
def process_group():
    dist.init_process_group("mpidp")
    yield
    dist.destroy_process_group()


@pytest.fixture
def group(monkeypatch, request):
    """A fresh "mpidp" group (each decides overlap at its first async allreduce) whose overlap
    rule answers `request.param` (default False: calls in a backward pass are held)."""
    overlaps = getattr(request, "param", False)
    monkeypatch.setattr(overlap, "decide", lambda state, params: overlaps)
    g = dist.new_group(backend="mpidp")
    yield g
    dist.destroy_process_group(g)


class _InBackward(torch.autograd.Function):
    """Runs `during(grad)` in its backward, that is inside the backward pass."""

    @staticmethod
    def forward(ctx, x, during):
        ctx.during = during
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.during(grad)
        return grad, None


def _backward_with(during):
    x = torch.ones(3, requires_grad=True)
    _InBackward.apply(x, during).sum().backward()


def test_held_in_backward_and_submitted_when_it_ends(group):
    n, r = size(), rank()
    seen = {}

    def during(_):
        t = torch.full((5,), float(r + 1))
        seen["work"], seen["t"] = dist.all_reduce(t, async_op=True, group=group), t
        time.sleep(0.05)  # time enough for a submitted 20 B allreduce to finish
        seen["during"] = seen["work"].is_completed()

    _backward_with(during)
    seen["work"].get_future().wait()  # the future, as DDP waits: it completes
    seen["work"].wait()
    problem = tensor_diff(seen["t"], torch.full((5,), n * (n + 1) / 2))
    assert_all(
        not seen["during"] and not problem, f"done during backward: {seen['during']}; {problem}"
    )


@pytest.mark.parametrize("group", [True], indirect=True)
def test_nothing_held_where_overlap_pays(group):
    seen = {}

    def during(_):
        t = torch.ones(2)
        seen["work"], seen["t"] = dist.all_reduce(t, async_op=True, group=group), t
        seen["work"].wait()  # submitted at once: completes inside the backward pass

    _backward_with(during)
    problem = tensor_diff(seen["t"], torch.full((2,), float(size())))
    assert_all(not problem, problem)


@pytest.mark.parametrize("group", [False, True], ids=["held", "not_held"], indirect=True)
def test_the_calls_of_a_backward_pass_are_completed_on_its_thread_when_it_ends(group, monkeypatch):
    """Held or submitted at once, the async allreduces a backward pass called are completed by
    the end of the pass, by its own thread (it drives the engine, its waits spin, as a blocking
    call's do), not left to the completion thread while DDP waits on their futures."""
    n = size()
    callers: dict = {}
    complete = work_module.Work.complete

    def recorded(self):
        callers.setdefault(id(self), set()).add(threading.get_ident())
        complete(self)

    monkeypatch.setattr(work_module.Work, "complete", recorded)
    out = []

    def during(_):
        for k in range(3):
            t = torch.full((k + 2,), float(rank() + k))
            out.append((t, dist.all_reduce(t, async_op=True, group=group)))

    _backward_with(during)
    done = [w.is_completed() for _, w in out]
    by_us = [threading.get_ident() in callers.get(id(w), ()) for _, w in out]
    for _, w in out:
        w.wait()
    want = [n * (n - 1) / 2 + n * k for k in range(3)]
    problems = [tensor_diff(t, torch.full(t.shape, v)) for (t, _), v in zip(out, want)]
    assert_all(
        all(done) and all(by_us) and not any(problems),
        f"completed by the end of the pass: {done}; by its thread: {by_us}; {problems}",
    )


def test_auto_times_both_modes_over_the_first_backward_passes(monkeypatch):
    """Where `auto` is settled by timing (across hosts, host tensors: overlap.trial, here made
    to apply on one host), a group's calls from backward passes are held or not in the trial's
    blocks, overlapped, not, not, overlapped, one mode is kept after it, the group says when it
    is settled, and every result is right."""
    real_trial = overlap.trial

    def trial(state, params, process_set=None, name=""):
        across = types.SimpleNamespace(  # across hosts, as far as trial() can tell
            config=dataclasses.replace(state.config, overlap="auto", overlap_trial_steps=1),
            cross_size=2,
        )
        return real_trial(across, params, process_set, name)

    monkeypatch.setattr(overlap, "trial", trial)
    g = dist.new_group(backend="mpidp")
    n = size()
    try:
        modes, settled, problems = [], [], []
        for i in range(11):
            out = []

            def during(_):
                t = torch.full((3,), float(rank() + i))
                out.append((t, dist.all_reduce(t, async_op=True, group=g)))

            _backward_with(during)
            t, work = out[0]
            modes.append(not isinstance(work, held._HeldWork))
            settled.append(g.overlap_settled())
            work.wait()
            problems.append(tensor_diff(t, torch.full((3,), n * (n - 1) / 2 + n * i)))
    finally:
        dist.destroy_process_group(g)
    # 2 first passes, then blocks of 1 timed pass, a settling pass after each switch; the
    # ranks agree on the mode they keep.
    want = [True, True, True, False, False, False, True, True]
    kept = gather(modes[-1])
    assert_all(
        modes[:8] == want
        and settled == [False] * 7 + [True] * 4
        and len(set(modes[8:])) == 1
        and len(set(kept)) == 1
        and not any(problems),
        f"overlapped: {modes}; settled: {settled}; kept by the ranks: {kept}; {problems}",
    )


def test_wait_inside_backward_submits_what_is_held(group):
    """A wait on a held call inside the backward pass submits it (and every call held before
    it), in call order, and the ranks' names still match."""
    n = size()
    out = []

    def during(_):
        ts = [torch.full((k + 1,), 1.0) for k in range(3)]
        works = [dist.all_reduce(t, async_op=True, group=group) for t in ts]
        works[1].wait()
        deadline = time.monotonic() + 30
        while not works[0].is_completed() and time.monotonic() < deadline:
            time.sleep(0.005)  # no wait(): submitted with works[1], the engine runs it
        out.append(works[0].is_completed())
        works[2].wait()
        out.extend(ts)

    _backward_with(during)
    problems = [tensor_diff(t, torch.full(t.shape, float(n))) for t in out[1:]]
    assert_all(out[0] and not any(problems), f"the first done: {out[0]}; {problems}")


@pytest.mark.parametrize("group", [False, True], ids=["held", "not_held"], indirect=True)
def test_more_calls_of_one_signature_than_names_each_get_their_result(group):
    """More calls of one signature in flight than a group has names for it (CallNames): a later
    call with the name of one held submits and waits for that one first; of one in flight,
    waits for it without taking its result from its work."""
    n = size()
    out = []

    def during(_):
        ts = [torch.full((4,), float(k)) for k in range(7)]
        works = [dist.all_reduce(t, async_op=True, group=group) for t in ts]
        out.extend(zip(ts, works))

    _backward_with(during)
    for _, w in out:
        w.wait()
    problems = [tensor_diff(t, torch.full((4,), float(k * n))) for k, (t, _) in enumerate(out)]
    assert_all(not any(problems), str(problems))


def test_a_wait_no_method_sees_is_released_by_the_limit(group, monkeypatch, caplog):
    """`fut.then(f).wait()` inside the backward pass waits where no method of the group sees
    it: the held call is submitted after HOLD_LIMIT_S, with a warning, instead of hanging."""
    monkeypatch.setattr(held, "HOLD_LIMIT_S", 0.3)
    out = []

    def during(_):
        t = torch.ones(3)
        fut = dist.all_reduce(t, async_op=True, group=group).get_future()
        start = time.monotonic()
        out.append(fut.then(lambda f: f.value()[0] * 2).wait())
        out.append(time.monotonic() - start)

    with caplog.at_level(logging.WARNING, logger="mpidp"):
        _backward_with(during)
    problem = tensor_diff(out[0], torch.full((3,), 2.0 * size()))
    warned = any("held for the end of a backward pass" in m for m in caplog.messages)
    assert_all(
        not problem and 0.25 <= out[1] < 10 and warned,
        f"{problem}; released after {out[1]:.2f} s; warned: {warned}",
    )


def test_a_pass_that_raised_leaves_its_calls_to_the_next_pass(group, monkeypatch):
    """A backward pass that raises runs none of its final callbacks: its held call goes with
    the next pass's (not after HOLD_LIMIT_S), and its result is right."""
    monkeypatch.setattr(held, "HOLD_LIMIT_S", 30.0)
    n = size()
    out = []

    def failing(_):
        t = torch.full((2,), 3.0)
        out.append((t, dist.all_reduce(t, async_op=True, group=group)))
        raise RuntimeError("a failure in the backward pass")

    def normal(_):
        t = torch.full((3,), 5.0)
        out.append((t, dist.all_reduce(t, async_op=True, group=group)))

    with pytest.raises(RuntimeError, match="a failure in the backward pass"):
        _backward_with(failing)
    start = time.monotonic()
    _backward_with(normal)
    for _, work in out:
        work.get_future().wait()  # no wait() of ours: the end of the second pass released both
    took = time.monotonic() - start
    problems = [tensor_diff(t, torch.full(t.shape, v * n)) for (t, _), v in zip(out, (3.0, 5.0))]
    assert_all(took < 10 and not any(problems), f"{took:.1f} s; {problems}")


def test_outside_backward_nothing_is_held(group):
    t = torch.ones(2)
    work = dist.all_reduce(t, async_op=True, group=group)
    deadline = time.monotonic() + 30
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.005)  # no wait(): the engine runs it on its own
    assert_all(work.is_completed() and not tensor_diff(t, torch.full((2,), float(size()))))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


@pytest.mark.parametrize(
    "opts",
    [
        {"bucket_cap_mb": 0.0001},
        {"static_graph": True, "bucket_cap_mb": 0.0001},
        {"find_unused_parameters": True},
        {"gradient_as_bucket_view": True, "hook": "fp16"},
    ],
    ids=["small_buckets", "static_graph", "find_unused", "view_fp16_hook"],
)
def test_ddp_with_held_buckets_trains_as_one_process(group, opts):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    opts = dict(opts)
    hook = opts.pop("hook", None)
    ref = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(ref), process_group=group, **opts)
    if hook is not None:
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    worst = ddp_beside_one_process(ddp, ref, steps=4, seed=2)
    tol = 2e-3 if hook else 1e-5
    assert_all(worst <= tol, f"{opts}: parameters differ from one process by {worst:.2e}")
