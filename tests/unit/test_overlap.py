"""overlap.decide: the knob, and auto's rule (device parameters, cores per rank vs threads,
on one host and across hosts alike)."""

from types import SimpleNamespace

import pytest
import torch

from mpidp.training import overlap


def _state(setting, local_size, size=None):
    return SimpleNamespace(
        config=SimpleNamespace(overlap=setting),
        local_size=local_size,
        comms=SimpleNamespace(size=local_size if size is None else size),
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
