"""stall.StallInspector: rate-limited raising, logging of missing ranks (again every warning
period while they wait), shutdown."""

import logging
import types

import pytest

from mpidp.engine import stall
from mpidp.engine.stall import StallInspector
from mpidp.log import logger


class Clock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    # Replace the module's `time`, not time.monotonic itself (pytest uses that too).
    monkeypatch.setattr(stall, "time", types.SimpleNamespace(monotonic=c))
    return c


@pytest.fixture
def warnings_(caplog, monkeypatch):
    """Records logged on "mpidp", whether or not log.configure() turned propagation off."""
    monkeypatch.setattr(logger, "propagate", False)
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="mpidp")
    yield caplog
    logger.removeHandler(caplog.handler)


def messages(caplog):
    out = [r.getMessage() for r in caplog.records if r.name == "mpidp"]
    caplog.clear()
    return out


# ---- should_raise ----


def test_should_raise_needs_an_op_older_than_the_threshold(clock):
    insp = StallInspector(2, warning_s=10.0, shutdown_s=0.0)
    assert not insp.should_raise(0.0)
    assert not insp.should_raise(9.9)
    assert insp.should_raise(10.0)


def test_should_raise_is_rate_limited(clock):
    insp = StallInspector(2, warning_s=10.0, shutdown_s=0.0)
    assert insp.should_raise(20.0)
    assert not insp.should_raise(20.0)
    clock.now += 0.5
    assert not insp.should_raise(20.5)
    clock.now += 0.5  # one second (min(1, threshold / 2)) after the last raise
    assert insp.should_raise(21.0)
    assert not insp.should_raise(21.0)


def test_should_raise_rate_is_half_the_threshold_when_short(clock):
    insp = StallInspector(2, warning_s=0.4, shutdown_s=0.0)
    assert insp.should_raise(0.5)
    clock.now += 0.19
    assert not insp.should_raise(0.7)
    clock.now += 0.01
    assert insp.should_raise(0.7)


def test_should_raise_uses_the_smaller_positive_limit(clock):
    insp = StallInspector(2, warning_s=0.0, shutdown_s=5.0)
    assert not insp.should_raise(4.0)
    assert insp.should_raise(5.0)
    insp = StallInspector(2, warning_s=30.0, shutdown_s=5.0)
    assert insp.should_raise(5.0)


def test_disabled_when_both_limits_are_zero(clock, warnings_):
    insp = StallInspector(2, warning_s=0.0, shutdown_s=0.0)
    assert not insp.enabled()
    assert not insp.should_raise(1e9)
    assert insp.inspect({0: [("a", 1e9)], 1: []}, []) is None
    assert messages(warnings_) == []


def test_enabled_with_either_limit():
    assert StallInspector(2, 1.0, 0.0).enabled()
    assert StallInspector(2, 0.0, 1.0).enabled()


# ---- inspect ----


def test_inspect_warns_naming_stalled_names_and_missing_ranks(warnings_):
    insp = StallInspector(4, warning_s=10.0, shutdown_s=0.0)
    snaps = {0: [("grad.a", 12.0), ("grad.b", 3.0)], 1: [("grad.a", 11.0)], 2: [], 3: []}
    assert insp.inspect(snaps, []) is None
    (msg,) = messages(warnings_)
    assert "'grad.a'" in msg
    assert "missing ranks 2,3" in msg
    assert "submitted by 0,1" in msg
    assert "waited 12.0 s" in msg
    # grad.b is missing on ranks but has not stalled long enough yet.
    assert "grad.b" not in msg


def test_inspect_lists_several_names_oldest_first(warnings_):
    insp = StallInspector(3, warning_s=10.0, shutdown_s=0.0)
    snaps = {0: [("young", 11.0), ("old", 50.0)], 1: [("young", 1.0)], 2: [("old", 2.0)]}
    insp.inspect(snaps, [])
    (msg,) = messages(warnings_)
    assert "2 op(s)" in msg
    assert msg.index("'old'") < msg.index("'young'")
    assert "'old': waited 50.0 s; missing ranks 1 (submitted by 0,2)" in msg
    assert "'young': waited 11.0 s; missing ranks 2 (submitted by 0,1)" in msg


