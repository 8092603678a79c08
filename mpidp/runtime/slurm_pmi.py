"""Before MPI starts under `srun` across nodes: MPICH's OFI netmod, whose address fits PMI-1.

Slurm's mpi/pmi2 plugin serves MPICH's PMI-1 requests from one `read()` of 1024 bytes each
(src/plugins/mpi/pmi2/pmi1.c, handle_pmi1_cmd). MPICH 5 sends its UCX netmod's address padded to
4096 bytes (MPID_MAX_BC_SIZE: the bytes past the real address are whatever follows it in the heap),
hex-encoded in `cmd=put` segments of 511 bytes: up to 1078 characters a line. Whenever a segment
holds few zero bytes, slurmstepd reads the line in two, rejects both halves ("invalid client
request") and the job fails in MPI_Init or hangs there; which segments do is a matter of heap
contents (measured: 2 of 5 `srun --mpi=pmi2 -N 2` launches of examples/train.py). The OFI
netmod's address is a few dozen bytes (puts of 67 characters). So where that is the case, and
the MPI library is the `mpich` wheel (which carries both netmods) and nobody chose a netmod, the
OFI one is chosen. Hydra (`mpirun`, also inside an allocation) reads whole lines: left alone.
"""

import importlib.metadata
import os
import socket
import struct
from typing import MutableMapping, Optional

from ..engine.mpi_library import NETMOD_VARIABLES


def _pmi_server(fd: int) -> Optional[str]:
    """The command name of the process at the other end of the PMI socket `fd`, if it can be told.

    The socket pair is made by the PMI server (slurmstepd, or hydra's hydra_pmi_proxy) before it
    starts the task, so the peer's credentials name that server.
    """
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = struct.unpack("3i", creds)[0]
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except (OSError, struct.error):
        return None
    finally:
        sock.close()


def _wheel_has_ofi() -> bool:
    try:
        files = importlib.metadata.distribution("mpich").files or []
    except importlib.metadata.PackageNotFoundError:
        return False
    return any(f.name.startswith("libfabric.so") for f in files)


def choose_netmod(environ: Optional[MutableMapping[str, str]] = None) -> Optional[str]:
    """Set MPICH_CH4_NETMOD=ofi in `environ` (default os.environ) where srun's PMI-1 server
    would start MPICH on UCX across nodes (see the module docstring); return what was done, to be
    logged once MPI is up, or None where nothing was. Call before mpi4py.MPI is imported.
    Synchronization: none (each rank decides alone, from what its launch gave every rank alike)."""
    env = os.environ if environ is None else environ
    if any(env.get(v) for v in NETMOD_VARIABLES):
        return None
    fd = env.get("PMI_FD", "")
    nodes = env.get("SLURM_STEP_NUM_NODES", "")
    if not fd.isdigit() or not nodes.isdigit() or int(nodes) < 2:
        return None
    if _pmi_server(int(fd)) != "slurmstepd" or not _wheel_has_ofi():
        return None
    env["MPICH_CH4_NETMOD"] = "ofi"
    return (
        f"srun started this job over {nodes} nodes through Slurm's PMI-1 server, which cannot "
        "read the address MPICH's UCX netmod sends (lines over 1024 bytes, split at random): "
        "MPICH_CH4_NETMOD=ofi was set. Set MPICH_CH4_NETMOD=ucx to keep UCX, or launch with "
        "mpirun inside the allocation (docs/clusters.md)"
    )
