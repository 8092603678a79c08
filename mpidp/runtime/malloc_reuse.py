"""glibc's malloc told to keep freed memory for reuse (the `keep_freed_memory` knob)."""

import ctypes
import os
import platform

from ..log import logger

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MiB = 1024 * 1024
# Blocks below this come from the heap and are reused once freed; larger ones are still mapped
# and unmapped. glibc's default threshold adapts but never exceeds 32 MiB, so a training
# step's larger tensors (activations, optimizer temporaries) were mapped and page-faulted in
# again every step: Adam over ResNet-18's parameters took 39 ms instead of 17 (BENCHMARKS.md).
MMAP_THRESHOLD = 256 * MiB
# Free memory at the top of the heap beyond this is given back to the OS. glibc's default
# (twice the adaptive threshold) gave back, and so faulted in again, 18 MB per step in some
# rounds of the training benchmark.
TRIM_THRESHOLD = 512 * MiB
# Set by the user: then their settings stand.
_USER_VARIABLES = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)


def keep_freed_memory(env=None) -> bool:
    """Set glibc malloc's mmap and trim thresholds (MMAP_THRESHOLD, TRIM_THRESHOLD) for this
    process, unless it is not on glibc or the environment sets malloc's thresholds itself;
    returns whether they were set. Affects allocations from now on; no collective."""
    env = os.environ if env is None else env
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        logger.debug("keep_freed_memory: not glibc, malloc left as it is")
        return False
    if any(v in env for v in _USER_VARIABLES) or "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        logger.debug("keep_freed_memory: the environment sets malloc's thresholds; left as set")
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = (
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    )
    logger.debug("keep_freed_memory: malloc thresholds %s", "set" if done else "refused by mallopt")
    return done
