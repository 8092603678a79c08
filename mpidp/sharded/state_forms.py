"""ShardedOptimizer's state: per-rank shards to torch's per-parameter form and back.

Two forms leave a ShardedOptimizer, both independent of the world size that wrote them:
- the full form, exactly what the wrapped torch optimizer's own state_dict() would hold
  ({"state": {index: {key: value}}, "param_groups": [...]}, indices over all of its parameters);
  it loads into the plain optimizer, a DistributedOptimizer, or a ShardedOptimizer of any size;
- the sharded form, one per rank (SHARDED_FORMAT): each parameter's piece this rank owns, as
  element ranges of the flattened parameter. All ranks' sharded forms together assemble into
  the full form, whatever the world size that loads them.
State whose tensors are shaped like the parameter is cut elementwise; scalar state (Adam's
step) is copied to every piece.
"""

from typing import Dict, List

import torch

SHARDED_FORMAT = "mpidp.sharded_optimizer/1"
# 0-dim state that is a counter, not an element: tells them apart when the parameter is 0-dim.
_SCALAR_KEYS = ("step", "eta", "mu")


def options(groups) -> List[dict]:
    """The param groups' hyper-parameters (everything but the parameters)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _is_flat(key: str, value, like_shape) -> bool:
    """Whether optimizer state `value` is elementwise for a tensor shaped `like_shape`."""
    if not isinstance(value, torch.Tensor):
        return False
    if value.dim() == 0 and (len(like_shape) != 0 or key in _SCALAR_KEYS):
        return False
    if tuple(value.shape) != tuple(like_shape):
        raise ValueError(
            f"ShardedOptimizer: optimizer state {key!r} has shape "
            f"{tuple(value.shape)}, neither a scalar nor the shape of its "
            f"parameter {tuple(like_shape)}; only optimizers whose state is "
            f"elementwise per parameter (SGD, Adam, AdamW, RMSprop, ...) can be "
            f"sharded. Use DistributedOptimizer for this one"
        )
    return True


def _copy(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _shard_state(opt, parts: List[torch.Tensor]) -> Dict:
    """The state of a shard that the wrapped optimizer holds as `parts` (consecutive 1-d
    pieces): elementwise state joined end to end, scalar state as the first part has it."""
    states = [opt.state.get(part, {}) for part in parts]
    out = {}
    for key, value in states[0].items():
        if _is_flat(key, value, parts[0].shape):
            out[key] = torch.cat([st[key].detach().reshape(-1) for st in states])
        else:
            out[key] = value
    return out


def local(opt, layouts, pieces_of, groups, world_size: int, rank: int) -> Dict:
    """This rank's sharded form (`pieces_of`: each bucket's shard as the wrapped optimizer's
    pieces). No collective."""
    pieces = {}
    for layout, parts in zip(layouts, pieces_of):
        state = _shard_state(opt, parts)
        for i, at_param, at_shard, n in layout.own_pieces():
            entry = {}
            for key, value in state.items():
                entry[key] = (
                    value[at_shard : at_shard + n].clone()
                    if _is_flat(key, value, (layout.chunk,))
                    else _copy(value)
                )
            pieces[layout.indices[i]] = {
                "range": [at_param, at_param + n],
                "shape": list(layout.params[i].shape),
                "state": entry,
            }
    return {
        "format": SHARDED_FORMAT,
        "world_size": world_size,
        "rank": rank,
        "param_groups": groups,
        "pieces": pieces,
    }


def assemble(parts: List[Dict]) -> Dict:
    """The full form from every rank's sharded form (any world size)."""
    parts = sorted(parts, key=lambda d: d["rank"])
    ranks = [d["rank"] for d in parts]
    if ranks != list(range(parts[0]["world_size"])):
        raise ValueError(
            f"ShardedOptimizer: the sharded state holds ranks {ranks} of "
            f"{parts[0]['world_size']}; every rank's shard is needed"
        )
    by_index: Dict[int, list] = {}
    for part in parts:
        for idx, piece in part["pieces"].items():
            by_index.setdefault(int(idx), []).append(piece)
    state = {}
    for idx in sorted(by_index):
        pieces = sorted(by_index[idx], key=lambda p: p["range"][0])
        shape = pieces[0]["shape"]
        numel = 1
        for d in shape:
            numel *= d
        if (
            pieces[0]["range"][0] != 0
            or pieces[-1]["range"][1] != numel
            or any(a["range"][1] != b["range"][0] for a, b in zip(pieces, pieces[1:]))
        ):
            raise ValueError(f"ShardedOptimizer: the shards of parameter {idx} do not cover it")
        keys = set(pieces[0]["state"])
        if not keys:
            continue
        if any(set(p["state"]) != keys for p in pieces):
            raise ValueError(
                f"ShardedOptimizer: the shards of parameter {idx} hold different state keys"
            )
        entry = {}
        for key in sorted(keys):
            first = pieces[0]["state"][key]
            # Pieces are 1-d and as long as their range; scalar state is kept as it was.
            if (
                isinstance(first, torch.Tensor)
                and first.dim() == 1
                and first.numel() == pieces[0]["range"][1] - pieces[0]["range"][0]
            ):
                entry[key] = torch.cat([p["state"][key] for p in pieces]).view(shape)
            else:
                entry[key] = first
        state[idx] = entry
    return {"state": state, "param_groups": parts[0]["param_groups"]}


