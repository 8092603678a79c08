"""Sharded checkpoints: each rank writes its own optimizer shard; rank 0's file refers to them.

checkpoint.save_sharded(path, **state) stores every value that is sharded (a ShardedOptimizer)
as each member rank's own sharded_state_dict(), written by that rank, atomically, to
`<path>.shard-<rank>-of-<size>`; the value in `path` itself is a reference: the shard files'
names (relative to `path`'s directory) and a tag drawn for this save. Rank 0 writes `path` only
after every rank has written its shard, so `path` never refers to shards that are not there; the
tag makes a load refuse shard files left by another save. checkpoint.load reads every shard file
on every rank (they must be visible to every rank: a shared file system, or one host) and hands
the list to the target's load_state_dict, which reassembles it for its own world size.
"""

import os
import uuid
from typing import Any, Dict

import torch

from ..errors import CheckpointError
from ..ops import functions
from ..runtime import world
from ..sharded import state_forms

SHARD_FORMAT = "mpidp.checkpoint.shard/1"
_REFERENCE = "mpidp_shards"


class _Reference:
    """Stands in for a sharded value in the file rank 0 writes."""

    def __init__(self, state):
        self._state = state

    def state_dict(self):
        return self._state

    def load_state_dict(self, state):  # never called: only saved
        raise AssertionError("a shard reference is never loaded into")


def shard_name(path: str, rank: int, size: int) -> str:
    return f"{path}.shard-{rank}-of-{size}"


def write(path: str, state: Dict[str, Any], write_atomically, describe) -> Dict[str, Any]:
    """Write this rank's shards of the sharded values in `state`; return references to put in
    their place. Synchronization: a broadcast of the tag and an allgather of every rank's
    outcome (a failure on any rank raises CheckpointError on every rank)."""
    rank, size = world.rank(), world.size()
    tag = functions.broadcast_object(
        uuid.uuid4().hex if rank == 0 else None, 0, name="mpidp.checkpoint.save_sharded.tag"
    )
    mine = sorted(k for k, v in state.items() if getattr(v, "is_sharded", False))
    failure = None
    if mine:
        try:
            write_atomically(
                shard_name(path, rank, size),
                {
                    "format": SHARD_FORMAT,
                    "tag": tag,
                    "state": {k: state[k].sharded_state_dict() for k in mine},
                },
            )
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            failure = describe(exc)
    outcomes = functions.allgather_object(
        (mine, failure), name="mpidp.checkpoint.save_sharded.outcome"
    )
    bad = [(r, f) for r, (_, f) in enumerate(outcomes) if f is not None]
    if bad:
        raise CheckpointError(
            f"checkpoint.save_sharded({path!r}) failed: "
            + "; ".join(f"rank {r}: {f}" for r, f in bad)
            + f"; the previous checkpoint at {path!r}, if any, is unchanged"
        )
    base = os.path.basename(path)
    refs = {}
    for key in {k for keys, _ in outcomes for k in keys}:
        files = [
            os.path.basename(shard_name(base, r, size))
            for r, (keys, _) in enumerate(outcomes)
            if key in keys
        ]
        refs[key] = _Reference({_REFERENCE: files, "tag": tag})
    return refs


def resolve(path: str, key: str, value, target):
    """`value` as saved, or, for a reference to shard files, what `target` loads: the list of
    every rank's shard for a sharded target, the assembled per-parameter state for any other
    (a plain optimizer, a DistributedOptimizer). No collective: this rank reads every shard
    file itself."""
    if not (isinstance(value, dict) and _REFERENCE in value):
        return value
    directory = os.path.dirname(os.path.abspath(path))
    shards = []
    for name in value[_REFERENCE]:
        file = os.path.join(directory, name)
        try:
            data = torch.load(file, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise CheckpointError(
                f"{path!r} refers to the shard file {file!r}, which is "
                f"missing on rank {world.rank()}; sharded checkpoints "
                f"need a file system every rank sees"
            ) from None
        if (
            not isinstance(data, dict)
            or data.get("format") != SHARD_FORMAT
            or data.get("tag") != value["tag"]
        ):
            raise CheckpointError(
                f"shard file {file!r} does not belong to the checkpoint "
                f"{path!r} (another save wrote it)"
            )
        shards.append(data["state"][key])
    return shards if getattr(target, "is_sharded", False) else state_forms.assemble(shards)
