"""The world group's key-value store: served by rank 0, connected to only when a group needs it."""

import torch.distributed as dist

from ..errors import MpidpError
from ..runtime import world

# torch keeps the store on its C++ side only; a Python subclass whose Python object is gone
# loses its methods there ("Not implemented"), so the current world's store is held here (a
# new init_process_group replaces it; the groups of the old world are destroyed by then).
_kept: list = []


class DeferredStore(dist.Store):
    """A torch.distributed Store for `init_process_group("mpidp")`'s world: rank 0 serves a
    TCPStore from the start; another rank connects on its first use of the store. MPI needs no
    store, but torch hands the world's to every group made beside it (`new_group(backend=
    "gloo")`, an NCCL group) for their rendezvous: ranks that make none never connect. Where
    rank 0 could not serve one, every use raises that reason (init itself does not fail)."""

    def __init__(self, host: str, port: int, served=None, error: str = ""):
        super().__init__()
        self.host, self.port = host, port
        self._store = served
        self._error = error

    def _real(self):
        if self._store is None:
            if self._error:
                raise RuntimeError(
                    f"no store for a process group beside the mpidp world group: {self._error}"
                )
            from ..engine.backends.torchdist import STORE_TIMEOUT

            self._store = dist.TCPStore(self.host, self.port, None, False, STORE_TIMEOUT)
        return self._store

    # What torch's stores offer (the Python subclass is called through torch's trampoline).
    def set(self, key, value):
        return self._real().set(key, value)

    def get(self, key):
        return self._real().get(key)

    def add(self, key, amount):
        return self._real().add(key, amount)

    def compare_set(self, key, expected, desired):
        return self._real().compare_set(key, expected, desired)

    def delete_key(self, key):
        return self._real().delete_key(key)

    def num_keys(self):
        return self._real().num_keys()

    def check(self, keys):
        return self._real().check(keys)

    def wait(self, keys, timeout=None):
        real = self._real()
        return real.wait(keys) if timeout is None else real.wait(keys, timeout)

    def set_timeout(self, timeout):
        return self._real().set_timeout(timeout)

    def clone(self):
        """A store of its own on the same server (ProcessGroupGloo keeps one per group)."""
        return self._real().clone()


def world_store() -> DeferredStore:
    """The store for the world group being created by init_process_group (which calls this in
    place of its placeholder `Store()`). Starts mpidp if it is not started. Synchronization:
    collective over the world (an MPI broadcast of the address; mpidp.init() if it runs here).
    """
    if not world.is_initialized():
        world.init()
    # After init(): importing the engine's MPI module starts MPI (p2p._mpi says why).
    from ..engine.backends.torchdist import serve_store

    state = world.state()
    try:
        host, port, served = serve_store(state.comms, state.config, "the mpidp world's store")
        store = DeferredStore(host, port, served)
    except MpidpError as exc:  # every rank got it: groups beside this one cannot rendezvous
        store = DeferredStore("", 0, error=str(exc))
    _kept[:] = [store]
    return store
