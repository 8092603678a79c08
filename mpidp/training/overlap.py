"""Whether the training layer starts reductions during the backward pass (the `overlap` knob)."""

import os
import statistics
import time
from typing import Dict, List, Optional, Tuple

import torch

from ..log import logger

# Steps timed in neither mode: the first ones of a trial allocate, and the one after each switch
# still carries the other mode's step() tail.
_FIRST_STEPS = 2
_SWITCH_STEPS = 1


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def decide(state, params) -> bool:
    """For a training layer over `params` (`state`: runtime.state(), for the knob and the ranks
    on this host): True to submit each bucket from the backward pass once its gradients are
    ready, False to submit them all when the step synchronizes. `auto` overlaps when the
    parameters are on a device (the host's cores are free for communication), or when this
    rank's share of the host's cores is more than torch's intra-op threads. It does not overlap
    where the backward pass already keeps every core busy: on one host a reduction is memory
    copies by the CPU, and run beside the backward pass it only slows both (BENCHMARKS.md,
    "Overlap round"). Across hosts a `Trial` (below) may replace this first answer."""
    setting = state.config.overlap
    if setting != "auto":
        return setting == "1"
    if any(p.device.type != "cpu" for p in params):
        return True
    return host_cores() / max(1, state.local_size) > torch.get_num_threads()


def trial(state, params) -> Optional["Trial"]:
    """A Trial where `auto` is to be settled by timing both modes: parameters on the CPU and
    ranks on several hosts (the `overlap_trial_steps` knob above 0). There the network, not
    the cores, may set the pace, and whether a reduction run beside the backward pass pays
    depends on the link's rate against the cores' (BENCHMARKS.md, "`auto` overlap by
    measure"); None elsewhere, where decide()'s answer stands."""
    steps = state.config.overlap_trial_steps
    if state.config.overlap != "auto" or steps == 0 or state.cross_size < 2:
        return None
    if any(p.device.type != "cpu" for p in params):
        return None
    return Trial(steps)


class Trial:
    """Times training steps (from one step() to the next) in blocks overlapped, not, not,
    overlapped (`steps` timed ones a block, after settling ones), so that a pace that drifts
    during the trial weighs on both modes alike, and keeps the mode whose median step was
    shorter. Each rank decides from its own clock: the ranks' steps end together (each waits
    for the others' gradients), so they agree but for ties, and a rank that overlaps beside
    one that does not reduces the same sums."""

    def __init__(self, steps: int):
        plan: List[Tuple[bool, bool]] = [(True, False)] * _FIRST_STEPS
        for mode, settle in ((True, 0), (False, _SWITCH_STEPS), (False, 0), (True, _SWITCH_STEPS)):
            plan += [(mode, False)] * settle + [(mode, True)] * steps
        self._plan = plan  # (mode, timed) of each step of the trial, in order
        self._times: Dict[bool, List[float]] = {True: [], False: []}
        self._index = 0  # the step now running
        self._last: Optional[float] = None
        self.choice: Optional[bool] = None  # set once the trial is over

    @property
    def mode(self) -> bool:
        """The mode of the step now running."""
        if self.choice is not None:
            return self.choice
        return self._plan[self._index][0]

    def step_ended(self, now: Optional[float] = None) -> bool:
        """Called at the end of each step(); returns the mode for the next step.
        Synchronization: none (this rank's clock alone)."""
        now = time.perf_counter() if now is None else now
        if self.choice is not None:
            return self.choice
        mode, timed = self._plan[self._index]
        if timed and self._last is not None:
            self._times[mode].append(now - self._last)
        self._last = now
        self._index += 1
        if self._index == len(self._plan):
            on, off = (statistics.median(self._times[m]) for m in (True, False))
            self.choice = on <= off
            logger.info(
                "overlap (auto): a step took %.1f ms overlapped and %.1f ms not (medians of "
                "%d); overlapping %s",
                on * 1e3,
                off * 1e3,
                len(self._times[True]),
                "on" if self.choice else "off",
            )
        return self.mode
