"""mpidp.engine.autotune: the coordinate search, its sampling on rank 0 and the CSV log."""

import csv
import types

import pytest

from mpidp import config
from mpidp.engine import autotune


def run_search(tuner, score_of, limit=500):
    """Feed `score_of(current params)` until the tuner is done; returns the switches made."""
    switches = []
    for _ in range(limit):
        if tuner.done:
            return switches
        switch = tuner.record(score_of(tuner.current))
        if switch is not None:
            switches.append(switch)
    raise AssertionError("the search did not end")


def test_finds_the_best_point_of_a_separable_score():
    space = {"a": [1, 2, 3, 4], "b": [10, 20, 30]}
    best = {"a": 3, "b": 10}
    score = lambda p: -abs(p["a"] - best["a"]) - abs(p["b"] - best["b"]) / 10  # noqa: E731
    tuner = autotune.Tuner({"a": 1, "b": 30}, space, warmup=0, samples=1, confirm=0)
    switches = run_search(tuner, score)
    assert tuner.best == best and tuner.current == best
    assert switches[-1] == best
    # Coordinate search: every a with b=30, then every other b with a=3; no point twice.
    assert len(tuner.scores) == 4 + 2


def test_warmup_samples_are_dropped_and_the_median_scores_a_point():
    space = {"a": [1, 2]}
    tuner = autotune.Tuner({"a": 1}, space, warmup=2, samples=3, confirm=0)
    # Two warm-up samples (ignored, however bad), then 3 samples: median 5.
    for value in (-100.0, -100.0, 5.0, 1000.0):
        assert tuner.record(value) is None
    assert tuner.record(4.0) == {"a": 2}
    assert tuner.scores[(1,)] == 5.0
    # a=2: warm-up again, then samples with median 6 beat 5.
    for value in (1e9, 1e9, 6.0, 7.0):
        assert tuner.record(value) is None
    assert not tuner.done
    assert tuner.record(6.0) is None  # a=2 is the best and the current point: no switch
    assert tuner.done and tuner.best == {"a": 2} and tuner.scores[(2,)] == 6.0


def test_a_worse_last_point_switches_back_to_the_best():
    tuner = autotune.Tuner({"a": 1}, {"a": [1, 2]}, warmup=0, samples=1, confirm=0)
    assert tuner.record(10.0) == {"a": 2}
    assert tuner.record(3.0) == {"a": 1}
    assert tuner.done and tuner.current == {"a": 1}
    assert tuner.record(99.0) is None  # done: no more switches


def test_nothing_to_tune_is_done_at_once():
    tuner = autotune.Tuner({"a": 1}, {"a": [1]}, warmup=0, samples=1)
    assert tuner.done and tuner.record(1.0) is None
    with pytest.raises(ValueError):
        autotune.Tuner({"a": 1}, {"a": [1, 2]}, warmup=0, samples=0)
    with pytest.raises(ValueError):
        autotune.Tuner({"a": 1}, {"a": [1, 2]}, warmup=0, samples=1, confirm=-1)


def test_rematch_keeps_the_start_when_the_winner_was_a_lucky_moment():
    tuner = autotune.Tuner({"a": 1}, {"a": [1, 2, 3]}, warmup=0, samples=1, confirm=2)
    assert tuner.record(10.0) == {"a": 2}
    assert tuner.record(50.0) == {"a": 3}  # a quiet moment makes a=2 look 5x better
    assert tuner.record(9.0) == {"a": 2}  # search over: rematch a=2 against a=1 in turns
    assert not tuner.done and tuner.confirming
    assert tuner.record(10.0) == {"a": 1}
    assert tuner.record(11.0) == {"a": 2}
    assert tuner.record(9.5) == {"a": 1}
    assert tuner.record(10.5) is None and tuner.done  # already there: no switch needed
    assert tuner.current == {"a": 1} and tuner.best == {"a": 1}
    assert tuner.rematch == {(2,): [10.0, 9.5], (1,): [11.0, 10.5]}


