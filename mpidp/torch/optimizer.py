"""Horovod's `horovod.torch.optimizer`: the distributed optimizer (code in mpidp/optimizer.py)."""

from ..training.optimizer import DistributedOptimizer

__all__ = [
    "DistributedOptimizer",
]
