"""The engine's MPI module, its only code that touches mpi4py: communicators, polling, calls."""

import os
import pickle
import sys
import time
from typing import Dict, List, Optional, cast

import numpy as np
from mpi4py import MPI
from mpi4py.typing import Buffer  # numpy arrays, and torch tensors through DLPack

from ..errors import ConfigError
from ..log import logger
from .messages import ReduceOp

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

# How a thread that waits for a result waits (wait() with `spin`): it tests the request and
# yields the core between tests, as MPICH's own blocking wait does. MPICH advances a non-blocking
# collective only inside Test(), so a collective of several rounds is paced by the gaps between
# tests; and where ranks share cores (more ranks than cores, data-loader workers), a yield hands
# the core to the peer this rank waits for at once, where a sleep of even 20 us costs a timer
# wake-up and, doubled, up to a millisecond a round (issue 27: 0.8-1 ms per blocking 4 B
# allreduce at n=3-4 on 2 cores). After _YIELD_S of yielding the wait turns to sleeps, so a
# rank blocked on a peer that is seconds late (a straggler, a stalled rank) does not hold a core.
_YIELD_S = 10e-3
_POLL_EVERY_S = 1e-3  # poll()'s pace while yielding
_SLEEP_MAX_S = 1e-3
# The longest sleep between tests of a data collective whose bytes cross the network while a
# backward pass has the core: MPICH's TCP transport moves bytes only inside a test, so sleeps
# of up to 1 ms left a 1 Gbit/s link idle and a reduction overlapped with the backward pass was
# slower than one after it (ResNet-18 at 1gbe, 2 x 1: 498-518 ms against 471-491; with 30 us,
# 444-447 ms, BENCHMARKS.md "The network wait's sleeps"). Where a test reads 2 MiB from a
# socket (UCX's TCP segment as mpidp sets it, runtime/ucx_segment.py) and the link was measured
# slow, 1 ms sleeps keep it fed at half the CPU: the backward pass gets the difference.
NETWORK_SLEEP_MAX_S = 30e-6
NETWORK_SLEEP_LONG_S = 1e-3


def mpi_op(reduce_op: int, is_bool: bool):
    return (_BOOL_OPS if is_bool else _MPI_OPS)[reduce_op]  # IntEnum keys: an int finds them


def user_op(combine):
    """A commutative MPI reduction op whose combine step is `combine(inbuf, inoutbuf)`. MPI
    calls it on the thread that drives the collective (mpi4py takes the GIL around the call)."""
    return MPI.Op.Create(lambda inbuf, inoutbuf, _datatype: combine(inbuf, inoutbuf), commute=True)


def wait(request, spin: bool = True, poll=None, status=None) -> None:
    """Complete a non-blocking MPI request. With `spin` (a thread waits for this result, so the
    CPU is ours): test and yield between tests for up to _YIELD_S, then poll with a bounded
    back-off. Without it (a backward pass needs the core): the back-off at once. `poll()`, if
    given, is called between tests once the request has waited _POLL_EVERY_S while yielding,
    and after each sleep (the engine uses it to wake sleeping peers it waits for). `status`: an
    MPI.Status (new_status()) that receives the completed request's status."""
    if request.Test(status):
        return
    # No poll() at once: its reasons (a stall, a stop) are seconds in the making, and at once it
    # would cost a blocking call that waits a few microseconds for its peers about a tenth of
    # its time (the express lane, issue 27).
    if spin:
        now = time.perf_counter()
        end, next_poll = now + _YIELD_S, now + _POLL_EVERY_S
        while True:
            if request.Test(status):
                return
            os.sched_yield()
            now = time.perf_counter()
            if now >= end:
                break
            if poll is not None and now >= next_poll:
                poll()
                next_poll = now + _POLL_EVERY_S
    delay = 20e-6
    while not request.Test(status):
        time.sleep(delay)
        delay = min(delay * 2, _SLEEP_MAX_S)
        if poll is not None:
            poll()