def load_full(opt, layouts, pieces_of, full: Dict) -> None:
    """Put the full form's state into this rank's shards (`pieces_of`: each bucket's shard as
    the wrapped optimizer's pieces) and its hyper-parameters into the wrapped optimizer's
    groups. No collective."""
    saved, groups = full.get("param_groups"), opt.param_groups
    if not isinstance(saved, list) or len(saved) != len(groups):
        raise ValueError(
            f"ShardedOptimizer.load_state_dict: the state has "
            f"{len(saved) if isinstance(saved, list) else 'no'} parameter groups, "
            f"the optimizer {len(groups)}"
        )
    states = {int(k): v for k, v in full.get("state", {}).items()}
    for layout, parts in zip(layouts, pieces_of):
        keys: Dict[str, bool] = {}
        scalars: Dict[str, set] = {}
        own = layout.own_pieces()
        for i, _, _, _ in own:
            for key, value in states.get(layout.indices[i], {}).items():
                flat = _is_flat(key, value, layout.params[i].shape)
                keys[key] = flat
                if not flat:
                    value = value.item() if isinstance(value, torch.Tensor) else value
                    scalars.setdefault(key, set()).add(value)
        mixed = {k: sorted(v) for k, v in scalars.items() if len(v) > 1}
        if mixed:
            raise ValueError(
                f"ShardedOptimizer.load_state_dict: parameters that share a shard "
                f"have different {mixed}; they cannot be stepped as one"
            )
        new: List[Dict[str, object]] = [{} for _ in parts]
        sizes = [part.numel() for part in parts]
        for key, flat in keys.items():
            if not flat:
                first = next(
                    states[layout.indices[i]][key]
                    for i, _, _, _ in own
                    if key in states.get(layout.indices[i], {})
                )
                for entry in new:
                    entry[key] = _copy(first)
                continue
            buf = parts[0].new_zeros(sum(sizes))
            for i, at_param, at_shard, n in own:
                value = states.get(layout.indices[i], {}).get(key)
                if value is not None:
                    buf[at_shard : at_shard + n].copy_(value.reshape(-1)[at_param : at_param + n])
            for entry, piece in zip(new, buf.split(sizes)):
                entry[key] = piece.clone()
        for part, entry in zip(parts, new):
            opt.state.pop(part, None)
            if entry:
                opt.state[part] = entry
    for group, options_of in zip(groups, saved):
        for key, value in options_of.items():
            if key != "params":
                group[key] = value
