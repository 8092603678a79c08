"""This rank's random number generator states (torch, numpy, random, CUDA) for checkpoints.

The states are built from types `torch.load(weights_only=True)` accepts.
"""

import random
from typing import Any, Dict, Tuple, cast

import numpy as np
import torch

from ..log import logger


def rng_state() -> Dict[str, Any]:
    """This rank's RNG states: torch CPU, numpy global, Python `random`, CUDA if available."""
    # The global generator is the legacy MT19937 one: its state is the legacy tuple.
    name, keys, pos, has_gauss, cached = cast(
        Tuple[str, np.ndarray, int, int, float], np.random.get_state()
    )
    version, internal, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore states made by `rng_state()` (CUDA's only where as many devices are visible)."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"].tolist()), p["gauss_next"]))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all(cuda)
        else:
            logger.warning(
                "checkpoint: saved %d CUDA RNG states but %d devices are visible; "
                "CUDA RNG states not restored",
                len(cuda),
                torch.cuda.device_count(),
            )
