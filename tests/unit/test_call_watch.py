"""call_watch.CallWatch: a data-path or negotiation call in progress past the stall limits is
logged (naming this rank and the ranks on other hosts) and, past the shutdown limit, ends the job;
a negotiation call gets NEGOTIATION_SLACK_S more; calls that end are forgotten."""

import types

from mpidp.engine.call_watch import NEGOTIATION_SLACK_S, CallWatch

from . import test_stall

logged = test_stall.warnings_  # the fixture, here named `logged`: what mpidp logged


def _watch(warning_s=2.0, shutdown_s=10.0):
    stats = types.SimpleNamespace(collective=(0.0, 0.0), negotiate=(0.0, 0.0))
    aborted = []
    watch = CallWatch(
        stats, 0, [2, 3], warning_s, shutdown_s, abort=aborted.append, hosts=["a", "a", "b", "b"]
    )
    return watch, stats, aborted


def test_a_data_path_call_past_the_limits_is_reported_then_ends_the_job(logged):
    watch, stats, aborted = _watch()
    stats.collective = (0.0, 100.0)
    assert not watch.check(101.0) and not logged.records
    assert not watch.check(102.5)
    (rec,) = logged.records
    assert "rank 0 has waited 2.5 s in a data-path collective" in rec.getMessage()
    assert "ranks on other hosts: 2 (b), 3 (b)" in rec.getMessage()
    assert not watch.check(103.0) and len(logged.records) == 1  # once per warning period
    assert not watch.check(104.6) and len(logged.records) == 2
    assert not aborted
    assert watch.check(110.0)
    (msg,) = aborted
    assert "rank 0 has waited 10.0 s in a data-path collective" in msg
    assert "ranks on other hosts: 2 (b), 3 (b)" in msg and "MPIDP_STALL_SHUTDOWN_S=10" in msg


def test_a_negotiation_call_gets_the_slack(logged):
    watch, stats, aborted = _watch()
    stats.negotiate = (0.0, 100.0)
    assert not watch.check(110.0 + NEGOTIATION_SLACK_S - 0.1) and not aborted
    assert "negotiation exchange" in logged.records[0].getMessage()
    assert watch.check(110.0 + NEGOTIATION_SLACK_S)
    assert "negotiation exchange" in aborted[0]


def test_calls_that_end_are_forgotten_and_zero_limits_are_off(logged):
    watch, stats, aborted = _watch()
    stats.collective = (0.0, 100.0)
    watch.check(103.0)
    stats.collective = (3.0, 0.0)  # ended
    assert not watch.check(200.0)
    stats.collective = (3.0, 200.0)  # a new call warns after its own warning limit
    watch.check(203.0)
    assert len(logged.records) == 2
    off, stats, aborted = _watch(warning_s=0.0, shutdown_s=0.0)
    assert not off.enabled()
    off.start()
    assert off._thread is None
