"""How torch.distributed finds mpidp: backend "mpidp", and "mpi" where torch has no MPI of its own.

These are torch's private or experimental hooks, pinned by tests/unit/test_torch_hooks.py:
- `Backend.register_backend(name, creator, extended_api=True, devices=...)`: the creator gets
  `_DistributedBackendOptions` (its `global_ranks_in_group`) and may return a ProcessGroup
  subclass, which torch then uses as the group itself.
- `distributed_c10d.ProcessGroupMPI` and `_MPI_AVAILABLE`: where torch was built without MPI the
  name is unbound and the flag False; init_process_group("mpi") calls
  `ProcessGroupMPI.create(global_ranks)` on the members of each group (the world's: []) and
  needs no store and no rank or world size (MPI knows them). Supplying that hook here makes
  "mpi", and "mpidp" through an alias to it, rendezvous over MPI.
- `distributed_c10d.Store`, which init_process_group calls (with no argument) for a placeholder
  store on that path, and then hands to every group made beside the world's: replaced by
  store.world_store, so that a gloo or NCCL group can rendezvous beside an mpidp world.
"""

from typing import List, Optional

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..log import logger
from ..runtime import world
from ..runtime.process_sets import add_member_process_set
from .group import ProcessGroupMpidp
from .store import world_store

NAME = "mpidp"
_installed = False
_torch_has_mpi = False


def torch_has_mpi() -> bool:
    """Whether this torch was built with MPI (then "mpi" stays torch's own backend)."""
    return _torch_has_mpi


def make_group(global_ranks: List[int]) -> Optional[ProcessGroupMpidp]:
    """The process group of `global_ranks` ([]: the world) for this rank, None if it is not a
    member. Starts mpidp (mpidp.init()) if it was not started. Synchronization: the world's
    ranks for the world's group (init's collectives, if mpidp starts here); the members for a
    subgroup (its communicator and engine)."""
    if not world.is_initialized():
        world.init()
    from ..engine import mpi  # after init(): importing it starts MPI (p2p._mpi says why)

    everyone = mpi.world()
    if everyone is not None and everyone[1] != world.size():
        raise RuntimeError(
            f"the mpidp torch.distributed backend needs mpidp's world to be "
            f"MPI's COMM_WORLD ({everyone[1]} ranks), but mpidp.init() was given "
            f"a communicator of {world.size()}; call mpidp.init() without comm="
        )
    ranks = sorted(int(r) for r in global_ranks)
    if not ranks:  # the world's group: mpidp's global set (a subgroup of all ranks gets its own)
        return ProcessGroupMpidp(world.rank(), world.size())
    if world.rank() not in ranks:
        return None
    process_set = add_member_process_set(ranks)
    return ProcessGroupMpidp(process_set.rank(), process_set.size(), process_set, ranks)


class _MpiHook:
    """Stands in for torch's ProcessGroupMPI where torch has none: init_process_group("mpi")
    and new_group() on an "mpi" world call create()."""

    @staticmethod
    def create(global_ranks) -> Optional[ProcessGroupMpidp]:
        return make_group(list(global_ranks))


def _plugin(backend_options, _group_options) -> Optional[ProcessGroupMpidp]:
    return make_group(list(backend_options.global_ranks_in_group))


def install() -> None:
    """Register backend "mpidp" with torch.distributed; where torch has no MPI, make "mpi" (and
    "mpidp", which then rendezvous over MPI too) create mpidp's groups. Idempotent."""
    global _installed, _torch_has_mpi
    if _installed:
        return
    _torch_has_mpi = (
        bool(getattr(c10d, "_MPI_AVAILABLE", False))
        and getattr(c10d, "ProcessGroupMPI", None) is not None
    )
    dist.Backend.register_backend(NAME, _plugin, extended_api=True, devices=["cpu", "cuda"])
    if not _torch_has_mpi:
        setattr(c10d, "ProcessGroupMPI", _MpiHook)
        c10d._MPI_AVAILABLE = True
        setattr(c10d, "Store", world_store)
        # Backend("mpidp") now reads "mpi": init_process_group takes MPI's path, with no
        # store and no MASTER_ADDR, RANK or WORLD_SIZE to set.
        setattr(dist.Backend, NAME.upper(), dist.Backend.MPI)
    else:
        logger.info(
            'this torch has its own MPI backend: "mpi" stays torch\'s; "mpidp" needs '
            "a rendezvous (init_method or MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE)"
        )
    _installed = True