def test_rematch_confirms_a_real_improvement_starting_on_the_winner():
    tuner = autotune.Tuner({"a": 1}, {"a": [1, 2]}, warmup=1, samples=1, confirm=2)
    tuner.record(0.0)  # warm-up
    assert tuner.record(10.0) == {"a": 2}
    tuner.record(0.0)
    # a=2 wins and is the current point: the rematch begins there, with no switch.
    assert tuner.record(20.0) is None and tuner.confirming
    assert tuner.record(19.0) == {"a": 1}
    tuner.record(0.0)
    assert tuner.record(10.0) == {"a": 2}
    tuner.record(0.0)
    assert tuner.record(21.0) == {"a": 1}
    tuner.record(0.0)
    assert tuner.record(9.0) == {"a": 2} and tuner.done
    assert tuner.best == {"a": 2} and tuner.best_score == 20.0


def test_search_space_leaves_explicit_knobs_alone_and_includes_start_values():
    cfg = config.load({}, fusion_threshold_bytes=3 * 1024 * 1024)
    space = autotune.search_space(cfg)
    assert "fusion_threshold_bytes" not in space
    assert set(space) == {"fuse_below_bytes", "cycle_time_ms"}
    cfg = config.load({"MPIDP_CYCLE_TIME_MS": "0.7"})
    space = autotune.search_space(cfg)
    assert "cycle_time_ms" not in space
    cfg = config.load({})
    space = autotune.search_space(cfg)
    for field, values in space.items():
        assert getattr(cfg, field) in values and values == sorted(values)


def _fake_clock(monkeypatch):
    clock = types.SimpleNamespace(now=100.0)
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: clock.now)
    return clock


def test_sampler_scores_bytes_per_second_and_logs_csv(tmp_path, monkeypatch):
    clock = _fake_clock(monkeypatch)
    log = tmp_path / "tune.csv"
    cfg = config.load(
        {},
        autotune_log=str(log),
        autotune_warmup_samples=0,
        autotune_samples_per_point=1,
        autotune_sample_s=1.0,
        fuse_below_bytes=65536,
        cycle_time_ms=0,
    )
    start = {"fusion_threshold_bytes": cfg.fusion_threshold_bytes}
    sampler = autotune.Sampler(cfg, start)
    assert sampler.poll(0, busy=False) is None  # idle: no sample starts
    total = 0
    assert sampler.poll(total, busy=True) is None  # traffic: the sample starts now
    # Each point moves more bytes per second the larger its threshold, up to 16 MiB.
    switches = []
    for _ in range(50):
        if sampler.tuner.done:
            break
        clock.now += 1.0
        total += min(sampler.tuner.current["fusion_threshold_bytes"], 16 * 1024 * 1024)
        switch = sampler.poll(total, busy=True)
        if switch is not None:
            switches.append(switch)
            assert sampler.poll(total, busy=True) is None  # a new sample starts here
    assert sampler.tuner.done
    assert sampler.tuner.best == {"fusion_threshold_bytes": 16 * 1024 * 1024}
    rows = list(csv.reader(log.open()))
    assert tuple(rows[0]) == autotune.CSV_HEADER
    kinds = [r[1] for r in rows[1:]]
    assert kinds.count("sample") == len(sampler.tuner.scores) and kinds[-1] == "chosen"
    assert rows[-1][2] == str(16 * 1024 * 1024)
    first = rows[1]
    assert float(first[5]) == pytest.approx(4 * 1024 * 1024)  # 4 MiB in one second


def test_sampler_ignores_windows_without_traffic(monkeypatch):
    clock = _fake_clock(monkeypatch)
    cfg = config.load(
        {}, autotune_warmup_samples=0, autotune_samples_per_point=1, autotune_sample_s=1.0
    )
    sampler = autotune.Sampler(
        cfg,
        {
            "fusion_threshold_bytes": cfg.fusion_threshold_bytes,
            "fuse_below_bytes": cfg.fuse_below_bytes,
            "cycle_time_ms": cfg.cycle_time_ms,
        },
    )
    sampler.poll(0, busy=True)
    clock.now += 5.0
    assert sampler.poll(0, busy=False) is None
    assert sampler.tuner.scores == {}
