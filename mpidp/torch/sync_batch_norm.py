"""Horovod's `horovod.torch.sync_batch_norm`: batch norm over all ranks (sync_batch_norm.py)."""

from ..training.sync_batch_norm import SyncBatchNorm

__all__ = [
    "SyncBatchNorm",
]
