"""The devices the MPI tests run on: cpu always, cuda where torch sees a GPU and the path allows.

Tests that take the `device` fixture (conftest.py) run once per device. On a machine without a
GPU the cuda case is skipped with that reason; with one, each rank uses GPU local_rank % count.
Which engine path carries CUDA tensors follows MPIDP_BACKEND (docs/data_paths.md): the staged
paths (mpi without CUDA-aware MPI, gloo) and CUDA-aware MPI let ranks share one GPU, while NCCL
refuses two ranks on one device, so its cases skip unless each rank of the host has a GPU.
"""

import pytest
import torch

import mpidp

GPU = torch.cuda.is_available()
NO_GPU = "no GPU here: torch.cuda.is_available() is false"
DEVICE_PARAMS = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not GPU, reason=NO_GPU))]


def cuda_path() -> str:
    """The name of the engine's data path for CUDA tensors ('' when it has none)."""
    from mpidp.runtime import world

    return world.state().engine.backend.names.get("cuda", "")


def use_device(kind: str) -> torch.device:
    """This rank's torch.device of `kind`, made current; skips (the same way on every rank of a
    host) where the CUDA path cannot serve this many ranks per GPU."""
    if kind == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    local_size = mpidp.local_size()
    path = cuda_path()
    if not path:
        pytest.skip("the engine has no CUDA path (init() ran before the GPU was visible)")
    if path == "nccl" and count < local_size:
        pytest.skip(
            f"NCCL needs one GPU per rank: {local_size} ranks on this host share "
            f"{count} GPU(s); MPIDP_BACKEND=mpi or gloo tests the staged paths, which "
            f"can share one"
        )
    device = torch.device("cuda", mpidp.local_rank() % count)
    torch.cuda.set_device(device)
    return device
