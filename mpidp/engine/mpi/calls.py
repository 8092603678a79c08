"""The MPI calls of negotiation, the data path on host memory and point to point."""

import pickle
from typing import Dict, Optional, cast

import numpy as np
from mpi4py import MPI
from mpi4py.typing import Buffer  # numpy arrays, and torch tensors through DLPack

from ..messages import ReduceOp
from .waiting import complete, complete_in_order, wait

_MPI_OPS: Dict[int, MPI.Op] = {  # ReduceOp keys: an IntEnum hashes as its int
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.AVERAGE: MPI.SUM,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.MAX: MPI.MAX,
    ReduceOp.PRODUCT: MPI.PROD,
    ReduceOp.BAND: MPI.BAND,
    ReduceOp.BOR: MPI.BOR,
    ReduceOp.BXOR: MPI.BXOR,
}
# MPI's arithmetic ops are not defined on C_BOOL; the logical ones are what Sum/Min/... mean there.
_BOOL_OPS: Dict[int, MPI.Op] = {
    ReduceOp.SUM: MPI.LOR,
    ReduceOp.AVERAGE: MPI.LOR,
    ReduceOp.MAX: MPI.LOR,
    ReduceOp.MIN: MPI.LAND,
    ReduceOp.PRODUCT: MPI.LAND,
    ReduceOp.BAND: MPI.LAND,
    ReduceOp.BOR: MPI.LOR,
    ReduceOp.BXOR: MPI.LXOR,
}


def mpi_op(reduce_op: int, is_bool: bool):
    return (_BOOL_OPS if is_bool else _MPI_OPS)[reduce_op]  # IntEnum keys: an int finds them


def user_op(combine):
    """A commutative MPI reduction op whose combine step is `combine(inbuf, inoutbuf)`. MPI
    calls it on the thread that drives the collective (mpi4py takes the GIL around the call)."""
    return MPI.Op.Create(lambda inbuf, inoutbuf, _datatype: combine(inbuf, inoutbuf), commute=True)


# ---- negotiation (on the control communicator, non-blocking and polled) ----


def allreduce_band(comm, band: bytearray, spin: bool = True, poll=None) -> None:
    """Bitwise AND of a buffer of uint64 words across ranks, in place; `poll` as in wait()."""
    wait(comm.Iallreduce(MPI.IN_PLACE, [band, MPI.UINT64_T], op=MPI.BAND), spin, poll)


def gather_objects(comm, obj, root: int) -> Optional[list]:
    """Gather one picklable object per rank at `root` (lengths, then bytes)."""
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    size = comm.Get_size()
    length = [np.array([data.size], dtype=np.int64), MPI.INT64_T]
    if comm.Get_rank() != root:
        wait(comm.Igather(length, None, root=root))
        wait(comm.Igatherv([data, MPI.BYTE], None, root=root))
        return None
    lengths = np.zeros(size, dtype=np.int64)
    wait(comm.Igather(length, [lengths, MPI.INT64_T], root=root))
    buf = np.empty(int(lengths.sum()), dtype=np.uint8)
    wait(comm.Igatherv([data, MPI.BYTE], [buf, (lengths, None), MPI.BYTE], root=root))
    offsets = [0, *np.cumsum(lengths).tolist()]
    return [pickle.loads(buf[offsets[i] : offsets[i + 1]].tobytes()) for i in range(size)]


def allgather_object(comm, obj) -> list:
    """Every rank's picklable `obj`, in rank order (for rare, small exchanges)."""
    return comm.allgather(obj)


def bcast_object(comm, obj, root: int):
    """Broadcast a picklable object from `root` (length, then bytes)."""
    is_root = comm.Get_rank() == root
    data = (
        np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        if is_root
        else np.empty(0, dtype=np.uint8)
    )
    length = np.array([data.size], dtype=np.int64)
    wait(comm.Ibcast([length, MPI.INT64_T], root=root))
    if not is_root:
        data = np.empty(int(length[0]), dtype=np.uint8)
    wait(comm.Ibcast([data, MPI.BYTE], root=root))
    return obj if is_root else pickle.loads(data.tobytes())


# ---- data path on host memory (blocking: after negotiation every rank is in step) ----


