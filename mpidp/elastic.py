"""`mpidp.elastic`, where users import it: State, ObjectState, TorchState, run, ElasticSampler."""

from .state.elastic import ElasticSampler, ObjectState, State, TorchState, run

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]
