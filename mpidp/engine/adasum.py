"""Horovod's Adasum allreduce on host memory: vector halving, distance doubling, point to point.

adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b is a sum of orthogonal
vectors and an average of parallel ones. It is applied to each tensor on its own (the dot
products span the whole tensor, also when several tensors share one buffer) over a tree of
ranks: neighbours (0, 1), (2, 3), ... first, then pairs of pairs, the lower ranks' vector always
on the left. As in Horovod (horovod/common/ops/adasum/adasum.h) the tree runs as vector halving,
distance doubling:

- halving, at levels d = 1, 2, 4, ...: a rank sends half of its current segment to rank ^ d and
  receives the peer's copy of the other half, which it keeps (the rank without bit d the first
  half). Per tensor it computes a.b, |a|^2 and |b|^2 over its half; the 2d ranks that split the
  segment between them sum those (recursive doubling, so each of them holds the same sums) and
  each rank combines its half. After log2(p) levels each rank owns 1/p of the result.
- doubling: the levels in reverse; each rank swaps what it owns with rank ^ d.

Each element of the result is computed by one rank and copied to the others, so every rank
holds bitwise the same result. A rank sends about 2 (p - 1) / p times the vector, as in a ring
allreduce, plus 3 float64 per tensor and level; and log2(p) (log2(p) + 5) / 2 messages (the
dot sums are small, but each is one more round trip; a ring allreduce needs 2 (p - 1)).
Dot products and the combination are computed in float64 (16-bit and float32 values widened in
chunks), the result rounded once per level into the tensor's dtype, which is also the one on the
wire (16 bits for float16/bfloat16). A squared norm below 1e-8 counts as zero, whose coefficient
is 1, as in Horovod: a zero tensor, a joined rank's contribution, changes nothing.
The number of ranks must be a power of 2, as in Horovod (checked at submission by
op_args.resolve_op). Prescale before, postscale after, no division by the size.
Every data path routes Adasum here (HostBackend, which the gloo/NCCL and CUDA wrappers run
through); CUDA tensors are copied to host memory and back (ran on an H100, staged MPI, n=2).
"""

from typing import List

import numpy as np
import torch

from ..log import logger
from . import mpi, scaling

_TINY = 1e-8  # Horovod's floor for a squared norm: below it a tensor counts as zero
# Elements widened to float64 at a time: 512 KiB temporaries stay in cache (one level over half
# of ResNet-18's gradients, one thread: 25 ms, against 29 ms with 1 << 20 and 40 with 1 << 14).
_CHUNK = 1 << 16
# Two tags, so that a vector slice and a message of dot-product sums can never be matched up.
_DATA_TAG, _DOTS_TAG = 4150, 4151
_noted_cuda = False


def reduce_parts(
    backend, srcs: List[torch.Tensor], outs: List[torch.Tensor], req, threshold: int
) -> None:
    """outs[i] <- the Adasum of srcs[i], the parts of a batch in order (HostBackend's
    allreduce_batch collects them, a joined rank's zeros included), packed into buffers of at
    most `threshold` bytes (a larger part alone), each buffer one Adasum with per-tensor dot
    products. Synchronization: point to point with every rank of backend.comm, through
    reduce()."""
    group: List[int] = []
    nbytes = 0
    for i, t in enumerate(srcs):
        size = t.numel() * t.element_size()
        if group and nbytes + size > threshold:
            reduce(backend, [srcs[j] for j in group], [outs[j] for j in group], req)
            group, nbytes = [], 0
        group.append(i)
        nbytes += size
    if group:
        reduce(backend, [srcs[j] for j in group], [outs[j] for j in group], req)


def reduce(backend, srcs: List[torch.Tensor], outs: List[torch.Tensor], req) -> list:
    """outs[i] <- the Adasum over the ranks of srcs[i] (one dtype, contiguous), scaled as `req`
    says; returns `outs`. One tensor on the host is reduced in its output, several are packed.
    Synchronization: point to point with every rank of backend.comm (pairs, then groups of 4, 8,
    ...); the ranks must run the same reductions in the same order, as the engine's do."""
    size = backend.size
    if size & (size - 1):
        raise ValueError(f"Adasum needs a power-of-2 number of ranks, not {size}")
    alone = len(srcs) == 1 and outs[0].device.type == "cpu"
    if alone:
        buf = outs[0].view(-1)
        if outs[0] is not srcs[0]:
            buf.copy_(srcs[0].reshape(-1))
    else:
        if srcs[0].device.type != "cpu":
            _note_cuda()
        buf = torch.cat([s.reshape(-1) for s in srcs]).cpu()
    if req.prescale != 1.0:
        scaling.scale_(buf, req.prescale)
    mark = backend.timeline_mark
    if mark:
        mark("pack")
    backend._wire(buf.numel() * buf.element_size())
    busy = backend.busy
    counts = np.array([s.numel() for s in srcs], dtype=np.int64)
    _vhdd(backend, buf, counts, busy is None or busy())
    scaling.scale_after(buf, req, size)
    if mark:
        mark("mpi")
    if not alone:
        for out, part in zip(outs, buf.split(counts.tolist())):
            out.view(-1).copy_(part)
    return outs


