"""Facts about the MPI library this process loaded: its CUDA support, and UCX's TCP segment."""

import ctypes
import os
from typing import Mapping, Optional

# The variables that choose MPICH's network module (ch4 netmod), in MPICH's order of precedence.
NETMOD_VARIABLES = ("MPICH_CH4_NETMOD", "MPIR_CVAR_CH4_NETMOD", "MPIR_PARAM_CH4_NETMOD")
# UCX's receive segment over TCP: the most bytes one MPI test reads from a socket (UCX's own
# default is 64 KiB). mpidp sets it to UCX_SEGMENT_DEFAULT before MPI starts unless it is set.
UCX_SEGMENT_VARIABLE = "UCX_TCP_RX_SEG_SIZE"
UCX_SEGMENT_DEFAULT = "2m"
_UCX_SEGMENT_OWN = 64 * 1024
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20}
_UNITS.update({"g": 1 << 30, "gb": 1 << 30})


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


def _memunits(text: str) -> Optional[int]:
    """UCX's memory units ("65536", "512k", "2mb", case-insensitive) in bytes; None if not one."""
    text = text.strip().lower()
    digits = len(text) - len(text.lstrip("0123456789"))
    unit = _UNITS.get(text[digits:])
    return None if digits == 0 or unit is None else int(text[:digits]) * unit


def ucx_tcp_segment(version: str, environ: Optional[Mapping[str, str]] = None) -> int:
    """The bytes UCX's TCP transport reads from a socket in one test of MPI (UCX_TCP_RX_SEG_SIZE,
    else UCX's 64 KiB), where UCX carries this MPI's traffic; 0 where it does not or cannot be
    told. `version`: MPI_Get_library_version's text. Only MPICH's ch4:ucx network module is
    recognized: its device line names ucx first (the default netmod) and no netmod variable
    chooses another. Open MPI, and MPICH over OFI, give 0."""
    env = os.environ if environ is None else environ
    device = next((ln for ln in version.splitlines() if ln.startswith("MPICH Device:")), "")
    netmods = device.split(":", 1)[-1].strip().removeprefix("ch4:").split()
    chosen = next((env[v].strip().lower() for v in NETMOD_VARIABLES if env.get(v)), None)
    if not netmods or (chosen or netmods[0]) != "ucx" or "ucx" not in netmods:
        return 0
    given = env.get(UCX_SEGMENT_VARIABLE)
    if given is None:
        return _UCX_SEGMENT_OWN
    return _memunits(given) or 0
