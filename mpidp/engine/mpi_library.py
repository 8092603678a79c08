"""Facts about the MPI library file this process loaded, read without mpi4py: CUDA support."""

import ctypes
import os
from typing import Optional


def _libmpi_paths():
    """Paths of the MPI shared library this process has loaded (Linux: from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libmpi" in line}
    except OSError:
        return []
    return sorted(
        p
        for p in paths
        if os.path.basename(p).startswith("libmpi.so") or os.path.basename(p).startswith("libmpi_")
    )


def cuda_aware_support() -> Optional[bool]:
    """Whether the MPI library accepts CUDA device buffers; None when it cannot tell.

    Asks the library's MPIX_Query_cuda_support (MPICH >= 4, Open MPI >= 4 export it), which
    reports the run-time answer (MPICH: also off when MPIR_CVAR_ENABLE_GPU=0). mpi4py does not
    wrap it, and mpi4py loads libmpi privately, so the symbol is looked up in that library file.
    """
    for path in _libmpi_paths():
        try:
            lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | os.RTLD_LAZY)
            query = lib.MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        query.restype = ctypes.c_int
        query.argtypes = []
        return bool(query())
    return None
