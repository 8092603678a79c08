"""Whether the training layer starts reductions during the backward pass (the `overlap` knob)."""

import os
from typing import Tuple

import torch


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def decide(state, params) -> Tuple[bool, bool]:
    """For a training layer over `params` (`state`: runtime.state(), for the knob, the ranks on
    this host and the engine's measure of the link). Returns (overlap, final). overlap True:
    submit each bucket from the backward pass once its gradients are ready; False: submit them
    all when the step synchronizes. `auto` overlaps when the parameters are on a device (the
    host's cores are free for communication), or when this rank's share of the host's cores is
    more than torch's intra-op threads, or when the ranks span hosts and the link is slow
    (engine/link.py): there the network sets the pace and the engine waits for it without
    holding the core. It does not overlap where the backward pass already keeps the cores busy
    and the cores, not a link, set the pace: on one host (a reduction there is memory copies by
    the CPU, and running it beside the backward pass only slows both; BENCHMARKS.md, "Overlap
    round"), and across a fast link (10 Gbit/s on 2 cores: 118-131 ms a ResNet-18 step after the
    backward pass, 133-145 overlapped; "The network wait's sleeps"). final is False while the
    answer waits for the link's measure, taken on the first large reductions: ask again after
    a step."""
    setting = state.config.overlap
    if setting != "auto":
        return setting == "1", True
    if any(p.device.type != "cpu" for p in params):
        return True, True
    if host_cores() / max(1, state.local_size) > torch.get_num_threads():
        return True, True
    if state.local_size < state.comms.size:
        slow = state.engine.backend.link_slow("cpu")
        return slow is not False, slow is not None
    return False, True
