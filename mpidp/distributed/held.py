"""A backward pass's async allreduces: held to its end where overlap does not pay; done there."""

import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.autograd import Variable

from .. import ops
from ..log import logger
from ..runtime import world
from ..training import overlap
from .work import Work

# A held call is submitted at the latest this long after it was held, should no end of the
# backward pass come to submit it: code that waits, inside the backward pass, on a future
# chained to a held call (`fut.then(f).wait()`) waits where no method of ours sees it. A late
# submission then, never a hang.
HOLD_LIMIT_S = 5.0


class _HeldWork(Work):
    """The work of a held call: its handle comes when the call is submitted; waiting for it
    submits every held call of the group first."""

    def __init__(self, held: "Held", finish, on_error):
        super().__init__([], finish, pending=True, on_error=on_error)
        self._held = held
        self.submit_error: Optional[BaseException] = None

    def _results(self) -> list:
        self._held.release()
        if self.submit_error is not None:
            raise self.submit_error
        return super()._results()


class Held:
    """A group's async allreduces called from inside the backward pass (DDP's buckets), held and
    submitted together when the pass ends, where the training layer's overlap rule
    (training/overlap.py, the `overlap` knob) says that reducing beside the backward pass does
    not pay: on a host whose cores the backward pass keeps busy, a reduction run beside it
    slows both (BENCHMARKS.md, "DDP over mpidp holds its buckets"). Elsewhere nothing is held.
    Across hosts, for host tensors, `auto` is settled as DistributedOptimizer settles it: by
    timing both modes (overlap.Trial), a step here being the time from the end of one backward
    pass that made calls to the end of the next (DDP makes them in every pass it reduces in).
    The core rule alone was the slower choice for DDP over mpidp at 1 Gbit/s on the test
    cluster (BENCHMARKS.md, "DDP over mpidp across hosts").

    Held calls are submitted, in the order they were called, by the first of: the end of the
    backward pass (an autograd final callback, queued with each held call, so that it runs
    before DDP's own, which waits on the buckets' futures), a wait() on one of their works, a
    call whose name one of them holds, or HOLD_LIMIT_S. Names are given at call time, so every
    rank names its calls alike whenever each submits them.

    At the end of the backward pass the same callback also completes, on the pass's thread,
    every call of the pass: the held ones and those submitted at once from it on host memory
    (track()). DDP's final callback, which runs next, only waits for their futures, a wait of
    torch's that the engine cannot see: it would go on pacing its waits for a thread that
    computes, with sleeps between tests, where across hosts MPI moves bytes only inside a test
    (BENCHMARKS.md, "DDP over mpidp across hosts"). Completed here, they are waited for as a
    blocking call waits, the thread driving the engine when it is idle.
    """

    def __init__(self, on_error: Callable[[BaseException], None], process_set=None, name=""):
        self._on_error = on_error
        self._process_set = process_set  # the group's, for the trial's one allreduce
        self._name = name  # that allreduce's
        self._lock = threading.Lock()
        self._calls: List[Tuple[str, Callable[[], int], _HeldWork]] = []
        self._running: List[Work] = []  # submitted from the backward pass in flight (track())
        self._overlap: Dict[str, bool] = {}  # device type -> the overlap rule's answer
        self._trial: Optional[overlap.Trial] = None  # `auto` timed, for host tensors

    def applies(self, tensor: torch.Tensor) -> bool:
        """Whether an async allreduce of `tensor` called now is held: overlap does not pay on
        its device, and the call comes from inside a backward pass (an autograd node runs:
        not from a final callback, where DDP's static graph reduces and then waits at once)."""
        device = tensor.device.type
        overlaps = self._overlap.get(device)
        if overlaps is None:
            state = world.state()
            overlaps = overlap.decide(state, [tensor])
            if device == "cpu":
                self._trial = overlap.trial(state, [tensor], self._process_set, self._name)
                if self._trial is not None:
                    overlaps = self._trial.mode
            self._overlap[device] = overlaps
        return not overlaps and torch._C._current_autograd_node() is not None

    def settled(self) -> bool:
        """Whether the overlap mode of calls from backward passes is fixed: by the knob or the
        core rule, or the timed trial is over. Synchronization: none."""
        return self._trial is None or self._trial.choice is not None

    def hold(self, name: str, submit: Callable[[], int], finish) -> Work:
        """Hold the call named `name` (`submit()` submits it and returns its handle); returns
        its work. Synchronization: none (a call of the same name held before is submitted and
        waited for, as CallNames waits for one in flight)."""
        with self._lock:
            earlier = next((w for n, _, w in self._calls if n == name), None)
        if earlier is not None:
            self.release()
            earlier.wait()
            work = Work([], finish, pending=True, on_error=self._on_error)
            work.attach([submit()])
            return work
        work = _HeldWork(self, finish, self._on_error)
        with self._lock:
            self._calls.append((name, submit, work))
            first = len(self._calls) == 1
        # One callback per held call, not one per pass: a pass that raised runs none of its
        # callbacks, and a flag saying "queued" would then outlive it.
        Variable._execution_engine.queue_callback(self._backward_ended)
        if first:
            _DEADLINES.arm(self)
        return work

    def track(self, work: Work, tensor: torch.Tensor) -> None:
        """`work`, of an async allreduce of `tensor` submitted at once (not held), is completed
        at the end of the backward pass it was called from, if it was called from one, on host
        memory. Synchronization: none."""
        if tensor.device.type != "cpu" or torch._C._current_autograd_node() is None:
            return
        with self._lock:
            self._running.append(work)
        Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        """The backward pass ended: submit every held call, then complete every call of the
        pass on this thread (the class docstring says why). Synchronization: the calls' ops,
        with every rank of the group."""
        with ops.blocking():  # this thread runs them: the engine thread is not woken
            works = self.release()
        with self._lock:
            running, self._running = self._running, []
        for work in running + works:
            work.complete()
        trial = self._trial
        if trial is not None and trial.choice is None and (running or works):
            self._overlap["cpu"] = trial.step_ended()

    def release(self, late: bool = False) -> List[Work]:
        """Submit every held call, in the order they were called; returns their works.
        Synchronization: none."""
        with self._lock:
            calls, self._calls = self._calls, []
        if not calls:
            return []
        _DEADLINES.disarm(self)
        if late:
            logger.warning(
                "%d torch.distributed allreduce(s) held for the end of a backward pass were "
                "submitted after %.1f s without it (a wait inside the backward pass on a future "
                "chained to one of them?); MPIDP_OVERLAP=1 submits them at once",
                len(calls),
                HOLD_LIMIT_S,
            )
        for _, submit, work in calls:
            try:
                work.attach([submit()])
            except BaseException as exc:  # noqa: BLE001  (its waiter raises it)
                work.submit_error = exc
                work.complete()
        return [work for _, _, work in calls]


class _Deadlines:
    """One thread that releases what was held longer than HOLD_LIMIT_S."""

    def __init__(self):
        self._cond = threading.Condition()
        self._due: Dict[Held, float] = {}
        self._thread: Optional[threading.Thread] = None

    def arm(self, held: Held) -> None:
        with self._cond:
            self._due[held] = time.monotonic() + HOLD_LIMIT_S
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="mpidp-dist-held", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def disarm(self, held: Held) -> None:
        with self._cond:
            self._due.pop(held, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                late = [h for h, due in self._due.items() if due <= now]
                for h in late:
                    del self._due[h]
                if not late:
                    self._cond.wait(min(self._due.values(), default=now + 60.0) - now)
                    continue
            for h in late:
                try:
                    h.release(late=True)
                except BaseException:  # noqa: BLE001  (never die: others may be held later)
                    logger.exception("releasing held torch.distributed calls failed")


_DEADLINES = _Deadlines()
