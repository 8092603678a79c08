"""Topology and capability queries: local and cross ranks, thread level, which data paths exist."""

from . import world


def local_rank() -> int:
    """Rank among the processes on this host (MPI shared-memory split, or simulated nodes)."""
    return world.state().local_rank


def local_size() -> int:
    """Number of ranks on this host."""
    return world.state().local_size


def cross_rank() -> int:
    """Index of this host among hosts (rank in the cross communicator)."""
    return world.state().cross_rank


def cross_size() -> int:
    """Number of hosts holding a rank with this local rank."""
    return world.state().cross_size


def is_homogeneous() -> bool:
    """True if every host runs the same number of ranks."""
    return world.state().homogeneous


def mpi_threads_supported() -> bool:
    """True if MPI runs at MPI_THREAD_MULTIPLE (the user may call MPI beside mpidp's engine)."""
    return world.state().thread_multiple


def _available() -> dict:
    from ..engine.backends import built

    return built()


def mpi_enabled() -> bool:
    """MPI always negotiates, and moves the data unless MPIDP_BACKEND picks gloo or nccl."""
    return True


def mpi_built() -> bool:
    """mpidp is built on MPI (mpi4py)."""
    return True


def gloo_built() -> bool:
    """This torch has gloo, so MPIDP_BACKEND=gloo can move host data through it."""
    return bool(_available()["gloo"])


def gloo_enabled() -> bool:
    """True when this init() moves host data through gloo (MPIDP_BACKEND=gloo)."""
    return world.state().config.backend == "gloo"


def nccl_built() -> bool:
    """This torch has NCCL (a CUDA build); never true on the CPU build."""
    return bool(_available()["nccl"])


def cuda_built() -> bool:
    """This torch was built with CUDA, so mpidp's CUDA paths can be used where a GPU exists."""
    return bool(_available()["cuda_built"])


def rocm_built() -> bool:
    """No ROCm path."""
    return False


def ddl_built() -> bool:
    """No IBM DDL path."""
    return False


def ccl_built() -> bool:
    """No oneCCL path."""
    return False
