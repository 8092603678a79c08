"""16-bit floats reduced in their own width: the combine step of MPI's user-defined reductions.

MPI has no bfloat16, and MPICH's built-in float16 reduction is about 10x slower than float32's.
Widening to float32 before the collective doubles the bytes on the wire, which is exactly what
a user who turns on fp16 compression wants to avoid. So the host data path hands 16-bit floats
to MPI as 16-bit words with a user-defined op whose combine step is below: each pair of values
is added (or compared, multiplied) in float32 by torch's CPU kernels and rounded back to 16
bits, as Horovod's own float16 MPI reduction does. Measured (BENCHMARKS.md, "16-bit floats on
the wire"): faster than the float32 allreduce of the same elements on shared memory and on TCP.
"""

from typing import Any, Callable, Dict

import torch

from . import mpi
from .dtypes import HALF
from .messages import ReduceOp

_OPS: Dict[tuple, Any] = {}  # (dtype, ReduceOp) -> MPI user op, made on first use (after MPI_Init)


def _combine(fn: Callable, dtype: torch.dtype) -> Callable:
    def combine(inbuf, inoutbuf) -> None:
        # MPI hands raw memory; a zero-length call must not reach frombuffer (it refuses).
        if len(memoryview(inoutbuf).cast("B")):
            fn(torch.frombuffer(inoutbuf, dtype=dtype), torch.frombuffer(inbuf, dtype=dtype))

    return combine


def _min(acc, x):
    torch.minimum(acc, x, out=acc)


def _max(acc, x):
    torch.maximum(acc, x, out=acc)


_FNS = {
    ReduceOp.SUM: torch.Tensor.add_,
    ReduceOp.AVERAGE: torch.Tensor.add_,
    ReduceOp.MIN: _min,
    ReduceOp.MAX: _max,
    ReduceOp.PRODUCT: torch.Tensor.mul_,
}


def combiner(dtype: torch.dtype, reduce_op: int) -> Callable:
    """combine(inbuf, inoutbuf): inoutbuf <- inbuf (op) inoutbuf, elementwise over buffers of
    `dtype` values (Average adds: the division comes after the collective)."""
    return _combine(_FNS[ReduceOp(reduce_op)], dtype)


def mpi_reduce_op(dtype: torch.dtype, reduce_op: int):
    """The MPI op that reduces `dtype` values (16-bit floats as 16-bit words) per `reduce_op`:
    a user-defined op with the combiner above for 16-bit floats, MPI's own for the rest."""
    if dtype in HALF:
        op = _OPS.get((dtype, reduce_op))
        if op is None:
            op = _OPS[(dtype, reduce_op)] = mpi.user_op(combiner(dtype, reduce_op))
        return op
    return mpi.mpi_op(reduce_op, dtype == torch.bool)
