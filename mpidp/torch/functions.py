"""Horovod's `horovod.torch.functions`: state broadcasts, object collectives (mpidp/functions.py)."""

from mpidp.functions import (allgather_object, broadcast_object,  # noqa: F401
                             broadcast_optimizer_state, broadcast_parameters)
