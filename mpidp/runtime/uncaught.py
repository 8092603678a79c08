"""Uncaught exceptions: with abort_on_error, end every rank of the job; init() errors said once."""

import socket
import sys
import time
import traceback

from ..log import logger

_previous = None
_engines = None  # the world's engines at the abort (install_abort_hook)
_ABORT_GRACE_S = 0.3
_INTERRUPT_QUIET_S = 1.0  # how long rank 1 lets rank 0 report a Ctrl-C first
_INTERRUPT_STAGGER_S = 1.0  # how much longer each further rank waits, up to rank 1 + _STAGGERED
_STAGGERED = 3


def _abort_on_uncaught(exc_type, exc, tb) -> None:
    """sys.excepthook while abort_on_error is on: log who failed and why, then end every rank."""
    from ..engine import mpi

    world = mpi.world()
    if world is None or world[1] == 1:  # nobody else can be left waiting
        (_previous or sys.__excepthook__)(exc_type, exc, tb)
        return
    rank, size = world
    if issubclass(exc_type, KeyboardInterrupt):
        # Ctrl-C reaches every rank at once: a traceback per rank says nothing. The lowest rank
        # that can speaks in one line and ends the job before the next one's turn. Rank 0 may
        # not get to: its Ctrl-C is held while it waits in a cycle its peers have left, so each
        # rank waits longer than the one before it (a rank interrupted alone speaks in the end).
        if rank != 0:
            time.sleep(_INTERRUPT_QUIET_S + _INTERRUPT_STAGGER_S * min(rank - 1, _STAGGERED))
        logger.critical(
            "interrupted (KeyboardInterrupt) on rank %d (host %s); ending all %d ranks of the job",
            rank,
            socket.gethostname(),
            size,
        )
    else:
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        logger.critical(
            "uncaught %s on rank %d (host %s); aborting all %d ranks of the job "
            "(MPIDP_ABORT_ON_ERROR=0 turns this off):\n%s",
            exc_type.__name__,
            rank,
            socket.gethostname(),
            size,
            text.rstrip(),
        )
    previous = _previous
    if previous is not None and previous is not sys.__excepthook__:
        previous(exc_type, exc, tb)  # the user's own hook still runs; the default would repeat ours
    _close_timelines()
    # Without this, the other ranks would wait in their next collective for this one forever.
    mpi.end_job(_ABORT_GRACE_S)


def _close_timelines() -> None:
    """End this rank's timeline files as JSON (the abort skips shutdown(), which would), each
    between two of its engine's cycles."""
    for engine in _engines() if _engines is not None else ():
        if engine.timeline is not None and engine.cycle_lock.acquire(timeout=1.0):
            try:
                engine.timeline.close()
            except Exception:  # the abort matters more than the file
                pass
            finally:
                engine.cycle_lock.release()


def said_once(error: BaseException, rank: int) -> BaseException:
    """`error`, raised on every rank alike; if no one catches it, rank 0 alone reports it (one
    line, no traceback) instead of a traceback per rank. Returns it for `raise`."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if exc is not error:
            previous(exc_type, exc, tb)
            return
        if rank == 0:  # the message already names the ranks concerned
            sys.stderr.write(f"mpidp: init() failed on every rank: {exc_type.__name__}: {exc}\n")
            sys.stderr.flush()

    sys.excepthook = hook
    return error


def install_abort_hook(enabled: bool, engines=None) -> None:
    """Make the abort hook sys.excepthook (keeping the user's to call first), or take it away;
    `engines()` lists the engines whose timelines the abort closes."""
    global _previous, _engines
    _engines = engines
    if enabled and sys.excepthook is not _abort_on_uncaught:
        _previous = sys.excepthook
        sys.excepthook = _abort_on_uncaught
    elif not enabled and sys.excepthook is _abort_on_uncaught:
        sys.excepthook = _previous or sys.__excepthook__
