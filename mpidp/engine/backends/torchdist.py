"""torch.distributed data path: one gloo or NCCL process group per Comms, bootstrapped over MPI.

Bootstrap (`open_group`, collective over `comms.world`, on the user thread inside init()):
rank 0 of the communicator starts a TCPStore on a free port (port 0: the OS picks one, so
several engines in one process never collide) and broadcasts (host, port) over MPI; the other
ranks connect, and every rank constructs the backend object (`ProcessGroupGloo` /
`ProcessGroupNCCL`) directly on a PrefixStore. Nothing touches torch.distributed's global default
group, so user code may run its own `init_process_group` beside mpidp, and each process set gets
its own group, set up through the world's store under a prefix of its own. A TCPStore, not a
FileStore: it needs no file system shared by all nodes. The host announced is the
`rendezvous_host` knob, or rank 0's host name.

Execution (`ProcessGroupBackend`): negotiation stays on MPI; only tensor data moves through the
group. Results equal the MPI host path's exactly wherever that one is exact, because the
semantics are shared with HostBackend (subclassed): joined ranks add zeros, prescale before and
Average/postscale after the reduction, integers scaled as Horovod does (times the double
factor, truncated). float16/bfloat16 are reduced in their own width, as gloo and NCCL do it
natively (gloo here: float16 0.8-1.1x, bfloat16 0.6-0.9x the time of float32 for 4-64 MB,
where widening took 1.15-1.3x; BENCHMARKS.md). Type mapping for reductions: bool is
reduced as uint8 with MAX (logical or: Sum, Average, Max) or MIN (logical and: Min, Product), as
the MPI path does; int16 (which gloo and NCCL lack) in int32, cast back with the same wrap-
around. Byte-moving collectives (allgather, broadcast, alltoall) move uint8 views, so every
dtype works. Allgather with different first dims pads each rank's rows to the largest and trims;
alltoall exchanges split counts over MPI (host integers) and moves the rows with
`alltoall_base`; reducescatter passes the uneven per-rank chunks (first dim0 % size ranks get
one extra row) as a list. With gloo all of this runs on CPU and is tested; with NCCL the same
code ran on CUDA tensors at one rank on an H100 (2026-11-27), never between several ranks."""

import datetime
import math
import socket
import uuid
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ...errors import MpidpError
from ...log import logger
from .. import dtypes, mpi, scaling
from ..messages import ReduceOp, Response
from ..tensor_queue import Entry, given_output, into_output, is_block
from .host import HostBackend, uneven_counts

STORE_TIMEOUT = datetime.timedelta(seconds=300)
_BYTE = dtypes.BYTE


def _pg_op(reduce_op: int, is_bool: bool):
    op = ReduceOp(reduce_op)
    if is_bool:
        if op == ReduceOp.BXOR:
            return dist.ReduceOp.BXOR  # on 0/1 bytes: logical xor
        return (
            dist.ReduceOp.MIN
            if op in (ReduceOp.MIN, ReduceOp.PRODUCT, ReduceOp.BAND)
            else dist.ReduceOp.MAX
        )
    return {
        ReduceOp.SUM: dist.ReduceOp.SUM,
        ReduceOp.AVERAGE: dist.ReduceOp.SUM,
        ReduceOp.MIN: dist.ReduceOp.MIN,
        ReduceOp.MAX: dist.ReduceOp.MAX,
        ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
        ReduceOp.BAND: dist.ReduceOp.BAND,
        ReduceOp.BOR: dist.ReduceOp.BOR,
        ReduceOp.BXOR: dist.ReduceOp.BXOR,
    }[op]


