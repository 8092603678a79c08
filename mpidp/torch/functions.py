"""Horovod's `horovod.torch.functions`: state broadcasts, object collectives (ops/functions.py)."""

from ..ops.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)

__all__ = [
    "allgather_object",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
]