def _note_cuda() -> None:
    global _noted_cuda
    if not _noted_cuda:
        _noted_cuda = True
        logger.info("Adasum runs on host memory: CUDA tensors are copied to the host and back")


def _bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous host slice, as MPI reads and writes them."""
    return t.view(torch.uint8).numpy()


def _vhdd(backend, buf: torch.Tensor, counts: np.ndarray, spin: bool) -> None:
    """buf <- the Adasum over the ranks of the tensors packed in it (counts[i] elements each)."""
    comm, rank, size = backend.comm, backend.rank, backend.size
    ends = np.cumsum(counts)
    starts = ends - counts
    n = buf.numel()
    received = torch.empty(n - n // 2, dtype=buf.dtype)  # the largest half this rank keeps
    lo, hi, level, path = 0, n, 1, []
    while level < size:
        mid = lo + (hi - lo) // 2
        left = not rank & level
        (klo, khi), (glo, ghi) = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
        theirs = received[: khi - klo]
        mpi.exchange(comm, _bytes(buf[glo:ghi]), _bytes(theirs), rank ^ level, _DATA_TAG, spin)
        spans = np.clip(starts, klo, khi) - klo, np.clip(ends, klo, khi) - klo
        _combine(backend, level, left, buf[klo:khi], theirs, spans, spin)
        path.append((lo, mid, hi))
        lo, hi = klo, khi
        level <<= 1
    while path:
        level >>= 1
        plo, mid, phi = path.pop()
        olo, ohi = (mid, phi) if not rank & level else (plo, mid)
        mpi.exchange(comm, _bytes(buf[lo:hi]), _bytes(buf[olo:ohi]), rank ^ level, _DATA_TAG, spin)
        lo, hi = plo, phi


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.to(torch.float64)


def _combine(
    backend, level: int, left: bool, mine: torch.Tensor, theirs: torch.Tensor, spans, spin: bool
) -> None:
    """mine <- adasum(a, b) on this rank's slice of both vectors, where a is the left vector
    (the lower ranks'): `mine` if `left`, else `theirs`. Tensor i spans [los[i], his[i]) of
    the slices; its dot products are summed over the 2 * level ranks holding its slices."""
    los, his = spans
    live = [(i, int(los[i]), int(his[i])) for i in np.flatnonzero(his > los)]
    sums = np.zeros((len(los), 3))  # per tensor: a.b, |a|^2, |b|^2 over this rank's slice
    for i, first, last in live:
        for lo in range(first, last, _CHUNK):
            hi = min(last, lo + _CHUNK)
            x, y = _wide(mine[lo:hi]), _wide(theirs[lo:hi])
            xy, xx, yy = float(x @ y), float(x @ x), float(y @ y)
            sums[i] += (xy, xx, yy) if left else (xy, yy, xx)
    sums = _group_sum(backend, level, sums, spin)
    ca, cb = _coefficient(sums[:, 0], sums[:, 1]), _coefficient(sums[:, 0], sums[:, 2])
    c_mine, c_theirs = (ca, cb) if left else (cb, ca)
    for i, first, last in live:
        for lo in range(first, last, _CHUNK):
            hi = min(last, lo + _CHUNK)
            x = mine[lo:hi]
            w = _wide(x)
            # Widened, scaled and added in float64, rounded once into the tensor's dtype
            # (for float64, `w` is the slice itself, updated in place).
            w.mul_(float(c_mine[i])).add_(_wide(theirs[lo:hi]), alpha=float(c_theirs[i]))
            if w is not x:
                x.copy_(w)


def _coefficient(dot: np.ndarray, norm2: np.ndarray) -> np.ndarray:
    """1 - a.b / (2 |v|^2) per tensor, or 1 where |v|^2 < 1e-8 (a zero vector, as in Horovod)."""
    big = norm2 >= _TINY
    return np.where(big, 1.0 - dot / np.where(big, norm2, 1.0) * 0.5, 1.0)


def _group_sum(backend, level: int, sums: np.ndarray, spin: bool) -> np.ndarray:
    """`sums` added up over the 2 * level ranks whose rank // (2 * level) is this rank's, by
    recursive doubling with rank ^ 1, rank ^ 2, ..., rank ^ level. Both partners of a step add
    the same two arrays (IEEE addition commutes), so every rank of the group ends with the same
    bits, and so with the same coefficients."""
    bit = 1
    while bit <= level:
        other = np.empty_like(sums)
        mpi.exchange(backend.comm, sums, other, backend.rank ^ bit, _DOTS_TAG, spin)
        sums = sums + other
        bit <<= 1
    return sums