def test_joined_ranks_are_not_missing(warnings_):
    insp = StallInspector(3, warning_s=10.0, shutdown_s=0.0)
    assert insp.inspect({0: [("a", 20.0)], 1: [("a", 20.0)], 2: []}, [2]) is None
    assert messages(warnings_) == []


def test_name_submitted_by_all_is_not_stalled(warnings_):
    insp = StallInspector(2, warning_s=1.0, shutdown_s=1.0)
    assert insp.inspect({0: [("a", 99.0)], 1: [("a", 98.0)]}, []) is None
    assert messages(warnings_) == []


def test_warns_once_per_name_per_period_and_again_after_it_completed(warnings_):
    insp = StallInspector(2, warning_s=10.0, shutdown_s=0.0)
    insp.inspect({0: [("a", 11.0)], 1: []}, [])
    assert len(messages(warnings_)) == 1
    # Still stalled on the next call: no second warning.
    insp.inspect({0: [("a", 12.0)], 1: []}, [])
    assert messages(warnings_) == []
    # A new stalled name warns, naming only the new one.
    insp.inspect({0: [("a", 13.0), ("b", 10.5)], 1: []}, [])
    (msg,) = messages(warnings_)
    assert "'b'" in msg and "'a'" not in msg
    # 'a' completes (absent from every snapshot), then stalls anew: warned again.
    insp.inspect({0: [("b", 11.0)], 1: []}, [])
    assert messages(warnings_) == []
    insp.inspect({0: [("a", 10.0), ("b", 12.0)], 1: []}, [])
    (msg,) = messages(warnings_)
    assert "'a'" in msg and "'b'" not in msg


def test_name_warned_when_it_crosses_the_threshold_later(warnings_):
    insp = StallInspector(2, warning_s=10.0, shutdown_s=0.0)
    insp.inspect({0: [("a", 5.0)], 1: []}, [])
    assert messages(warnings_) == []
    insp.inspect({0: [("a", 10.0)], 1: []}, [])
    assert len(messages(warnings_)) == 1


def test_warns_again_when_name_restalls_without_an_inspect_in_between(clock, warnings_):
    insp = StallInspector(2, warning_s=10.0, shutdown_s=0.0)
    insp.inspect({0: [("grad", 11.0)], 1: []}, [])
    assert len(messages(warnings_)) == 1
    clock.now += 1.0
    insp.inspect({0: [("grad", 12.0)], 1: []}, [])
    assert messages(warnings_) == []
    # 'grad' completed half a second later; the next training step resubmitted it at once and
    # it stalled again. No inspect() ran in between (nothing was stalled for 10 s meanwhile).
    clock.now += 0.5 + 10.5
    insp.inspect({0: [("grad", 10.5)], 1: []}, [])
    assert len(messages(warnings_)) == 1


def test_a_stall_that_goes_on_is_warned_again_every_period(clock, warnings_):
    """As Horovod's stall inspector: the warning repeats every check period, so a stuck job
    keeps saying why in its log instead of one line and then silence."""
    insp = StallInspector(2, warning_s=10.0, shutdown_s=0.0)
    insp.inspect({0: [("a", 11.0)], 1: []}, [])
    assert len(messages(warnings_)) == 1
    clock.now += 9.0
    insp.inspect({0: [("a", 20.0), ("b", 10.0)], 1: []}, [])
    (msg,) = messages(warnings_)
    assert "'b'" in msg and "'a'" not in msg
    clock.now += 1.0
    insp.inspect({0: [("a", 21.0), ("b", 11.0)], 1: []}, [])
    (msg,) = messages(warnings_)
    assert "'a': waited 21.0 s" in msg and "'b'" not in msg and "repeated every 10 s" in msg


def test_age_is_the_oldest_across_ranks(warnings_):
    insp = StallInspector(3, warning_s=10.0, shutdown_s=0.0)
    insp.inspect({0: [("a", 2.0)], 1: [("a", 10.0)], 2: []}, [])
    (msg,) = messages(warnings_)
    assert "waited 10.0 s" in msg


