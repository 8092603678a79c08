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
    """For a training layer over `params` (`state`: runtime.state(), for the knob and the
    ranks on this host). True: submit each bucket from the backward pass once its gradients
    are ready; False: submit them all when the step synchronizes. `auto` overlaps when the
    parameters are on a device (the host's cores are free for communication), when the ranks
    span hosts (the network moves the bytes, and the engine waits for it without spinning,
    engine/mpi.py allreduce), or when this rank's share of the host's cores is more than
    torch's intra-op threads. It does not overlap on one host whose cores the backward pass
    already keeps busy: there a reduction is memory copies by the CPU, and running it beside
    the backward pass only slows both down (BENCHMARKS.md, "Overlap round")."""
    setting = state.config.overlap
    if setting != "auto":
        return setting == "1"
    if any(p.device.type != "cpu" for p in params):
        return True
    if state.local_size < state.comms.size:
        return True
    return host_cores() / max(1, state.local_size) > torch.get_num_threads()
