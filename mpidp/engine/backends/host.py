"""MPI data path: buffer calls on host (or CUDA-aware) memory, fusion, chunking.

Host tensors reach MPI as numpy views. On the CUDA-aware route (cuda.py wraps this backend
in StreamOrdered) a CUDA tensor is handed to MPI as itself (mpi4py reads
`__cuda_array_interface__`); since MPI is not stream-ordered, the engine thread's stream is
synchronized before MPI reads device memory.
That device branch has never run on a GPU (docs/data_paths.md).

Hierarchical allreduce: hierarchy.py. Adasum, whatever the data path: adasum.py.
"""

import math
from typing import Callable, List, Optional

import numpy as np
import torch

from .. import adasum, dtypes, fusion, half, link, mpi, mpi_library, scaling
from ..messages import OpType, ReduceOp, Response
from ..tensor_queue import Entry, given_output, into_output, is_block
from . import cast, hierarchy, parts

# Across hosts, a buffer that goes whole (a slow link: engine/link.py) and every 16-bit float
# buffer cross in pieces of this many bytes, all in flight at once (the flat allreduce, or the
# hierarchy's cross-node step). Over TCP, UCX sends a message above 2 MB by rendezvous, whose
# two directions sometimes run one after the other; pieces go eager. 16-bit floats (their
# user-defined op makes MPICH send whole buffers): at 1 Gbit/s, 2 hosts x 1 rank, 17 of 150 of
# the wide model's fp16 steps took 1.8x whole, none of 150 in 1 MiB pieces, and at 10 Gbit/s the
# steps took as long (BENCHMARKS.md, "16-bit floats across hosts in pieces"). float32 at
# 1 Gbit/s: a 50 MB allreduce took 423-551 ms whole and 423-451 ms in pieces at 2 hosts x 2
# ranks, 418-542 against 406-416 at 2 x 1 (BENCHMARKS.md, "Whole buffers across a slow link go
# in pieces"). On a fast link float32 goes in chunks, one at a time, as the cores set the pace.
_PIECE_BYTES = 1 << 20


def _np(t: torch.Tensor):
    """A flat buffer MPI can read that shares memory with `t`: a numpy view of a host tensor,
    the flat tensor itself (read through `__cuda_array_interface__`) for a CUDA one."""
    if t.requires_grad:
        t = t.detach()
    view = dtypes.MPI_VIEW.get(t.dtype)
    if view is not None:
        t = t.view(view)
    if t.is_cuda:
        # MPI is not ordered with CUDA streams: finish the kernels that wrote this memory.
        torch.cuda.current_stream(t.device).synchronize()
        return t if t.dim() == 1 else t.reshape(-1)
    return t.numpy().reshape(-1)  # numpy's reshape costs a fraction of torch's


def uneven_counts(n: int, parts: int) -> List[int]:
    """How `n` rows split over `parts` ranks: the first n % parts ranks get one extra row."""
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


