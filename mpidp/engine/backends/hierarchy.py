"""Hierarchical allreduce: reduce-scatter inside a node, allreduce across nodes, allgather inside.

With the knob `hierarchical_allreduce` (and, unless it is set, for 16-bit floats: host.py says
why): reduce-scatter on `comms.local`, allreduce
of this rank's block on `comms.cross`, allgather on `comms.local`, over the largest prefix whose
length divides by the local size; the last n % local_size elements (fewer than one per local
rank) take one flat allreduce. Equal blocks allow the block collectives, which MPICH runs far
faster than their v-variants (mpi.allgather), and need no padded copy. It runs when
there is more than one node and more than one rank per node, and only on a homogeneous layout
(equal local sizes); otherwise allreduce stays flat (logged once at debug level).
"""

import numpy as np
import torch

from ...log import logger
from .. import mpi


def usable(comms, config) -> bool:
    """Whether the knob asks for it and the layout allows it (otherwise logged at debug)."""
    if not config.hierarchical_allreduce:
        return False
    why = _unfit(comms)
    if why:
        logger.debug("hierarchical allreduce off: %s; using the flat allreduce", why)
    return not why


def fits(comms) -> bool:
    """Whether the layout allows it: several nodes of several ranks each, as many on every
    node."""
    return not _unfit(comms)


def _unfit(comms) -> str:
    """Why the layout does not allow it ('' where it does)."""
    local, nodes = comms.local.Get_size(), comms.cross.Get_size()
    if not comms.homogeneous:
        return f"ranks per node differ ({comms.local_sizes})"
    if local == 1 or nodes == 1:
        return f"{nodes} node(s) of {local} rank(s) need no hierarchy"
    return ""


def allreduce(comms, send, recv, op, busy=None, network: float = 0.0, piece: int = 0) -> None:
    """Allreduce flat buffers (`send=None`: in place) over the node hierarchy.

    Synchronization: collectives on comms.local, comms.cross and comms.local again (and on
    comms.node_ordered for the tail). The cross-node allreduce, the part that waits on the network,
    is paced by `busy` and `network` and cut in `piece`s as mpi.allreduce says; the node's own
    parts are blocking.
    """
    local = comms.local
    lsize = local.Get_size()
    n = len(recv)
    main = n - n % lsize
    if main:
        block = main // lsize
        part = (
            recv.new_empty(block)
            if isinstance(recv, torch.Tensor)
            else np.empty(block, dtype=recv.dtype)
        )
        mpi.reduce_scatter_block(local, (recv if send is None else send)[:main], part, op)
        mpi.allreduce(comms.cross, None, part, op, busy, network, piece)
        mpi.allgather(local, part, recv[:main])
    if main < n:  # fewer than local_size elements left: one small flat allreduce
        mpi.allreduce(comms.node_ordered, None if send is None else send[main:], recv[main:], op)
