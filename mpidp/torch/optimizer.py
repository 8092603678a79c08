"""Horovod's `horovod.torch.optimizer`: the distributed optimizer (code in mpidp/optimizer.py)."""

from mpidp.optimizer import DistributedOptimizer

__all__ = [
    "DistributedOptimizer",
]
