"""Whether the training layer starts reductions during the backward pass (the `overlap` knob)."""

import os
import statistics
import time
from typing import Dict, List, Optional, Tuple

import torch

from .. import ops
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


def trial(state, params, process_set=None, name: str = "") -> Optional["Trial"]:
    """A Trial where `auto` is to be settled by timing both modes: parameters on the CPU and
    ranks on several hosts (the `overlap_trial_steps` knob above 0). There the network, not
    the cores, may set the pace, and whether a reduction run beside the backward pass pays
    depends on the link's rate against the cores' (BENCHMARKS.md, "`auto` overlap by
    measure"); None elsewhere, where decide()'s answer stands. The ranks of `process_set`
    agree on the choice through one allreduce named `name` at the trial's last step."""
    steps = state.config.overlap_trial_steps
    if state.config.overlap != "auto" or steps == 0 or state.cross_size < 2:
        return None
    if any(p.device.type != "cpu" for p in params):
        return None
    return Trial(steps, _averaged(process_set, name))


def _averaged(process_set, name: str):
    """agree() for a Trial: both medians averaged over the ranks of `process_set`.
    Synchronization: one blocking allreduce with every rank of the set."""

    def agree(on: float, off: float) -> Tuple[float, float]:
        both = torch.tensor([on, off], dtype=torch.float64)
        both = ops.synchronize(ops.allreduce_async(both, name=name, process_set=process_set))
        return float(both[0]), float(both[1])

    return agree


class Trial:
    """Times training steps (from one step() to the next) in blocks overlapped, not, not,
    overlapped (`steps` timed ones a block, after settling ones), so that a pace that drifts
    during the trial weighs on both modes alike, and keeps the mode whose median step was
    shorter. Each rank times its own steps; with `agree` (trial() gives one) the ranks average
    their medians at the last step, so they keep the same mode even where the modes differ by
    less than the ranks' clocks. Without it (unit tests) each rank decides alone; a rank that
    overlaps beside one that does not still reduces the same sums."""

    def __init__(self, steps: int, agree=None):
        plan: List[Tuple[bool, bool]] = [(True, False)] * _FIRST_STEPS
        for mode, settle in ((True, 0), (False, _SWITCH_STEPS), (False, 0), (True, _SWITCH_STEPS)):
            plan += [(mode, False)] * settle + [(mode, True)] * steps
        self._plan = plan  # (mode, timed) of each step of the trial, in order
        self._times: Dict[bool, List[float]] = {True: [], False: []}
        self._index = 0  # the step now running
        self._last: Optional[float] = None
        self.choice: Optional[bool] = None  # set once the trial is over
        # (on, off) -> the same on every rank: without it, where the modes differ by less
        # than the ranks' clocks do, ranks kept different modes (10 Gbit/s, 2 x 1).
        self._agree = agree

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
            if self._agree is not None:
                on, off = self._agree(on, off)
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
