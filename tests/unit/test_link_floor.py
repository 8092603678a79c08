"""benchmarks/link_load.py's floor: the least step time a link's traffic allows on these cores."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "link_load.py"
_spec = importlib.util.spec_from_file_location("link_load", _PATH)
link_load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(link_load)

pytestmark = pytest.mark.timeout(60)


def test_without_ready_times_the_link_or_the_slowed_backward_pass_sets_it():
    # The link's 100 s outlast a backward pass of 10 slowed to half speed while 90 s cross.
    assert link_load.floor(1.0, 10.0, 20.0, 2.0, 100.0, 10.0) == pytest.approx(103.0)
    # A long backward pass: 50 + 90 x (1 - 0.5) + 10 = 105 > 100.
    assert link_load.floor(1.0, 50.0, 100.0, 2.0, 100.0, 10.0) == pytest.approx(108.0)


def test_gradients_ready_late_hold_the_link_back():
    """What is ready at t or later crosses after t: the MLP's shape, whose large gradients come
    late in the backward pass, cannot start its traffic at the pass's start."""
    ready = [(0.5, 1.0), (27.0, 67.0), (34.7, 34.0)]  # (ready at, transfer), ms
    early = [(0.0, 1.0), (0.0, 67.0), (34.7, 34.0)]
    without = link_load.floor(17.0, 35.0, 50.0, 13.0, 102.0, 34.0)
    assert without == pytest.approx(17.0 + 13.0 + 102.0)
    assert link_load.floor(17.0, 35.0, 50.0, 13.0, 102.0, 34.0, ready) == pytest.approx(
        17.0 + 13.0 + 27.0 + 101.0
    )
    # Ready early, the bound is no tighter than the link's own time.
    assert link_load.floor(17.0, 35.0, 50.0, 13.0, 102.0, 34.0, early) == pytest.approx(without)
