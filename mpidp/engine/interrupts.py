"""Ctrl-C while the main thread runs engine cycles: deferred to the end of the cycle in flight.

Python runs a SIGINT handler on the main thread between two bytecodes, and a blocking call on
the main thread runs engine cycles there (Engine.drive, Engine.express). A KeyboardInterrupt
raised in the middle of a cycle would leave the peers in a collective this rank never finishes,
and the engine broken on this rank, so a script that catches Ctrl-C (to save a checkpoint, say)
could neither go on nor let the others end. While the main thread drives the engine, the
handler installed by init() only notes the first SIGINT; the driving call raises it between
two cycles, with the engine whole, and the op it waited for stays with the engine thread. A
second SIGINT before that is raised at once (a way out when a peer never comes).
"""

import signal
import threading

try:
    # The handler as stored, without signal.getsignal's conversion of SIG_DFL/SIG_IGN to enum
    # members (two Python calls each): may_drive() asks for three on every blocking op.
    from _signal import getsignal as _stored_handler  # type: ignore[import-not-found]
except ImportError:  # not CPython
    _stored_handler = signal.getsignal

_MAIN = threading.main_thread().ident
_driving = False  # the main thread is running engine cycles
_pending = False  # a SIGINT arrived meanwhile, not raised yet
# What batch systems send before they end a job (Slurm: SIGTERM at scancel and preemption,
# SIGUSR1/2 with --signal), which scripts (Lightning among them) catch in Python.
_JOB_SIGNALS = tuple(
    getattr(signal, n) for n in ("SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, n)
)


def _on_sigint(signum, frame):
    global _pending
    if _driving and not _pending:
        _pending = True
        return
    _pending = False
    signal.default_int_handler(signum, frame)  # the handler ours replaced


def install() -> None:
    """Defer SIGINT during driven cycles, if this is the main thread and SIGINT still has
    Python's own handler (a script's handler is left alone)."""
    if (
        threading.get_ident() != _MAIN
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        return
    signal.signal(signal.SIGINT, _on_sigint)


def defer() -> bool:
    """This thread is about to run engine cycles: on the main thread, hold a first SIGINT.
    True if this call started holding (the main thread was not holding already)."""
    global _driving
    if threading.get_ident() != _MAIN or _driving:
        return False
    _driving = True
    return True


def pending() -> bool:
    """A SIGINT is held: the driving call should stop after the cycle in flight."""
    return _pending


def deliver() -> None:
    """This thread stops running engine cycles; raise the SIGINT held meanwhile, if any."""
    global _driving, _pending
    if threading.get_ident() != _MAIN:
        return
    _driving = False
    if _pending:
        _pending = False
        raise KeyboardInterrupt


def may_drive() -> bool:
    """Whether this thread may run engine cycles itself (Engine.express, Engine.drive). Not
    the main thread while a Python handler is installed for a signal a batch system sends:
    Python runs it on the main thread between two bytecodes, so a handler that raises
    (SystemExit, to end the rank cleanly) would leave the cycle, and the peers in its
    collective, half done. The engine thread runs the cycles then, and the main thread only
    waits, where such an exception ends the rank cleanly."""
    if threading.get_ident() != _MAIN:
        return True
    for signum in _JOB_SIGNALS:
        if callable(_stored_handler(signum)):
            return False
    return True
