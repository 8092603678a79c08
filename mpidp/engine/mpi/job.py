"""The job as MPI sees it: mpidp's communicators, the library's facts, ending every rank."""

import os
import sys
import time
from typing import Optional

from mpi4py import MPI

from ...errors import ConfigError
from ...log import logger


class Comms:
    """mpidp's private communicators: a duplicate of the user's, its local and cross splits.

    `local` holds the ranks of this node, `cross` the ranks with the same local rank on every
    node, `node_ordered` every rank numbered node by node (where allreduce runs). With
    `simulated_local_size=k > 0` a node is k consecutive ranks of COMM_WORLD
    (node id = world rank // k) instead of the ranks that share memory, so a process set sees
    the same simulated nodes as the world. When k does not divide the world size, the last node
    is smaller (a non-homogeneous layout, which hierarchical allreduce handles by falling back to
    the flat one). k larger than the world size is a ConfigError: it simulates nothing.
    Synchronization: collective over `base` (Dup, Split, allgather).
    """

    def __init__(self, base, simulated_local_size: int = 0):
        world_size = MPI.COMM_WORLD.Get_size()
        if simulated_local_size > world_size:
            raise ConfigError(
                f"MPIDP_SIMULATED_LOCAL_SIZE={simulated_local_size} is larger than the "
                f"{world_size} ranks of the job; use a value from 1 to {world_size}, or 0 to "
                f"ask MPI which ranks share a node"
            )
        self.world = base.Dup()
        self.rank = self.world.Get_rank()
        self.size = self.world.Get_size()
        if simulated_local_size > 0:
            node = MPI.COMM_WORLD.Get_rank() // simulated_local_size
            self.local = self.world.Split(color=node, key=self.rank)
        else:
            self.local = self.world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.cross = self.world.Split(color=self.local.Get_rank(), key=self.rank)
        # Negotiation traffic gets its own communicator so it never matches data collectives,
        # and wake-up messages (point to point) one more, so nothing else ever matches them.
        self.control = self.world.Dup()
        self.wake = self.world.Dup()
        # Point to point for users (torch.distributed's send/recv), from their own threads.
        self.p2p = self.world.Dup()
        # Each rank's node, named by the node's lowest rank, with the node's size and the
        # host's name (errors name it).
        first = self.local.allreduce(self.rank, op=MPI.MIN)
        nodes = self.world.allgather((first, self.local.Get_size(), MPI.Get_processor_name()))
        self.local_sizes = [size for _, size, _ in nodes]
        self.hosts = [host for _, _, host in nodes]
        # MPI's allreduce algorithms pair ranks by their numbers and trust the launcher to have
        # numbered a node's ranks next to each other (recursive halving keeps its big first
        # exchange between near ranks): with ranks dealt round-robin to the nodes (`-hosts
        # a:1,b:1 -n 4`, `--map-by node`, Slurm's cyclic distribution) that exchange crosses
        # the network and each node's link carries twice the bytes (64 MB at 1 Gbit/s, 2 nodes
        # x 2 ranks: 1086 ms against 685 for MPI's blocking call; BENCHMARKS.md). Allreduce's
        # result does not depend on who is which rank, so it runs on the ranks renumbered in
        # node order; a job already in that order keeps `world` itself.
        order = sorted(range(self.size), key=lambda r: (nodes[r][0], r))
        if order == list(range(self.size)):
            self.node_ordered = self.world
        else:
            self.node_ordered = self.world.Split(color=0, key=order.index(self.rank))
        # Marks this engine's wake-ups: a freed communicator's context id may come back in a
        # later Dup, with an old wake-up still queued for it, which must not reach a new engine.
        self.epoch = self.world.bcast(
            int.from_bytes(os.urandom(7), "little") if self.rank == 0 else None, root=0
        )

    @property
    def spans_hosts(self) -> bool:
        """The ranks are on more than one node (some traffic crosses the network)."""
        return self.local.Get_size() < self.size

    @property
    def homogeneous(self) -> bool:
        """Every node holds the same number of ranks of this communicator."""
        return len(set(self.local_sizes)) == 1

    def free(self) -> None:
        comms = [self.p2p, self.wake, self.control, self.cross, self.local, self.world]
        if self.node_ordered is not self.world:
            comms.insert(0, self.node_ordered)
        for comm in comms:
            if comm != MPI.COMM_NULL:
                comm.Free()


# ---- facts about the MPI library (for `doctor`; the file's own facts: mpi_library.py) ----


def world() -> Optional[tuple]:
    """(rank, size) in COMM_WORLD, or None once MPI is finalized."""
    if MPI.Is_finalized():
        return None
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def library_version() -> str:
    """The MPI library's own version string (MPI_Get_library_version), stripped."""
    return MPI.Get_library_version().strip()


def thread_level_name() -> str:
    """The thread level MPI was initialised with: single, funneled, serialized or multiple."""
    names = {
        MPI.THREAD_SINGLE: "single",
        MPI.THREAD_FUNNELED: "funneled",
        MPI.THREAD_SERIALIZED: "serialized",
        MPI.THREAD_MULTIPLE: "multiple",
    }
    level = MPI.Query_thread()
    return names.get(level, str(level))


def end_job(grace_s: float = 0.3) -> None:
    """End every rank of the job (MPI_Abort), after flushing this rank's output and giving the
    launcher `grace_s` to forward it. Does not return."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not stop the abort
            pass
    # The launcher forwards output through pipes it stops reading once it tears the job down:
    # give it a moment to pass the last lines on, or the job ends without saying why.
    time.sleep(grace_s)
    MPI.COMM_WORLD.Abort(1)
    os._exit(1)  # MPICH's Abort may return while the launcher ends the job: leave now


def abort_job(message: str) -> None:
    """Log `message` (critical), then end_job(): for failures that leave peers inside a
    collective. Does not return."""
    logger.critical(message)
    end_job()
