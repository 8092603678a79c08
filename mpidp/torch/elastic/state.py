"""Horovod's `horovod.torch.elastic.state` (code in mpidp/state/elastic.py)."""

from ...state.elastic import ObjectState, State, TorchState

__all__ = ["ObjectState", "State", "TorchState"]