def _rows_as_bytes(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A (rows, row_bytes) uint8 view of a contiguous tensor with `rows` rows."""
    row = math.prod(t.shape[1:]) if t.dim() > 0 else 1
    # Flat first: a contiguous tensor may still carry any stride on a dimension of size 1 (an
    # (n, 1) transpose does), and a dtype view needs stride 1 on the last dimension.
    return t.reshape(-1).view(_BYTE).reshape(rows, row * t.element_size())


def serve_store(comms, config, what: str):
    """Rank 0 of `comms` serves a TCPStore on a free port of the `rendezvous_host` knob's host
    (or its own name) and every rank learns (host, port, rank 0's store or None). Raises
    MpidpError on every rank, naming `what` the store is for, if rank 0 could not serve one.

    Synchronization: collective over `comms.world` (an MPI broadcast of the address); nothing
    connects yet.
    """
    store = None
    announce = None
    if comms.rank == 0:
        host = config.rendezvous_host or socket.gethostname()
        try:
            # A name that does not resolve leaves the others retrying to connect for minutes.
            socket.getaddrinfo(host, None)
            store = dist.TCPStore(host, 0, comms.size, True, STORE_TIMEOUT, wait_for_workers=False)
            announce = (host, store.port, "")
        except Exception as exc:  # every rank must learn of it, or they wait for the store
            announce = (host, 0, f"rank 0 could not start a TCPStore on {host!r}: {exc}")
    host, port, error = mpi.bcast_object(comms.world, announce, 0)
    if error:
        raise MpidpError(
            f"{what}: {error}; set MPIDP_RENDEZVOUS_HOST to an address of rank 0 that every "
            f"rank can reach"
        )
    return host, port, store


def open_group(comms, config, kind: str, shared_store=None):
    """Create this communicator's `kind` ('gloo' or 'nccl') process group; returns (group, store).

    `shared_store`: a store every rank of `comms` already holds a client of (the world's, for a
    process set's group): the group's keys go under a prefix of their own in it, and no new
    connection is made. Each TCPStore connection costs a reverse lookup of its address inside
    torch (for its log lines), which, where no name server answers, waits 5 s now and then
    (every 25th connection of a process here): one in every few process sets under gloo.

    Synchronization: collective over `comms.world` (an MPI broadcast of the store address, or
    of the prefix, then the process group's own connection set-up through the store).
    """
    if kind not in ("gloo", "nccl"):
        raise ValueError(f"no process group kind {kind!r}")
    if shared_store is not None:
        token = mpi.bcast_object(comms.world, uuid.uuid4().hex if comms.rank == 0 else None, 0)
        store, prefix = shared_store, f"mpidp/{kind}/{token}"
    else:
        host, port, store = serve_store(comms, config, f"{kind} process group")
        if store is None:
            store = dist.TCPStore(host, port, comms.size, False, STORE_TIMEOUT)
        prefix = f"mpidp/{kind}"
    prefixed = dist.PrefixStore(prefix, store)
    make = dist.ProcessGroupGloo if kind == "gloo" else dist.ProcessGroupNCCL
    # torch's stubs omit the defaults of the last argument (gloo's timeout, NCCL's options).
    group = make(prefixed, comms.rank, comms.size)  # type: ignore[call-arg]
    logger.debug("%s process group of %d ranks up (store prefix %s)", kind, comms.size, prefix)
    return group, store


class ProcessGroupBackend(HostBackend):
    """Runs negotiated batches through a torch.distributed process group (gloo or NCCL)."""

    NUMPY_PARTS = False  # every part goes through _reduce_flat below

    def __init__(self, comms, config, group, store=None):
        super().__init__(comms, config)
        self.group = group
        self._store = store  # rank 0 serves the store; it must live as long as the group
        self.hierarchical = False  # the process group's own algorithms apply

    @property
    def store(self):
        """The store the group was set up through (None once closed)."""
        return self._store

    def reduce_dtype(self, dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """Reductions run in the tensor's own dtype (int16 aside, see _reduce_flat)."""
        return dtype

    def close(self) -> None:
        """Release the process group's connections (local; call after the last batch)."""
        shutdown = getattr(self.group, "shutdown", None)
        if shutdown is not None:
            shutdown()
        # The group's threads end when the group is freed: drop it here rather than leave it to
        # the cycle collector (a removed process set's engine may sit in a reference cycle
        # until then, or for good in a process that froze its objects with gc.freeze()).
        self.group = None
        self._store = None

    # ---- allreduce: HostBackend's packing and scaling, this reduction ----

    def _reduce_flat(self, send: Optional[torch.Tensor], recv: torch.Tensor, req) -> None:
        recv = recv.view(-1)  # gloo wants at least one dimension; callers may pass any shape
        if send is not None:
            recv.copy_(send.view(-1))
        is_bool = recv.dtype == torch.bool
        if is_bool:
            work = recv.view(_BYTE)
        elif recv.dtype in dtypes.GROUP_REDUCE:
            work = recv.to(dtypes.GROUP_REDUCE[recv.dtype])
        else:
            work = recv
        self._wire(work.numel() * work.element_size())
        self.group.allreduce([work], _pg_op(req.reduce_op, is_bool)).wait()
        if work.data_ptr() != recv.data_ptr():
            recv.copy_(work)  # int32 -> int16 keeps the low bits: MPI's wrap-around
        self._scale_after(recv, req)

    # ---- other collectives ----

    def allgather(self, resp: Response, entry: Entry):
        t = entry.tensor if entry.tensor.dim() > 0 else entry.tensor.reshape(1)
        t = t.contiguous()
        dims = list(resp.first_dims)
        most = max(dims)
        mine = _rows_as_bytes(t, t.shape[0])
        if t.shape[0] < most:
            padded = mine.new_zeros((most, mine.shape[1]))
            padded[: t.shape[0]].copy_(mine)
            mine = padded
        out = given_output(entry, dims)
        if out is not None:  # equal blocks: gathered straight into the caller's tensor
            if is_block(t, out, self.rank):
                mine = mine.clone()  # the group writes every block, this rank's included
            gathered = list(_rows_as_bytes(out, out.shape[0]).split(most))
            self._wire(mine.numel())
            self.group.allgather([gathered], [mine]).wait()
            return out
        gathered = [mine.new_empty((most, mine.shape[1])) for _ in dims]
        self._wire(mine.numel())
        self.group.allgather([gathered], [mine]).wait()
        out = t.new_empty((sum(dims),) + tuple(t.shape[1:]))
        torch.cat([g[:d] for g, d in zip(gathered, dims)], out=_rows_as_bytes(out, out.shape[0]))
        return out

    def broadcast(self, resp: Response, entry: Entry):
        out = entry.output
        if out is not entry.tensor and self.rank == resp.request.root:
            out.copy_(entry.tensor)
        work = out if out.is_contiguous() else out.contiguous()
        self._wire(work.numel() * work.element_size())
        self.group.broadcast(work.reshape(-1).view(_BYTE), resp.request.root).wait()
        if work is not out:
            out.copy_(work)
        return out

    def alltoall(self, resp: Response, entry: Entry):
        t = entry.tensor.contiguous()
        splits = entry.extra
        if splits is None:
            splits = np.full(self.size, t.shape[0] // self.size, dtype=np.int32)
        splits = np.asarray(splits, dtype=np.int32)
        recv_splits = mpi.alltoall_counts(self.comm, splits)
        sent = int(splits.sum())
        out = t.new_empty((int(recv_splits.sum()),) + tuple(t.shape[1:]))
        self._wire(t[:sent].numel() * t.element_size())
        self.group.alltoall_base(
            _rows_as_bytes(out, out.shape[0]),
            _rows_as_bytes(t[:sent], sent),
            [int(x) for x in recv_splits],
            [int(x) for x in splits],
        ).wait()
        return out, torch.from_numpy(recv_splits.copy())

    def reducescatter(self, resp: Response, entry: Entry):
        req = resp.request
        t = entry.tensor
        dtype = t.dtype
        wide = dtype if dtype == torch.bool else dtypes.GROUP_REDUCE.get(dtype, dtype)
        work = scaling.work_copy(t.contiguous(), wide, req)
        is_bool = dtype == torch.bool
        if is_bool:
            work = work.view(_BYTE)
        rows = uneven_counts(t.shape[0], self.size)
        chunks = list(work.split(rows))
        out = work.new_empty((rows[self.rank],) + tuple(t.shape[1:]))
        self._wire(work.numel() * work.element_size())
        self.group.reduce_scatter([out], [chunks], _reduce_scatter_options(req, is_bool)).wait()
        if is_bool:
            out = out.view(torch.bool)
        elif dtype == torch.int16:
            out = out.to(dtype)  # wrap to int16 before scaling, as the MPI path reduces in int16
        self._scale_after(out, req)
        return into_output(entry, out if out.dtype == dtype else out.to(dtype))


def _reduce_scatter_options(req, is_bool: bool):
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = _pg_op(req.reduce_op, is_bool)
    return opts
