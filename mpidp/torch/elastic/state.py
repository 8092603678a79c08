"""Horovod's `horovod.torch.elastic.state` (code in mpidp/elastic.py)."""

from ...state.elastic import ObjectState, State, TorchState

__all__ = ["ObjectState", "State", "TorchState"]
