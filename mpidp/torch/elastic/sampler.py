"""Horovod's `horovod.torch.elastic.sampler` (code in mpidp/state/elastic_sampler.py)."""

from ...state.elastic import ElasticSampler

__all__ = ["ElasticSampler"]
