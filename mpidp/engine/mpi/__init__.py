"""The engine's MPI module, its only code that touches mpi4py: communicators, waits, calls.

Callers use it as one module (`from . import mpi`; `mpi.allreduce(...)`): `job` holds mpidp's
communicators and ends the job, `waiting` how a thread waits for a request, `wakeups` the
messages that wake a peer's engine, `calls` the collectives and point-to-point calls.
"""

from .calls import (
    ANY_SOURCE,
    allgather,
    allgather_object,
    allgatherv,
    allreduce,
    allreduce_band,
    alltoall_counts,
    alltoallv,
    bcast,
    bcast_object,
    exchange,
    gather_objects,
    irecv,
    isend,
    mpi_op,
    new_status,
    reduce_scatter,
    reduce_scatter_block,
    user_op,
)
from .job import Comms, abort_job, end_job, library_version, thread_level_name, world
from .waiting import NETWORK_SLEEP_LONG_S, NETWORK_SLEEP_MAX_S, wait
from .wakeups import WakeBox

__all__ = [
    "ANY_SOURCE",
    "NETWORK_SLEEP_LONG_S",
    "NETWORK_SLEEP_MAX_S",
    "Comms",
    "WakeBox",
    "abort_job",
    "allgather",
    "allgather_object",
    "allgatherv",
    "allreduce",
    "allreduce_band",
    "alltoall_counts",
    "alltoallv",
    "bcast",
    "bcast_object",
    "end_job",
    "exchange",
    "gather_objects",
    "irecv",
    "isend",
    "library_version",
    "mpi_op",
    "new_status",
    "reduce_scatter",
    "reduce_scatter_block",
    "thread_level_name",
    "user_op",
    "wait",
    "world",
]
