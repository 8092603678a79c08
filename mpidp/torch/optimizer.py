"""Horovod's `horovod.torch.optimizer`: the distributed optimizer (training/optimizer.py)."""

from ..training.optimizer import DistributedOptimizer

__all__ = [
    "DistributedOptimizer",
]
