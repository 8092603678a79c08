"""engine/interrupts.py: a Ctrl-C on the main thread while it runs engine cycles is held until
the driving call ends (or raised at once by a second one); otherwise it is raised as always."""

import os
import signal
import threading

import pytest

from mpidp.engine import interrupts


@pytest.fixture
def installed():
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupts.install()
    assert signal.getsignal(signal.SIGINT) is interrupts._on_sigint
    yield
    interrupts._driving = interrupts._pending = False
    signal.signal(signal.SIGINT, before)


def _ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)


def test_held_while_driving_then_raised_by_deliver(installed):
    interrupts.defer()
    _ctrl_c()  # no KeyboardInterrupt here: the cycle in flight goes on
    assert interrupts.pending()
    with pytest.raises(KeyboardInterrupt):
        interrupts.deliver()
    assert not interrupts.pending()
    interrupts.deliver()  # nothing held any more: nothing raised


def test_a_second_ctrl_c_is_raised_at_once(installed):
    interrupts.defer()
    _ctrl_c()
    with pytest.raises(KeyboardInterrupt):
        _ctrl_c()
    assert not interrupts.pending()


def test_raised_at_once_when_not_driving(installed):
    with pytest.raises(KeyboardInterrupt):
        _ctrl_c()
    interrupts.defer()
    interrupts.deliver()
    with pytest.raises(KeyboardInterrupt):
        _ctrl_c()


def test_a_scripts_own_handler_is_left_alone():
    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGINT, mine)
    try:
        interrupts.install()
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, before)


def test_the_main_thread_does_not_drive_cycles_while_a_job_signal_has_a_python_handler():
    """A handler that raises (SystemExit at SIGTERM) would leave a cycle half done."""
    it = interrupts
    old = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert it.may_drive()
        signal.signal(signal.SIGTERM, lambda *a: None)
        assert not it.may_drive()
        seen = []
        worker = threading.Thread(target=lambda: seen.append(it.may_drive()))
        worker.start()
        worker.join()
        assert seen == [True]  # only the main thread runs Python signal handlers
    finally:
        signal.signal(signal.SIGTERM, old)


def test_defer_says_whether_it_started_holding(installed):
    """A driving call nested in another (a completion callback that blocks) must not end the
    outer call's hold when it gives up."""
    assert interrupts.defer() is True
    assert interrupts.defer() is False
    _ctrl_c()
    assert interrupts.pending()
    with pytest.raises(KeyboardInterrupt):
        interrupts.deliver()
    seen = []
    worker = threading.Thread(target=lambda: seen.append(interrupts.defer()))
    worker.start()
    worker.join()
    assert seen == [False]  # only the main thread holds Ctrl-C