class HostBackend:
    """Executes negotiated batches on host memory; every rank runs the same batches in order."""

    # Large allreduce parts of a plain host batch go to MPI as numpy views by allreduce_batch
    # itself; a subclass that reduces through something else than _reduce_flat says False.
    NUMPY_PARTS = True

    def __init__(self, comms, config):
        self.comms = comms
        self.comm = comms.world
        self.reduce_comm = comms.node_ordered  # allreduce's (job.Comms says why)
        self.size = comms.size
        self.rank = comms.rank
        self.config = config
        self._fusion = parts.FusionBuffers()
        self._planner = fusion.PartPlanner()
        self.hierarchical = hierarchy.usable(comms, config)
        # 16-bit floats reach MPI with a user-defined op (half.py), which MPICH's non-blocking
        # allreduce runs by recursive doubling, whole buffers each round: across nodes of
        # several ranks, each node's link then carries twice the bytes of a built-in op's
        # allreduce (no saving from the half width), and the hierarchy halves them (1 Gbit/s,
        # 2 nodes x 2 ranks: 0.48-0.52 of float32's time against 1.15-1.34; BENCHMARKS.md,
        # "16-bit floats across nodes"). So unless the knob is set, they take the hierarchy.
        self.hierarchical_half = self.hierarchical or (
            "hierarchical_allreduce" not in config.explicit and hierarchy.fits(comms)
        )
        self.network = comms.spans_hosts
        # What one MPI test reads from a socket, where UCX carries the traffic (0: not known).
        self.segment = mpi_library.ucx_tcp_segment(mpi.library_version()) if self.network else 0
        self.piece_bytes = _PIECE_BYTES  # across hosts (tests set it lower)
        # Chunks pay where a reduction is memory copies that fall out of cache; across a slow
        # link each chunk's collective leaves the link idle at its start and end. So across
        # hosts, unless the knob is set, the ranks measure the link here.
        self.chunk_bytes = config.chunk_bytes
        self._pace = link.LinkPace(
            self.reduce_comm,
            self.network and config.chunk_bytes > 0 and "chunk_bytes" not in config.explicit,
        )
        if self._pace.measure(config.chunk_bytes):
            self.chunk_bytes = 0
        self.timeline_mark = None  # set by the engine while a timeline records: mark(phase)
        self.busy = None  # set by the engine: busy() is true while a user thread waits
        self.stats = None  # set by the engine: its EngineStats (wire_bytes is counted here)

    def close(self) -> None:
        """Nothing to release: the communicators belong to Comms."""

    @property
    def whole_in_pieces(self) -> bool:
        """Whether a buffer that goes whole crosses as pieces of `piece_bytes`, all in flight:
        across hosts with no chunks (the slow link's verdict, or the knob at 0)."""
        return self.network and self.chunk_bytes <= 0

    @property
    def network_sleep(self) -> float:
        """mpi.allreduce's longest sleep between tests while no user thread waits: 0 on one host
        (it yields), across hosts what the link's pace allows (link.LinkPace.sleep_max)."""
        return self._pace.sleep_max(self.segment) if self.network else 0.0

    @property
    def link_slow(self) -> bool:
        """Whether the ranks span hosts over a link they measured slow (link.LinkPace)."""
        return bool(self._pace.slow)

    def _wire(self, nbytes: int) -> None:
        """Count `nbytes` of this rank's input handed to a collective, in the width it travels."""
        if self.stats is not None:
            self.stats.wire_bytes += nbytes

    def reduce_dtype(self, dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """The dtype a reduction of `dtype` values runs in (dtypes.mpi_reduce_dtype)."""
        return dtypes.mpi_reduce_dtype(dtype, device)

    # ---- allreduce ----

    def _scale_after(self, out: torch.Tensor, req) -> None:
        scaling.scale_after(out, req, self.size)

    def _reduce_flat(self, send: Optional[torch.Tensor], recv: torch.Tensor, req) -> None:
        """Allreduce a contiguous tensor into `recv` (in place when send is None), then scale it."""
        recv_np = _np(recv)
        self._reduce_np(
            None if send is None else _np(send),
            recv_np,
            recv,
            half.mpi_reduce_op(recv.dtype, req.reduce_op),
            scaling.after_factor(req.reduce_op, req.postscale, self.size),
            self.chunk_bytes // recv_np.itemsize,
        )

    def _reduce_np(self, send, recv, out: torch.Tensor, op, post: float, step: int) -> None:
        """Allreduce flat buffers (`send=None`: in place), hierarchically when enabled, in
        chunks of `step` elements, each chunk of `out` (the tensor `recv` views) multiplied by
        `post` right after its reduction, while it is still in cache: a separate scaling pass
        over a big tensor costs as much as a copy. Written with few calls: after a large
        reduction has flushed the caches, each call costs several times its warm price.

        Synchronization: blocking collectives on node_ordered, or on local, cross and local again.
        """
        if self.stats is not None:  # _wire(), inline
            self.stats.wire_bytes += recv.nbytes
        hierarchical = self.hierarchical or (self.hierarchical_half and out.dtype in dtypes.HALF)
        extra: tuple = ()  # mpi.allreduce's pieces
        call: Callable[..., None]
        if hierarchical:
            call, comm = hierarchy.allreduce, self.comms
        else:
            call, comm = mpi.allreduce, self.reduce_comm
        if self.whole_in_pieces or (self.network and out.dtype in dtypes.HALF):
            extra = (self.piece_bytes // recv.itemsize,)
        n = recv.size
        if step <= 0 or n <= step:
            call(comm, send, recv, op, self.busy, self.network_sleep, *extra)
            if post != 1.0:
                scaling.scale_(out, post)
            return
        if post != 1.0:
            out = out.view(-1)  # the chunks below are flat slices
        for lo in range(0, n, step):
            hi = lo + step
            call(
                comm,
                None if send is None else send[lo:hi],
                recv[lo:hi],
                op,
                self.busy,
                self.network_sleep,
                *extra,
            )
            if post != 1.0:
                scaling.scale_(out[lo:hi], post)

    def _allreduce_alone(self, src: torch.Tensor, out: torch.Tensor, req) -> None:
        """One tensor reduced on its own, in place when it can be (no copy at all). A tensor
        wider than the request's dtype (the wire's: ops.cast_allreduce_async_) travels cast."""
        wire = dtypes.BY_NAME[req.dtype]
        wide = self.reduce_dtype(wire, out.device)
        if wide is not src.dtype and self._casts_in_pieces(src, out):
            self._reduce_cast(src, out, req, wire)
        elif req.prescale == 1.0 and wide is src.dtype:
            self._reduce_flat(None if out is src else src, out, req)
        else:
            work = scaling.work_copy(src, wide, req)
            if self.timeline_mark:
                self.timeline_mark("pack")
            self._reduce_flat(None, work.view(-1), req)
            out.copy_(work)
        if self.timeline_mark:
            self.timeline_mark("mpi")

    def _casts_in_pieces(self, src: torch.Tensor, out: torch.Tensor) -> bool:
        """Whether _reduce_cast serves this pair: MPI on host memory over the flat allreduce
        (a process group's subclass and the hierarchy take the whole cast), contiguous tensors."""
        return (
            self.NUMPY_PARTS
            and src.device.type == "cpu"
            and not (self.hierarchical or self.hierarchical_half)
            and src.is_contiguous()
            and out.is_contiguous()
        )

    def _reduce_cast(self, src: torch.Tensor, out: torch.Tensor, req, wire: torch.dtype) -> None:
        """`src` reduced into `out` as `wire` values, cast piece by piece (cast.reduce) in the
        kept buffer of `wire`. Synchronization: the collectives of the chunks and pieces."""
        work = self._fusion.scratch(wire, src.device, src.numel())
        self._wire(work.numel() * work.element_size())
        post = scaling.after_factor(req.reduce_op, req.postscale, self.size)
        cast.reduce(
            self,
            src,
            out,
            _np(work),
            work,
            half.mpi_reduce_op(wire, req.reduce_op),
            req.prescale,
            post,
        )

    def allreduce_one(self, entry: Entry) -> list:
        """The result of an allreduce op of one tensor: execute()'s for a batch of that op alone
        (a blocking call's), with no plan to make. Synchronization: its collectives."""
        if entry.request.reduce_op == ReduceOp.ADASUM:  # every data path's Adasum: adasum.py
            return adasum.reduce(self, entry.tensor, entry.output, entry.request)
        self._allreduce_alone(entry.tensor[0], entry.output[0], entry.request)
        return entry.output

    def _allreduce_packed(
        self,
        group: fusion.PartGroup,
        srcs: List[torch.Tensor],
        outs: List[torch.Tensor],
        req,
        device,
    ) -> None:
        """The parts of `group` packed into the persistent fusion buffer, reduced as one."""
        idx = group.idx
        wire = dtypes.BY_NAME[req.dtype]
        flat, views = self._fusion.views(group, self.reduce_dtype(wire, device), device)
        torch._foreach_copy_(views, [srcs[i] for i in idx])  # casts to the reduced dtype too
        if req.prescale != 1.0:
            scaling.scale_(flat, req.prescale)
        if self.timeline_mark:
            self.timeline_mark("pack")
        self._reduce_flat(None, flat, req)
        if self.timeline_mark:
            self.timeline_mark("mpi")
        torch._foreach_copy_([outs[i] for i in idx], views)

    def allreduce_batch(
        self, batch: List[Response], entries: List[Optional[Entry]], fuse_below: int, threshold: int
    ) -> list:
        """Every part of every op of the batch: small parts packed (at most `threshold` bytes a
        buffer), large ones reduced in place; one result (the list of outputs) per op.
        A joined rank (entry None) reduces zeros of the agreed shapes."""
        req = batch[0].request
        device, srcs, outs, results = parts.gather(batch, entries)
        if req.reduce_op == ReduceOp.ADASUM:  # every data path's Adasum: adasum.py
            adasum.reduce_parts(self, srcs, outs, req, threshold)
            return results
        plain = (
            self.NUMPY_PARTS
            and req.prescale == 1.0
            and device.type == "cpu"
            and srcs[0].dtype not in dtypes.MPI_VIEW
            and srcs[0].dtype is dtypes.BY_NAME[req.dtype]  # no cast on the way
        )
        if plain:  # what each large part needs is the same for all: worked out once
            op = mpi.mpi_op(req.reduce_op, srcs[0].dtype == torch.bool)
            post = scaling.after_factor(req.reduce_op, req.postscale, self.size)
            step = self.chunk_bytes // srcs[0].element_size()
        for group in self._planner(batch, fuse_below, threshold):
            if group.packed and len(group.idx) > 1:
                self._allreduce_packed(group, srcs, outs, req, device)
            elif plain:
                for i in group.idx:
                    src, out = srcs[i], outs[i]
                    self._reduce_np(None if src is out else _np(src), _np(out), out, op, post, step)
                if self.timeline_mark:
                    self.timeline_mark("mpi")
            else:
                for i in group.idx:
                    self._allreduce_alone(srcs[i], outs[i], req)
        return results

    # ---- other collectives ----

    def allgather(self, resp: Response, entry: Entry):
        t = entry.tensor if entry.tensor.dim() > 0 else entry.tensor.reshape(1)
        row = math.prod(t.shape[1:])
        dims = resp.first_dims
        out = given_output(entry, dims)
        if out is None:
            out = t.new_empty((sum(dims),) + tuple(t.shape[1:]))
        if len(set(dims)) == 1:
            self._wire(t.numel() * t.element_size())
            mpi.allgather(self.comm, None if is_block(t, out, self.rank) else _np(t), _np(out))
            return out
        # Unequal blocks: pad to the largest and use Allgather, then compact. MPICH 5's
        # Allgatherv is far slower than the copy (BENCHMARKS.md: 1185 ms against 31-43 ms for
        # uneven 4 MiB per rank on 4 ranks), except when the padding would dwarf the data.
        most = max(dims)
        if most * len(dims) > 2 * sum(dims):
            counts = np.array(dims, dtype=np.int64) * row
            self._wire(t.numel() * t.element_size())
            mpi.allgatherv(self.comm, _np(t), _np(out), counts)
            return out
        padded = t.new_empty((most * len(dims),) + tuple(t.shape[1:]))
        mine = t.new_zeros((most,) + tuple(t.shape[1:]))
        mine[: t.shape[0]].copy_(t)
        self._wire(mine.numel() * mine.element_size())
        mpi.allgather(self.comm, _np(mine), _np(padded))
        torch.cat([padded[r * most : r * most + d] for r, d in enumerate(dims)], out=out)
        return out

    def broadcast(self, resp: Response, entry: Entry):
        out = entry.output
        if out is not entry.tensor and self.rank == resp.request.root:
            out.copy_(entry.tensor)
        self._wire(out.numel() * out.element_size())
        mpi.bcast(self.comm, _np(out), resp.request.root)
        return out

    def alltoall(self, resp: Response, entry: Entry):
        t = entry.tensor
        row = math.prod(t.shape[1:])
        splits = entry.extra
        if splits is None:
            splits = np.full(self.size, t.shape[0] // self.size, dtype=np.int32)
        recv_splits = mpi.alltoall_counts(self.comm, np.asarray(splits, dtype=np.int32))
        out = t.new_empty((int(recv_splits.sum()),) + tuple(t.shape[1:]))
        send = _np(t)[: int(np.sum(splits)) * row]
        self._wire(send.nbytes)
        mpi.alltoallv(
            self.comm,
            send,
            np.asarray(splits, np.int64) * row,
            _np(out),
            recv_splits.astype(np.int64) * row,
        )
        return out, torch.from_numpy(recv_splits.copy())

    def reducescatter(self, resp: Response, entry: Entry):
        req = resp.request
        t = entry.tensor
        dtype = t.dtype
        wide = self.reduce_dtype(dtype, t.device)
        dim0 = t.shape[0]
        rows = uneven_counts(dim0, self.size)
        row = math.prod(t.shape[1:])
        work = scaling.work_copy(t, wide, req)
        out = entry.output
        if out is None or wide is not dtype:
            out = torch.empty((rows[self.rank],) + tuple(t.shape[1:]), dtype=wide, device=t.device)
        op = half.mpi_reduce_op(wide, req.reduce_op)
        self._wire(work.numel() * work.element_size())
        mpi.reduce_scatter(self.comm, _np(work.contiguous()), _np(out), [r * row for r in rows], op)
        self._scale_after(out, req)
        return into_output(entry, out if wide is dtype else out.to(dtype))

    # ---- dispatch ----

    def execute(
        self,
        batch: List[Response],
        entries: List[Optional[Entry]],
        fuse_below: Optional[int] = None,
        threshold: Optional[int] = None,
    ) -> list:
        """Run one batch; returns one result per response (the op's value). `fuse_below` and
        `threshold` (the engine's current fusion knobs; default: the config's) group the
        parts of an allreduce. Synchronization: this batch's collectives."""
        resp = batch[0]
        if resp.op == OpType.ALLREDUCE:
            return self.allreduce_batch(
                batch,
                entries,
                self.config.fuse_below_bytes if fuse_below is None else fuse_below,
                self.config.fusion_threshold_bytes if threshold is None else threshold,
            )
        if resp.op == OpType.BARRIER:
            return [None]
        entry = entries[0]
        assert entry is not None  # the executor runs only an allreduce with no local entry
        if resp.op == OpType.ALLGATHER:
            return [self.allgather(resp, entry)]
        if resp.op == OpType.BROADCAST:
            return [self.broadcast(resp, entry)]
        if resp.op == OpType.ALLTOALL:
            return [self.alltoall(resp, entry)]
        if resp.op == OpType.REDUCESCATTER:
            return [self.reducescatter(resp, entry)]
        raise AssertionError(f"host backend cannot execute op {resp.op}")
