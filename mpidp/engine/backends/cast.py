"""A tensor reduced in a narrower dtype than it holds: cast piece by piece around the collectives.

Compression.fp16/bf16 send gradients as 16-bit floats. Cast whole before the collective and
back after it, the two casts are passes over every gradient on the step's path (a 50 MB
float32 bucket: about 5 ms each on this machine) while the link idles, and across hosts the
link is the reason for the cast. Here each piece (across hosts) or chunk is cast into the wire
buffer just before its collective starts and back into the tensor as soon as it is reduced,
so across hosts the casts run while the other pieces cross the link.
"""

import torch

from .. import mpi, scaling


def reduce(path, src: torch.Tensor, out: torch.Tensor, recv, work: torch.Tensor, op, pre, post):
    """`out` <- the allreduce of `src` (both flat-viewable host tensors) as the values of
    `work` (the wire buffer, at least as long; `recv` its MPI view) under MPI op `op`, scaled
    by `pre` before and `post` after in the wire's dtype, as for a tensor submitted in it.
    `path` (a HostBackend) gives the communicator, chunks, pieces and pacing: the collectives
    are the ones its allreduce runs for a tensor of the wire's dtype, because a joined rank,
    which has no tensor, reduces zeros of that dtype that way. Synchronization: the allreduce
    collectives of the chunks (and across hosts of the pieces in each) on `path.reduce_comm`."""
    n = src.numel()
    src_flat, out_flat = src.view(-1), out.view(-1)

    def fill(lo: int, hi: int) -> None:
        w = work[lo:hi]
        w.copy_(src_flat[lo:hi])
        if pre != 1.0:
            scaling.scale_(w, pre)

    def drain(lo: int, hi: int) -> None:
        w = work[lo:hi]
        if post != 1.0:
            scaling.scale_(w, post)
        out_flat[lo:hi].copy_(w)

    # Across hosts 16-bit floats always go in pieces (host.py's _PIECE_BYTES says why).
    piece = path.piece_bytes // recv.itemsize if path.network else 0
    step = path.chunk_bytes // recv.itemsize
    step = n if step <= 0 else step
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        if piece:
            mpi.allreduce(
                path.reduce_comm,
                None,
                recv[lo:hi],
                op,
                path.busy,
                path.network_sleep,
                piece,
                lambda a, b, lo=lo: fill(lo + a, lo + b),
                lambda a, b, lo=lo: drain(lo + a, lo + b),
            )
        else:
            fill(lo, hi)
            mpi.allreduce(path.reduce_comm, None, recv[lo:hi], op, path.busy, path.network_sleep)
            drain(lo, hi)