def allreduce(
    comm,
    send: Optional[Buffer],
    recv: Buffer,
    op,
    busy=None,
    network: float = 0.0,
    piece: int = 0,
    fill=None,
    drain=None,
) -> None:
    """Allreduce into `recv`; `send=None` means in place.

    MPICH's blocking wait busy-polls a core until the peers arrive. That is fastest when a user
    thread waits for the result, but during a backward pass the spin takes a core from the
    gradients still being computed (and from the other ranks' on a full node). So unless
    `busy()` says a user waits, the wait gives the core away between tests, switching to the
    blocking wait as soon as `busy()` turns true: with `network` > 0 (the ranks span hosts, so
    the network, not this core, moves the bytes, but only inside MPI's tests) it sleeps between
    tests, at most `network` seconds; on one host (0), where MPI copies through shared memory
    only inside its tests, it yields. Always non-blocking: MPI does not match a blocking
    collective with a non-blocking one, and ranks may decide differently; here Iallreduce +
    Wait costs what Allreduce does from 4 B to 16 MB (BENCHMARKS.md). With `piece` > 0 a buffer
    longer than `piece` elements goes as one Iallreduce per `piece` elements, all started at
    once and waited together (every rank must pass the same `piece`: the collectives match in
    order). `fill(lo, hi)`, if given, writes elements lo:hi of `recv` just before their piece
    starts, and `drain(lo, hi)` reads them as soon as their piece is done, in order, while the
    later pieces are still in flight (in place only). Synchronization: one or more collectives
    on `comm`.
    """
    if piece > 0 and (fill is not None or len(cast(np.ndarray, recv)) > piece):
        src, dst = cast(Optional[np.ndarray], send), cast(np.ndarray, recv)
        n = len(dst)
        bounds = [(lo, min(lo + piece, n)) for lo in range(0, n, piece)]
        requests = []
        for lo, hi in bounds:
            if fill is not None:
                fill(lo, hi)
            requests.append(
                comm.Iallreduce(MPI.IN_PLACE if src is None else src[lo:hi], dst[lo:hi], op=op)
            )
        if drain is not None:
            complete_in_order(requests, bounds, drain, busy, network)
            return
        complete(
            lambda: MPI.Request.Testall(requests),
            lambda: MPI.Request.Waitall(requests),
            busy,
            network,
        )
        return
    request = comm.Iallreduce(MPI.IN_PLACE if send is None else send, recv, op=op)
    complete(request.Test, request.Wait, busy, network)


def allgatherv(comm, send: np.ndarray, recv: np.ndarray, counts) -> None:
    comm.Allgatherv(send, [recv, (counts, None)])


def bcast(comm, buf: np.ndarray, root: int) -> None:
    comm.Bcast(buf, root=root)


def alltoall_counts(comm, send_counts: np.ndarray) -> np.ndarray:
    recv = np.empty_like(send_counts)
    comm.Alltoall(send_counts, recv)
    return recv


def alltoallv(comm, send: np.ndarray, send_counts, recv: np.ndarray, recv_counts) -> None:
    comm.Alltoallv([send, (send_counts, None)], [recv, (recv_counts, None)])


def reduce_scatter(comm, send, recv, counts, op) -> None:
    comm.Reduce_scatter(send, recv, list(counts), op=op)


def reduce_scatter_block(comm, send, recv, op) -> None:
    """Reduce `send` (size * len(recv) elements) and keep this rank's block in `recv`."""
    comm.Reduce_scatter_block(send, recv, op=op)


def allgather(comm, send, recv) -> None:
    """Equal blocks from every rank into `recv` (`send=None`: this rank's block is already in
    place there). Much faster than Allgatherv with equal counts in MPICH 5 here (4.6 ms
    against 31 ms for 2 MB blocks on 2 ranks, a loaded machine)."""
    comm.Allgather(MPI.IN_PLACE if send is None else send, recv)


# ---- point to point (Adasum's exchanges between pairs of ranks: adasum.py) ----


def exchange(comm, send: np.ndarray, recv: np.ndarray, peer: int, tag: int, spin: bool) -> None:
    """Send the bytes of `send` to `peer` and receive `recv` from it, polled by wait() so that
    nothing blocks inside MPI. Synchronization: `peer`, which makes the matching call."""
    got = comm.Irecv([recv, MPI.BYTE], source=peer, tag=tag)
    wait(comm.Isend([send, MPI.BYTE], dest=peer, tag=tag), spin)
    wait(got, spin)


# ---- point to point for users (torch.distributed's send and recv, mpidp/distributed/p2p.py) ----

ANY_SOURCE = MPI.ANY_SOURCE


def isend(comm, buf: np.ndarray, dest: int, tag: int):
    """Start sending the bytes of `buf` to `dest`; complete it with test() or wait()."""
    return comm.Isend([buf, MPI.BYTE], dest=dest, tag=tag)


def irecv(comm, buf: np.ndarray, source: int, tag: int):
    """Start receiving into the bytes of `buf` from `source` (ANY_SOURCE: whoever sends, taken
    by matched probe: _Probed says why); complete it with test() or wait()."""
    if source == MPI.ANY_SOURCE:
        return _Probed(comm, buf, tag)
    return comm.Irecv([buf, MPI.BYTE], source=source, tag=tag)


class _Probed:
    """A receive from any source, as a request that wait() completes: each Test() probes until
    a message matches (Improbe), then receives that message. A posted receive from any source
    can miss messages: with MPICH 5.0.2 over UCX and shared memory, one posted after a first
    message from another node had matched never matched the second (wakeups.py has the
    figures). Unlike a posted receive it claims no message before it is tested: a receive from
    a named source started later may take a message first."""

    def __init__(self, comm, buf: np.ndarray, tag: int):
        self._comm, self._buf, self._tag = comm, buf, tag
        self._request: Optional[MPI.Request] = None

    def Test(self, status=None) -> bool:  # noqa: N802 (an MPI request's name)
        if self._request is None:
            message = self._comm.Improbe(source=MPI.ANY_SOURCE, tag=self._tag)
            if message is None:
                return False
            self._request = message.Irecv([self._buf, MPI.BYTE])
        return self._request.Test(status)


def new_status():
    """An MPI status for wait(status=...); its Get_source() names a receive's sender."""
    return MPI.Status()
