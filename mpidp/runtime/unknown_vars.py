"""Environment variables named like knobs that are not: said, with the closest knob."""

import difflib
import os
from typing import List, Mapping, Optional, Tuple

from ..config import KNOBS, SCRIPT_VARIABLES, STALL_CHECK_DISABLE

# Real Horovod settings with nothing to set here: never taken for a misspelled knob.
HOROVOD_ONLY = frozenset(
    (
        "HOROVOD_HIERARCHICAL_ALLGATHER",
        "HOROVOD_MPI_THREADS_DISABLE",
        "HOROVOD_CPU_OPERATIONS",
        "HOROVOD_GPU_OPERATIONS",
        "HOROVOD_CONTROLLER",
        "HOROVOD_NUM_NCCL_STREAMS",
        "HOROVOD_DISABLE_GROUP_FUSION",
    )
)


def unknown_variables(env: Optional[Mapping[str, str]] = None) -> List[Tuple[str, str]]:
    """(variable, what to say) for every MPIDP_* or HOROVOD_* variable that is not a knob:
    a misspelling is otherwise ignored without a word. Names the closest knob's variable."""
    env = os.environ if env is None else env
    # HOROVOD_DYNAMIC_PROCESS_SETS: sets may always be added after init() here.
    known = {v for k in KNOBS for v in (k.env, k.horovod) if v} | {
        STALL_CHECK_DISABLE,
        "HOROVOD_DYNAMIC_PROCESS_SETS",
    }
    out = []
    for var in sorted(env):
        if not var.startswith(("MPIDP_", "HOROVOD_")) or var in known or var in SCRIPT_VARIABLES:
            continue
        # Compared without the prefix, which would make every HOROVOD_* name look alike.
        prefix, rest = var.split("_", 1)
        score, _, close = max(
            (
                difflib.SequenceMatcher(None, rest, k.split("_", 1)[1]).ratio(),
                k.startswith(prefix),
                k,
            )
            for k in sorted(known)
        )
        if score >= 0.75 and var not in HOROVOD_ONLY:
            what = f"not an mpidp knob, and ignored; did you mean {close}?"
        elif var.startswith("HOROVOD_"):
            what = "a Horovod setting mpidp does not have; ignored"
        else:
            what = "not an mpidp knob, and ignored (`python -m mpidp doctor` lists the knobs)"
        out.append((var, what))
    return out
