"""StepState: where one training step of a DistributedOptimizer stands, and how it moves on."""

import contextlib
import enum
from typing import Dict

import torch


class Phase(enum.Enum):
    """Where the gradients of the step stand."""

    IDLE = "idle"  # no gradient counted yet: the step has not begun
    ACCUMULATING = "accumulating"  # backward passes add gradients; full buckets may be out
    REDUCED = "reduced"  # the step's last backward pass ended with every gradient reduced


class StepState:
    """One optimizer's step: its phase, the backward passes counted (per parameter, and whole
    passes ended), the marks that outlive a phase (synchronize() ran; the double-synchronize
    warning was given) and the modes no_sync() and skip_synchronize(). Every transition is a
    method here; the buckets' own part of the step is cleared by `end`."""

    def __init__(self, passes_per_step: int = 1):
        self.passes_per_step = passes_per_step
        self.phase = Phase.IDLE
        self.passes: Dict[torch.nn.Parameter, int] = {}  # backward passes per parameter
        self.backwards = 0  # backward passes of this step that reached the parameters
        self.end_queued = False  # the running backward pass calls back at its end
        self.synchronized = False  # synchronize() reduced the gradients; step() has not run
        self.counting = True  # False inside no_sync(): passes accumulate uncounted
        self.should_sync = True  # False inside skip_synchronize(): step() does not reduce
        self._warned_double_sync = False

    def __repr__(self):
        return (
            f"StepState({self.phase.name}, {len(self.passes)} parameters counted, "
            f"{self.backwards} backward passes ended, synchronized={self.synchronized})"
        )

    def one_too_many(self, p) -> bool:
        """Whether a gradient for `p` now would be one pass too many for this step (none is
        once the step was reduced: a later pass begins the next)."""
        return (
            self.counting
            and self.phase is not Phase.REDUCED
            and self.passes.get(p, 0) >= self.passes_per_step
        )

    def count(self, p) -> int:
        """A backward pass gave `p` a gradient: how many it has this step."""
        n = self.passes[p] = self.passes.get(p, 0) + 1
        self.phase = Phase.ACCUMULATING
        return n

    def backward_ended(self) -> bool:
        """A backward pass that reached the parameters ended: whether it is the step's last,
        whose gradients are reduced now (then `reduced`)."""
        self.backwards += 1
        return self.phase is not Phase.REDUCED and self.backwards >= self.passes_per_step

    def reduced(self) -> None:
        """The step's gradients were reduced when its last backward pass ended."""
        self.phase = Phase.REDUCED

    def end(self, buckets) -> None:
        """The step's gradients are consumed (or dropped): every count zero, every bucket
        empty; the next step may start."""
        for bucket in buckets:
            bucket.clear()
        self.passes.clear()
        self.phase, self.end_queued, self.backwards = Phase.IDLE, False, 0

    def synchronize_done(self) -> None:
        """synchronize() reduced the gradients; step() comes next."""
        self.synchronized = True

    def stepped(self) -> None:
        """step() ran, or was skipped: the next step reduces its gradients anew."""
        self.synchronized = False

    def warn_double_sync(self, in_flight: bool) -> bool:
        """Whether step() must warn that it reduces a second time (once per optimizer)."""
        if self.synchronized and not in_flight and not self._warned_double_sync:
            self._warned_double_sync = True
            return True
        return False

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward passes accumulate gradients without counting or reducing."""
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside, step() does not synchronize."""
        self.should_sync = False
        try:
            yield
        finally:
            self.should_sync = True
