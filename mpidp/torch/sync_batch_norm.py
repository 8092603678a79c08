"""Horovod's `horovod.torch.sync_batch_norm`: batch norm over all ranks (training/)."""

from ..training.sync_batch_norm import SyncBatchNorm

__all__ = [
    "SyncBatchNorm",
]