def test_shutdown_reason_only_after_shutdown_limit(warnings_):
    insp = StallInspector(2, warning_s=10.0, shutdown_s=30.0)
    assert insp.inspect({0: [("a", 15.0)], 1: []}, []) is None
    assert insp.inspect({0: [("a", 29.9)], 1: []}, []) is None
    reason = insp.inspect({0: [("a", 30.0)], 1: []}, [])
    assert reason is not None
    assert "'a'" in reason and "ranks 1" in reason
    assert "MPIDP_STALL_SHUTDOWN_S=30" in reason


def test_shutdown_reason_names_every_stalled_op_oldest_first():
    """Every rank gets the reason: a rank blocked in 'x' must find 'x' in it, not only the
    oldest op, which it may never have submitted."""
    insp = StallInspector(3, warning_s=0.0, shutdown_s=5.0)
    reason = insp.inspect({0: [("x", 6.0), ("y", 9.0)], 1: [("x", 6.0)], 2: []}, [])
    assert reason.startswith(
        "stall: op 'y' waited 9.0 s for ranks 1,2 (submitted by 0), "
        "op 'x' waited 6.0 s for ranks 2 (submitted by 0,1);"
    ), reason


def test_shutdown_reason_names_the_variable_the_user_set(monkeypatch):
    monkeypatch.delenv("MPIDP_STALL_SHUTDOWN_S", raising=False)
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "5")
    insp = StallInspector(2, warning_s=0.0, shutdown_s=5.0)
    reason = insp.inspect({0: [("a", 6.0)], 1: []}, [])
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=5:" in reason and "MPIDP_" not in reason


def test_shutdown_without_warning_logs_nothing(warnings_):
    insp = StallInspector(2, warning_s=0.0, shutdown_s=5.0)
    assert insp.inspect({0: [("a", 4.0)], 1: []}, []) is None
    assert insp.inspect({0: [("a", 6.0)], 1: []}, []) is not None
    assert messages(warnings_) == []


def test_no_shutdown_when_shutdown_limit_is_zero():
    insp = StallInspector(2, warning_s=1.0, shutdown_s=0.0)
    assert insp.inspect({0: [("a", 1e6)], 1: []}, []) is None


def test_disorder_names_each_ranks_call_when_no_ordered_call_is_common():
    insp = StallInspector(3, warning_s=60.0, shutdown_s=0.0, order_check_s=1.0)
    a, b = "torch.w.allreduce.float32[3]#0", "torch.w.broadcast.float32[4]#2"
    found = insp.disorder({0: [(a, 2.0)], 1: [(a, 1.5), ("mine", 9.0)], 2: [(b, 1.2)]}, [])
    assert found is not None
    names, error = found
    assert names == [a, b]
    assert "ranks 0,1 called allreduce float32[3]" in error and "rank 2 called broadcast" in error


def test_no_disorder_while_a_rank_waits_on_nothing_ordered_or_a_call_is_common():
    insp = StallInspector(2, warning_s=60.0, shutdown_s=0.0, order_check_s=1.0)
    a, b = "torch.w.allreduce.float32[3]#0", "torch.w.allreduce.float32[3]#1"
    assert insp.disorder({0: [(a, 3.0)], 1: [("mpidp.op", 3.0)]}, []) is None  # a late rank
    assert insp.disorder({0: [(a, 3.0), (b, 1.0)], 1: [(a, 0.1)]}, []) is None
    assert insp.disorder({0: [(a, 3.0)], 1: [(b, 3.0)]}, [1]) is None  # rank 1 joined


def test_an_ordered_op_raises_the_check_after_order_check_s():
    insp = StallInspector(2, warning_s=60.0, shutdown_s=0.0, order_check_s=1.0)
    assert not insp.should_raise(0.5, 0.5)
    assert insp.should_raise(1.5, 1.5)
    assert not StallInspector(2, 60.0, 0.0, 0.0).should_raise(1.5, 1.5)