class Comms:
    """mpidp's private communicators: a duplicate of the user's, its local and cross splits.

    `local` holds the ranks of this node, `cross` the ranks with the same local rank on every
    node. With `simulated_local_size=k > 0` a node is k consecutive ranks of COMM_WORLD
    (node id = world rank // k) instead of the ranks that share memory, so a process set sees
    the same simulated nodes as the world. When k does not divide the world size, the last node
    is smaller (a non-homogeneous layout, which hierarchical allreduce handles by falling back to
    the flat one). k larger than the world size is a ConfigError: it simulates nothing.
    Synchronization: collective over `base` (Dup, Split, allgather).
    """

    def __init__(self, base, simulated_local_size: int = 0):
        world_size = MPI.COMM_WORLD.Get_size()
        if simulated_local_size > world_size:
            raise ConfigError(
                f"MPIDP_SIMULATED_LOCAL_SIZE={simulated_local_size} is larger than the "
                f"{world_size} ranks of the job; use a value from 1 to {world_size}, or 0 to "
                f"ask MPI which ranks share a node"
            )
        self.world = base.Dup()
        self.rank = self.world.Get_rank()
        self.size = self.world.Get_size()
        if simulated_local_size > 0:
            node = MPI.COMM_WORLD.Get_rank() // simulated_local_size
            self.local = self.world.Split(color=node, key=self.rank)
        else:
            self.local = self.world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.cross = self.world.Split(color=self.local.Get_rank(), key=self.rank)
        # Negotiation traffic gets its own communicator so it never matches data collectives,
        # and wake-up messages (point to point) one more, so nothing else ever matches them.
        self.control = self.world.Dup()
        self.wake = self.world.Dup()
        # Point to point for users (torch.distributed's send/recv), from their own threads.
        self.p2p = self.world.Dup()
        self.local_sizes = self.world.allgather(self.local.Get_size())
        self.hosts = self.world.allgather(MPI.Get_processor_name())  # errors name them
        # Marks this engine's wake-ups: a freed communicator's context id may come back in a
        # later Dup, with an old wake-up still queued for it, which must not reach a new engine.
        self.epoch = self.world.bcast(
            int.from_bytes(os.urandom(7), "little") if self.rank == 0 else None, root=0
        )

    @property
    def spans_hosts(self) -> bool:
        """The ranks are on more than one node (some traffic crosses the network)."""
        return self.local.Get_size() < self.size

    @property
    def homogeneous(self) -> bool:
        """Every node holds the same number of ranks of this communicator."""
        return len(set(self.local_sizes)) == 1

    def free(self) -> None:
        for comm in (self.p2p, self.wake, self.control, self.cross, self.local, self.world):
            if comm != MPI.COMM_NULL:
                comm.Free()


# ---- facts about the MPI library (for `doctor`; the file's own facts: mpi_library.py) ----


def world() -> Optional[tuple]:
    """(rank, size) in COMM_WORLD, or None once MPI is finalized."""
    if MPI.Is_finalized():
        return None
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def library_version() -> str:
    """The MPI library's own version string (MPI_Get_library_version), stripped."""
    return MPI.Get_library_version().strip()


def thread_level_name() -> str:
    """The thread level MPI was initialised with: single, funneled, serialized or multiple."""
    names = {
        MPI.THREAD_SINGLE: "single",
        MPI.THREAD_FUNNELED: "funneled",
        MPI.THREAD_SERIALIZED: "serialized",
        MPI.THREAD_MULTIPLE: "multiple",
    }
    level = MPI.Query_thread()
    return names.get(level, str(level))


# ---- wake-ups (point to point on the wake communicator; see protocol.py) ----

_WAKE_TAG = 7


