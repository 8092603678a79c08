"""Autotune on live traffic: rank 0 decides, all ranks switch at one cycle, results stay exact."""

import pytest
import torch
from mpi_util import assert_all, gather, run_all

import mpidp
from mpidp.runtime import observe, world

pytestmark = pytest.mark.timeout(180)

KiB = 1024
SIZES = [16, 1000, 5 * KiB, 20 * KiB, 70 * KiB, 300 * KiB, 10, 3 * KiB]  # float32 elements


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _round(tag):
    """One step of traffic; '' if every result is exact, else what differs."""
    size, rank = mpidp.size(), mpidp.rank()
    tensors = [torch.full((n,), float(rank + 1 + i)) for i, n in enumerate(SIZES)]
    handles = [
        mpidp.allreduce_async_(t, name=f"{tag}.{i}", op=mpidp.Sum) for i, t in enumerate(tensors)
    ]
    for h in handles:
        mpidp.synchronize(h)
    bad = []
    for i, t in enumerate(tensors):
        want = float(sum(r + 1 + i for r in range(size)))
        if not torch.equal(t, torch.full_like(t, want)):
            bad.append(f"{tag}.{i}")
    return ", ".join(bad)


def _tuned_run(tag, max_rounds=3000, **knobs):
    """Re-init with autotune and `knobs`, run rounds until rank 0's search ends; returns
    (this rank's switches, final parameters, stats params, rounds)."""
    mpidp.shutdown()
    mpidp.init(
        autotune=True,
        autotune_warmup_samples=0,
        autotune_samples_per_point=1,
        autotune_sample_s=0.02,
        **knobs,
    )
    try:
        engine = world.state().engine
        rounds = 0
        while True:
            bad = _round(tag)
            assert_all(not bad, f"round {rounds}: wrong results for {bad} under {engine.params()}")
            rounds += 1
            done = _world().bcast(engine.sampler.done if engine.rank == 0 else None, 0)
            if done or rounds >= max_rounds:
                break
        assert_all(done, f"the search had not ended after {rounds} rounds")
        _round(tag)  # the cycle that carries the final switch has run everywhere after this
        best = _world().bcast(engine.sampler.best if engine.rank == 0 else None, 0)
        return engine.switches, engine.params(), observe.stats()["params"], best, rounds
    finally:
        mpidp.shutdown()
        mpidp.init()


def test_all_ranks_switch_together_and_results_stay_exact():
    switches, final, reported, best, rounds = run_all(_tuned_run, "tune.a", cycle_time_ms=0.0)
    views = gather((switches, final))
    assert_all(
        all(v == views[0] for v in views),
        f"ranks differ in (cycle, parameters) switches or final parameters: {views}",
    )
    assert_all(len(switches) >= 2, f"only {len(switches)} switches in {rounds} rounds")
    assert_all(final == reported, f"stats() reports {reported}, engine holds {final}")
    assert_all(final == best, f"final {final} is not rank 0's best {best}")
    # cycle_time_ms was set explicitly (init keyword): never touched.
    assert_all(
        final["cycle_time_ms"] == 0.0
        and all(p.get("cycle_time_ms", 0.0) == 0.0 for _, p in switches),
        str(switches),
    )
    cycles = [c for c, _ in switches]
    assert_all(cycles == sorted(cycles), f"switch cycles {cycles}")


def test_explicit_knobs_are_never_tuned():
    knobs = dict(
        fusion_threshold_bytes=2 * 1024 * 1024, fuse_below_bytes=32 * KiB, cycle_time_ms=0.0
    )
    switches, final, _, _, rounds = run_all(_tuned_run, "tune.b", **knobs)
    assert_all(
        rounds == 1 and switches == [] and final == knobs,
        f"rounds {rounds}, switches {switches}, final {final}",
    )
