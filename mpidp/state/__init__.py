"""The state wing: checkpoints (whole and sharded), elastic-style state, per-rank RNG."""
