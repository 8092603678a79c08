"""`mpidp.checkpoint`, where users import it: save, save_sharded, load (state/checkpoint.py)."""

from .errors import CheckpointError, CheckpointNotFoundError
from .state.checkpoint import load, save, save_sharded

__all__ = ["CheckpointError", "CheckpointNotFoundError", "load", "save", "save_sharded"]
