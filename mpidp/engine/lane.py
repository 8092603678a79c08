"""The express lane's plan: a repeated lone allreduce that one MPI call on host memory finishes."""

import time
from typing import Optional

import numpy as np
import torch

from . import band as layout
from . import dtypes, mpi, scaling
from .backends.host import HostBackend
from .messages import OpType, ReduceOp

# Dtypes whose numpy view MPI reduces as they are (16-bit floats need a user op, bool a
# logical one: the general path handles those).
_PLAIN = (torch.float32, torch.float64, torch.int32, torch.int64)


class Lane:
    """What Engine.express needs for one call signature, worked out once per signature: the
    band that carries the op's bit alone, and the MPI op and scale factor of a data path that
    is one MPI allreduce of the tensor as it is (flat MPI on host memory, one chunk, no dtype
    change, no prescale). `op` is None where the general data path must run the op.
    """

    __slots__ = ("backend", "op", "factor", "nbytes", "bit", "num_bits", "sent")

    def __init__(
        self, backend: Optional[HostBackend] = None, op=None, factor: float = 1.0, nbytes: int = 0
    ):
        self.backend = backend
        self.op = op
        self.factor = factor
        self.nbytes = nbytes
        self.bit = self.num_bits = -1  # what `sent` was made for
        self.sent = b""

    def band(self, bit: int, num_bits: int) -> bytes:
        """The band with `bit` alone set, AND-neutral elsewhere (no invalid bit, no flag)."""
        if bit != self.bit or num_bits != self.num_bits:
            self.bit, self.num_bits = bit, num_bits
            self.sent = bytes(layout.pack(layout.part_bytes(num_bits), 1 << bit, 0, 0))
        return self.sent

    def run(self, src: torch.Tensor, out: torch.Tensor, stats) -> None:
        """The allreduce of `src` into `out` (the same tensor: in place), scaled, counted in
        `stats` as execute() counts it. Synchronization: the allreduce with every rank."""
        began = time.monotonic()
        stats.begin_batch(began)
        recv = out.numpy()
        assert self.backend is not None  # run only where plan() found the host path (op set)
        # The caller waits for this result: MPI's blocking wait (a spin) is what busy() picks.
        mpi.allreduce(self.backend.reduce_comm, None if out is src else src.numpy(), recv, self.op)
        if self.factor != 1.0:
            # As scaling.scale_, at a numpy call's cost: floats multiply in their own type,
            # integers in float64 and are truncated toward zero on the way back.
            np.multiply(recv, self.factor, out=recv, casting="unsafe")
        stats.wire_bytes += self.nbytes
        stats.batch(OpType.ALLREDUCE, 1, self.nbytes, time.monotonic() - began)


def plan(route, req, t: torch.Tensor, size: int) -> Lane:
    """The Lane for allreduce request `req` of tensor `t` alone on data path `route`."""
    if (
        type(route) is not HostBackend
        or route.hierarchical
        or t.device.type != "cpu"
        or t.dtype not in _PLAIN
        or dtypes.NAMES[t.dtype] != req.dtype  # it travels cast (a narrower wire)
        or req.prescale != 1.0
        or req.reduce_op == ReduceOp.ADASUM
    ):
        return Lane()
    nbytes = t.numel() * t.element_size()
    if nbytes > route.chunk_bytes > 0:
        return Lane()
    if route.whole_in_pieces and nbytes > route.piece_bytes:
        return Lane()  # it goes in pieces, several MPI calls
    factor = scaling.after_factor(req.reduce_op, req.postscale, size)
    return Lane(route, mpi.mpi_op(req.reduce_op, False), factor, nbytes)