class WakeBox:
    """One posted receive for wake-up messages (three int64: epoch, cycle, flags), tested, never
    waited on. Messages of another epoch (an earlier engine's) are dropped. Sends are
    non-blocking and kept until they complete, so a wake never blocks its sender. It counts
    what it sent to each rank and what it received, so that the last cycle can take every
    wake-up still on its way (drain()): one left unreceived at exit is a message MPI warns of
    (UCX: "unexpected tag-receive descriptor ... was not matched").
    """

    def __init__(self, comm, epoch: int):
        self.comm = comm
        self.epoch = epoch
        self._buf = np.zeros(3, dtype=np.int64)
        self._recv = self._post()
        self._sends: List[MPI.Request] = []
        self.sent = [0] * comm.Get_size()  # wake-ups of this epoch sent to each rank
        self._got = 0  # wake-ups of this epoch received

    def _post(self):
        return self.comm.Irecv([self._buf, MPI.INT64_T], source=MPI.ANY_SOURCE, tag=_WAKE_TAG)

    def take(self) -> list:
        """Every (cycle, flags) of this epoch received since the last call; re-posts."""
        got = []
        while self._recv.Test():
            if int(self._buf[0]) == self.epoch:
                got.append((int(self._buf[1]), int(self._buf[2])))
                self._got += 1
            self._recv = self._post()
        return got

    def send(self, cycle: int, flags: int, ranks) -> None:
        """Send (cycle, flags) to each rank in `ranks`."""
        self._sends = [r for r in self._sends if not r.Test()]
        msg = np.array([self.epoch, cycle, flags], dtype=np.int64)
        for rank in ranks:
            self._sends.append(self.comm.Isend([msg, MPI.INT64_T], dest=rank, tag=_WAKE_TAG))
            self.sent[rank] += 1

    def drain(self, expected: int, timeout_s: float = 2.0) -> None:
        """Receive wake-ups until `expected` of this epoch have arrived in all (the peers' sent
        counts for this rank), and let this rank's own sends complete; both bounded by
        `timeout_s`. Synchronization: the peers' matching sends and receives."""
        deadline = time.monotonic() + timeout_s
        delay = 20e-6
        while time.monotonic() < deadline:
            self.take()
            self._sends = [r for r in self._sends if not r.Test()]
            if self._got >= expected and not self._sends:
                return
            time.sleep(delay)
            delay = min(delay * 2, _SLEEP_MAX_S)

    def close(self) -> None:
        """Cancel the posted receive (local); sends still in flight are left to MPI."""
        self._recv.Cancel()
        self._recv.Wait()
        self._sends = [r for r in self._sends if not r.Test()]


def end_job(grace_s: float = 0.3) -> None:
    """End every rank of the job (MPI_Abort), after flushing this rank's output and giving the
    launcher `grace_s` to forward it. Does not return."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not stop the abort
            pass
    # The launcher forwards output through pipes it stops reading once it tears the job down:
    # give it a moment to pass the last lines on, or the job ends without saying why.
    time.sleep(grace_s)
    MPI.COMM_WORLD.Abort(1)
    os._exit(1)  # MPICH's Abort may return while the launcher ends the job: leave now


def abort_job(message: str) -> None:
    """Log `message` (critical), then end_job(): for failures that leave peers inside a
    collective. Does not return."""
    logger.critical(message)
    end_job()


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
            _drained(requests, bounds, drain, busy, network)
            return
        _done(
            lambda: MPI.Request.Testall(requests),
            lambda: MPI.Request.Waitall(requests),
            busy,
            network,
        )
        return
    request = comm.Iallreduce(MPI.IN_PLACE if send is None else send, recv, op=op)
    _done(request.Test, request.Wait, busy, network)


def _done(test, wait, busy, network: float) -> None:
    """Complete what `test()`/`wait()` poll and wait for: the blocking wait where no `busy()`
    is given or a user thread waits, else _paced."""
    if busy is None or busy():
        wait()
    else:
        _paced(test, wait, busy, network)


def _drained(requests, bounds, drain, busy, network: float) -> None:
    """Complete `requests` in order, `drain(lo, hi)` each as soon as it is done, waiting as
    _done does, with one back-off for them all: started anew per piece, the sleeps would climb
    from 20 us again for every piece (a 1 MiB piece takes 8 ms at 1 Gbit/s)."""
    delay = 20e-6
    for request, (lo, hi) in zip(requests, bounds):
        if busy is None or busy():
            request.Wait()
        else:
            delay = _paced(request.Test, request.Wait, busy, network, delay)
        drain(lo, hi)


def _paced(done, finish, busy, network: float, delay: float = 20e-6) -> float:
    """Test with `done()` until it is true, giving the core away between tests (allreduce says
    how); `finish()` (the blocking wait) as soon as `busy()` turns true. Returns the sleep the
    back-off, which starts at `delay`, had reached."""
    while not done():
        if busy():
            finish()
            break
        if network:
            time.sleep(delay)
            delay = min(delay * 2, network)
        else:
            os.sched_yield()
    return delay


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
    """Start receiving into the bytes of `buf` from `source` (ANY_SOURCE: whoever sends)."""
    return comm.Irecv([buf, MPI.BYTE], source=source, tag=tag)


def new_status():
    """An MPI status for wait(status=...); its Get_source() names a receive's sender."""
    return MPI.Status()
