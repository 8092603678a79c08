"""The dtype table: which dtypes mpidp moves, their wire names and sizes, how each path sees them.

Requests carry a dtype's name (a string every rank can compare); the data paths look up here
how to hand each dtype to MPI or to a process group, so the rules live in one place:

- 16-bit floats reach MPI as 16-bit words (numpy lacks bfloat16; their reductions run a
  user-defined op, half.py); on device memory for CUDA-aware MPI they are reduced in float32.
- gloo and NCCL lack int16: reduced in int32, cast back with MPI's wrap-around; bool is
  reduced as uint8 (max = logical or, min = logical and); byte-moving ops move uint8 views.
"""

import torch

SUPPORTED = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
)
NAMES = {d: str(d).replace("torch.", "") for d in SUPPORTED}
BY_NAME = {name: d for d, name in NAMES.items()}
ITEMSIZE = {name: torch.empty((), dtype=d).element_size() for d, name in NAMES.items()}
HALF = (torch.float16, torch.bfloat16)

# How MPI sees a dtype whose numpy view would not do (numpy has no bfloat16).
MPI_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16}
# What gloo/NCCL reduce a dtype in, when not in itself.
GROUP_REDUCE = {torch.int16: torch.int32, torch.bool: torch.uint8}
BYTE = torch.uint8


def mpi_reduce_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype an MPI reduction of `dtype` values runs in: 16-bit floats keep their width on
    host memory; on device memory (CUDA-aware MPI) the Python combine step cannot read them, so
    they are reduced in float32."""
    if dtype in HALF and device.type != "cpu":
        return torch.float32
    return dtype
