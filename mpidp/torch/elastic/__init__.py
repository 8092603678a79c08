"""Horovod's `horovod.torch.elastic`: state, sampler, retry loop (code in state/elastic.py)."""

from ...state.elastic import ElasticSampler, ObjectState, State, TorchState, run

__all__ = [
    "ElasticSampler",
    "ObjectState",
    "run",
    "State",
    "TorchState",
]
