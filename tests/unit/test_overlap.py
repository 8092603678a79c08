"""overlap.decide: the knob, and auto's rule (device parameters, cores per rank vs threads,
ranks across hosts and the engine's measure of the link)."""

from types import SimpleNamespace

import pytest
import torch

from mpidp.training import overlap


def _state(setting, local_size, size=None, link_slow=None):
    return SimpleNamespace(
        config=SimpleNamespace(overlap=setting),
        local_size=local_size,
        comms=SimpleNamespace(size=local_size if size is None else size),
        engine=SimpleNamespace(backend=SimpleNamespace(link_slow=lambda kind: link_slow)),
    )


@pytest.mark.parametrize("setting, expected", [("1", True), ("0", False)])
def test_explicit_setting_wins(monkeypatch, setting, expected):
    monkeypatch.setattr(overlap, "host_cores", lambda: 64)
    assert overlap.decide(_state(setting, 1), [torch.zeros(1)]) == (expected, True)


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
    assert overlap.decide(_state("auto", ranks), [torch.zeros(1)]) == (expected, True)


def test_auto_overlaps_parameters_on_a_device(monkeypatch):
    monkeypatch.setattr(overlap, "host_cores", lambda: 1)
    meta = torch.zeros(1, device="meta")
    assert overlap.decide(_state("auto", 8), [torch.zeros(1), meta]) == (True, True)


@pytest.mark.parametrize(
    "local_size, size, link_slow, expected",
    [
        (2, 2, None, (False, True)),  # one full host: reductions are the CPU's memory copies
        (2, 4, None, (True, False)),  # two full hosts, link not measured yet: overlap, ask again
        (2, 4, True, (True, True)),  # a slow link sets the pace: overlap
        (2, 4, False, (False, True)),  # a fast link: the cores set the pace, as on one host
        (1, 2, False, (True, True)),  # a core to spare
    ],
)
def test_auto_across_hosts_follows_the_measured_link(
    monkeypatch, local_size, size, link_slow, expected
):
    monkeypatch.setattr(overlap, "host_cores", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    state = _state("auto", local_size, size, link_slow)
    assert overlap.decide(state, [torch.zeros(1)]) == expected
