"""Before MPI starts: UCX's TCP receive segment, so that a wait sleeping between tests feeds a link.

MPICH's UCX netmod moves bytes over TCP only inside MPI's tests, and each test reads at most one
receive segment from a socket: 64 KiB by UCX's default. A wait that sleeps between tests (the
engine's, while a backward pass has the core) then caps the link's rate at a segment per sleep:
at 10 Gbit/s a 23 MB allreduce in 1 MiB pieces took 90 ms sleeping at most 30 us against 39
spinning, and at 1 Gbit/s 1 ms sleeps ran the link at 0.37 of its rate. With 2 MiB segments the
same waits took 41 and 192 ms (the spin's 40 and 190), and at 1 Gbit/s 1 ms sleeps used half
the CPU of 30 us ones, 40 against 77 ms (benchmarks/sleep_wait.py; BENCHMARKS.md, "A wait that
sleeps, and UCX's TCP segment"). Set only where the user has not, and only before MPI starts.
"""

import os
from typing import MutableMapping, Optional

from ..engine.mpi_library import UCX_SEGMENT_DEFAULT, UCX_SEGMENT_VARIABLE


def prepare(environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """Set UCX_TCP_RX_SEG_SIZE to 2 MiB in `environ` (default os.environ) unless it is set;
    whether it was set here. Call before mpi4py.MPI is imported (UCX reads it when MPI starts).
    Synchronization: none (every rank decides alike, from the launch's environment)."""
    env = os.environ if environ is None else environ
    if UCX_SEGMENT_VARIABLE in env:
        return False
    env[UCX_SEGMENT_VARIABLE] = UCX_SEGMENT_DEFAULT
    return True
