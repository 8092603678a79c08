"""overlap.decide: the knob, and auto's rule (device parameters, cores per rank vs threads);
overlap.trial and Trial: across hosts on the CPU, `auto` times both modes and keeps the faster."""

from types import SimpleNamespace

import pytest
import torch

from mpidp.training import overlap


def _state(setting, local_size, size=None, trial_steps=5):
    size = local_size if size is None else size
    return SimpleNamespace(
        config=SimpleNamespace(overlap=setting, overlap_trial_steps=trial_steps),
        local_size=local_size,
        cross_size=size // local_size,
        comms=SimpleNamespace(size=size),
    )


@pytest.mark.parametrize("setting, expected", [("1", True), ("0", False)])
def test_explicit_setting_wins(monkeypatch, setting, expected):
    monkeypatch.setattr(overlap, "host_cores", lambda: 64)
    assert overlap.decide(_state(setting, 1), [torch.zeros(1)]) == expected


@pytest.mark.parametrize(
    "cores, ranks, threads, expected",
    [
        (2, 2, 1, False),  # this project's machine at np=2: one core per rank, one torch thread
        (2, 1, 1, True),  # np=1: a core to spare
        (16, 2, 8, False),  # torch's threads take each rank's share
        (16, 2, 4, True),
    ],
)
def test_auto_overlaps_cpu_training_only_with_a_spare_core(
    monkeypatch, cores, ranks, threads, expected
):
    monkeypatch.setattr(overlap, "host_cores", lambda: cores)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert overlap.decide(_state("auto", ranks), [torch.zeros(1)]) == expected


def test_auto_overlaps_parameters_on_a_device(monkeypatch):
    monkeypatch.setattr(overlap, "host_cores", lambda: 1)
    meta = torch.zeros(1, device="meta")
    assert overlap.decide(_state("auto", 8), [torch.zeros(1), meta]) is True


@pytest.mark.parametrize(
    "local_size, size, expected",
    [
        (2, 2, False),  # one full host: reductions are the CPU's memory copies
        (2, 4, False),  # two full hosts: the network's work costs CPU too
        (1, 2, True),  # a core to spare
    ],
)
def test_auto_across_hosts_overlaps_only_with_a_spare_core(monkeypatch, local_size, size, expected):
    monkeypatch.setattr(overlap, "host_cores", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert overlap.decide(_state("auto", local_size, size), [torch.zeros(1)]) is expected


@pytest.mark.parametrize(
    "setting, local_size, size, trial_steps, device, expected",
    [
        ("auto", 1, 2, 5, "cpu", True),  # 2 hosts x 1 rank
        ("auto", 2, 4, 5, "cpu", True),  # 2 hosts x 2 ranks
        ("auto", 2, 2, 5, "cpu", False),  # one host: the core rule stands
        ("auto", 1, 2, 0, "cpu", False),  # the knob at 0: no trial
        ("1", 1, 2, 5, "cpu", False),  # a forced mode is not tried
        ("0", 1, 2, 5, "cpu", False),
        ("auto", 1, 2, 5, "meta", False),  # a device: overlap, no trial
    ],
)
def test_a_trial_only_across_hosts_on_the_cpu_under_auto(
    setting, local_size, size, trial_steps, device, expected
):
    params = [torch.zeros(1, device=device)]
    got = overlap.trial(_state(setting, local_size, size, trial_steps), params)
    assert (got is not None) is expected


def _run(trial, period):
    """Drive `trial` with steps that take period(mode) seconds; the modes of the steps run."""
    now, modes = 0.0, []
    while trial.choice is None:
        mode = trial.mode
        modes.append(mode)
        now += period(mode)
        assert trial.step_ended(now) == trial.mode
    return modes


def _plan(steps):
    """The modes of a trial's steps: 2 first ones and 1 after each switch untimed."""
    first, switch = overlap._FIRST_STEPS, overlap._SWITCH_STEPS
    on, off = [True] * steps, [False] * steps
    return [True] * first + on + [False] * switch + off + off + [True] * switch + on


@pytest.mark.parametrize("faster", [True, False])
def test_the_trial_keeps_the_faster_mode(faster):
    trial = overlap.Trial(3)
    modes = _run(trial, lambda mode: 0.10 if mode == faster else 0.12)
    # Blocks overlapped, not, not, overlapped: a drifting pace weighs on both alike.
    assert modes == _plan(3)
    assert trial.choice is faster and trial.mode is faster
    assert trial.step_ended(99.0) is faster  # settled: no more timing


def test_the_trial_times_neither_the_first_steps_nor_those_after_a_switch():
    # Those steps are slow in the mode they run in (a first step allocates, the one after a
    # switch carries the other mode's tail): the medians must not see them.
    trial = overlap.Trial(3)
    plan, index = _plan(3), [0]

    def period(mode):
        i = index[0]
        index[0] += 1
        untimed = i < overlap._FIRST_STEPS or plan[i] != plan[i - 1]
        if mode and untimed:
            return 5.0
        return 0.10 if mode else 0.11

    _run(trial, period)
    assert trial.choice is True


def test_a_pace_that_drifts_during_the_trial_does_not_pick_a_mode():
    # Every step slower than the last by the same amount, in both modes: the blocks' order
    # (overlapped, not, not, overlapped) leaves the drift out of the comparison, and the mode
    # whose steps are 0.125 s shorter wins; a trial of all overlapped steps first would have
    # picked overlapping by the drift alone.
    trial = overlap.Trial(4)
    clock = [0]

    def period(mode):
        clock[0] += 1
        return 1.0 + clock[0] * 0.25 + (0.0 if mode else -0.125)

    _run(trial, period)
    on, off = (sorted(trial._times[m]) for m in (True, False))
    assert len(on) == len(off) == 8
    assert trial.choice is False


def test_a_tie_keeps_overlap():
    trial = overlap.Trial(2)
    _run(trial, lambda mode: 0.5)  # exact in binary: the clock sums it without error
    assert trial.choice is True
