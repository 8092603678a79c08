"""Horovod's `horovod.torch.elastic.sampler` (code in mpidp/elastic_sampler.py)."""

from ...state.elastic import ElasticSampler

__all__ = ["ElasticSampler"]
