"""Data paths behind one interface: `execute(batch, entries)` runs a negotiated batch.

Every backend has `execute(batch, entries, fuse_below=None, threshold=None) -> list` (one result
per response; entries[i] is None on a joined rank; the two limits group an allreduce's parts) and
`close()`; the wrappers in cuda.py hold the backend they wrap in `inner`.
`make_backend` builds a `Dispatch` that routes each batch by the device kind of its tensors
(fusion.plan never mixes device kinds in one batch; a rank runs its batches on its own device):

    MPIDP_BACKEND   CPU tensors                 CUDA tensors
    mpi             MPI on host memory          CUDA-aware MPI if cuda_aware_mpi says so,
                                                else MPI staged through pinned host buffers
    gloo            gloo process group          staged through host buffers to gloo
    nccl            MPI on host memory          NCCL process group
    auto            MPI on host memory          NCCL when torch has it, else as mpi

CUDA routes are built only when torch sees a GPU. See docs/data_paths.md.
"""

from typing import Dict, List, Optional

import torch

from ...errors import ConfigError, MpidpError


def built() -> Dict[str, bool]:
    """What torch brings: gloo/nccl built in, CUDA built and present. Touches no MPI, so the
    `*_built()` queries may run before init() (importing mpi4py.MPI would initialise MPI)."""
    import torch.distributed as dist

    dist_ok = dist.is_available()
    return {
        "gloo": bool(dist_ok and dist.is_gloo_available()),
        "nccl": bool(dist_ok and dist.is_nccl_available()),
        "cuda_built": bool(torch.backends.cuda.is_built()),
        "cuda_available": bool(torch.cuda.is_available()),
    }


def available() -> Dict[str, Optional[bool]]:
    """built(), and whether MPI accepts CUDA buffers (None: the library cannot tell). Local, no
    communication; needs MPI initialised."""
    from .. import mpi_library

    return dict(built(), cuda_aware_mpi=mpi_library.cuda_aware_support())


class _Shared:
    """An attribute of Dispatch that reads from the first innermost path and sets on all."""

    def __init__(self, attr: str):
        self.attr = attr

    def __get__(self, dispatch, owner=None):
        if dispatch is None:
            return self
        return getattr(next(dispatch._innermost(), None), self.attr, None)

    def __set__(self, dispatch, value) -> None:
        for backend in dispatch._innermost():
            setattr(backend, self.attr, value)


class Dispatch:
    """Routes each batch to the backend for its device kind ('cpu' or 'cuda')."""

    def __init__(self, routes: dict, names: dict):
        self.routes = routes  # device kind -> backend
        self.names = names  # device kind -> human-readable path name (logs, doctor)

    def _innermost(self):
        for backend in self.routes.values():
            while hasattr(backend, "inner"):
                backend = backend.inner
            yield backend

    # What the engine hands to every path underneath: its phase recorder (None: no timeline),
    # busy() (true while a user thread waits for a result), and its counters (wire bytes).
    timeline_mark = _Shared("timeline_mark")
    busy = _Shared("busy")
    stats = _Shared("stats")

    @property
    def link_slow(self) -> bool:
        """Whether a host path found the link between hosts slow (HostBackend.link_slow)."""
        return any(getattr(b, "link_slow", False) for b in self._innermost())

    def execute(self, batch: List, entries: List, *fusion_limits) -> list:
        """Run one batch on its device's path. Synchronization: that path's collectives."""
        kind = batch[0].request.device.split(":")[0] if batch[0].request else "cpu"
        backend = self.routes.get(kind)
        if backend is None:
            raise MpidpError(
                f"no data path for {kind} tensors in this process (paths: "
                f"{self.names}); see docs/data_paths.md"
            )
        return backend.execute(batch, entries, *fusion_limits)

    def group_store(self):
        """The store a path's process group was set up through (gloo or NCCL), or None where
        every path is MPI's: a process set's engine sets its own groups up through it."""
        for backend in self._innermost():
            store = getattr(backend, "store", None)
            if store is not None:
                return store
        return None

    def allreduce_one(self, entry) -> Optional[list]:
        """The result of an allreduce of one host tensor, alone in its batch, by the path's
        allreduce_one(); None where the path has none (CUDA wrappers): execute() then.
        Synchronization: its collectives."""
        backend = self.routes.get(entry.tensor[0].device.type)
        one = getattr(backend, "allreduce_one", None)
        return None if one is None else one(entry)

    def close(self) -> None:
        """Release process groups (local). Call once, after the engine's last batch."""
        # Wrappers (cuda.py) own nothing themselves; one path may serve several kinds.
        unique = {id(backend): backend for backend in self._innermost()}
        for backend in unique.values():
            backend.close()


def make_backend(comms, config, shared_store=None):
    """The data paths for one engine, chosen by the `backend` and `cuda_aware_mpi` knobs.
    `shared_store`: see torchdist.open_group (a process set's engine passes the world's).

    Synchronization: collective over `comms.world` when a process group is created (gloo;
    nccl when a GPU is present). Called by every rank of the communicator during init(),
    before the engine thread starts.
    """
    from .host import HostBackend

    avail = available() if config.backend != "mpi" else {}
    choice = config.backend
    gpu = torch.cuda.is_available()
    if choice == "gloo" and not avail["gloo"]:
        raise ConfigError("MPIDP_BACKEND=gloo: this torch was built without gloo")
    if choice == "nccl" and not (avail["nccl"] and gpu):
        raise ConfigError(
            "MPIDP_BACKEND=nccl needs a torch built with NCCL and a visible GPU "
            f"(nccl built: {avail['nccl']}, GPU: {gpu}); use mpi or gloo"
        )
    host = HostBackend(comms, config)
    routes, names = {"cpu": host}, {"cpu": "mpi"}
    gloo = None
    if choice == "gloo":
        from .torchdist import ProcessGroupBackend, open_group

        gloo = ProcessGroupBackend(comms, config, *open_group(comms, config, "gloo", shared_store))
        routes["cpu"], names["cpu"] = gloo, "gloo"
    if gpu:
        routes["cuda"], names["cuda"] = _cuda_route(
            comms, config, choice, avail, host, gloo, shared_store
        )
    return Dispatch(routes, names)


def _cuda_route(comms, config, choice, avail, host, gloo, shared_store):
    from . import cuda

    if choice == "gloo":
        return cuda.StagedBackend(gloo), "gloo (staged through host memory)"
    if choice == "nccl" or (choice == "auto" and avail.get("nccl")):
        from .torchdist import ProcessGroupBackend, open_group

        nccl = ProcessGroupBackend(comms, config, *open_group(comms, config, "nccl", shared_store))
        return cuda.StreamOrdered(nccl), "nccl"
    if cuda.cuda_aware_mpi(config.cuda_aware_mpi):
        return cuda.StreamOrdered(host), "mpi (CUDA-aware)"
    return cuda.StagedBackend(host), "mpi (staged through pinned host memory)"
