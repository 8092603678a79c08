"""Whether the training layer starts reductions during the backward pass (the `overlap` knob)."""

import os

import torch


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
    where the backward pass already keeps every core busy, on one host or across hosts, over a
    fast link or a slow one: there the cores set the pace, and a reduction run beside the
    backward pass only slows both. On one host a reduction is memory copies by the CPU
    (BENCHMARKS.md, "Overlap round"); across hosts the network's own work costs CPU too, and
    at 2 hosts x 2 ranks on 2 cores reducing after the backward pass was as fast or faster at 1
    and at 10 Gbit/s ("Overlap across hosts without a spare core")."""
    setting = state.config.overlap
    if setting != "auto":
        return setting == "1"
    if any(p.device.type != "cpu" for p in params):
        return True
    return host_cores() / max(1, state.local_size) > torch.get_num_threads()
