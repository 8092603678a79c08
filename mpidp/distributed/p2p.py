"""torch.distributed's send and recv: MPI point to point on the process set's own communicator."""

import torch

from ..errors import ArgumentError
from ..runtime.process_sets import member_of
from .work import Work


def _bytes(t: torch.Tensor, what: str):
    if not t.is_contiguous():
        raise ArgumentError(
            f"{what}: the tensor must be contiguous (strides {t.stride()}); "
            f"call .contiguous() first"
        )
    host = t if t.device.type == "cpu" else t.cpu()
    return host, host.reshape(-1).view(torch.uint8).numpy()


def _mpi():
    """The engine's MPI module, imported at first use: importing it starts MPI, which
    mpidp.init() must do itself (it may choose the MPICH netmod first, runtime/slurm_pmi.py)."""
    from ..engine import mpi

    return mpi


def _check_peer(peer: int, size: int, rank: int, what: str) -> None:
    if not 0 <= peer < size:
        raise ValueError(f"{what}: rank {peer} is not in the group (ranks 0..{size - 1})")
    if peer == rank:
        raise ValueError(f"{what}: rank {rank} cannot {what} to or from itself")


def _wait(request) -> int:
    """Complete `request` as the engine's waits do (test and yield, then sleep between tests);
    the source rank of a receive."""
    mpi = _mpi()
    status = mpi.new_status()
    mpi.wait(request, spin=True, status=status)
    return status.Get_source()


def send(process_set, tensor: torch.Tensor, dst: int, tag: int) -> Work:
    """Start sending `tensor` to group rank `dst`; the work completes once MPI has it.
    Synchronization: `dst`'s matching recv (MPI may complete a small send before it)."""
    _, member = member_of(process_set, "send")
    _check_peer(dst, member.size, member.rank, "send")
    host, view = _bytes(tensor, "send")
    request = _mpi().isend(member.engine.comms.p2p, view, dst, tag)
    return _PointWork(request, [tensor], None, keep=host)


def recv(process_set, tensor: torch.Tensor, src, tag: int) -> Work:
    """Start receiving into `tensor` from group rank `src` (None: any rank); source_rank() says
    who sent. Synchronization: the sender's matching send."""
    _, member = member_of(process_set, "recv")
    if src is not None:
        _check_peer(src, member.size, member.rank, "recv")
    host, view = _bytes(tensor, "recv")
    mpi = _mpi()
    request = mpi.irecv(member.engine.comms.p2p, view, mpi.ANY_SOURCE if src is None else src, tag)
    return _PointWork(request, [tensor], host if host is not tensor else None, keep=host)


class _PointWork(Work):
    """A point-to-point work: wait() tests the MPI request, then completes the future."""

    def __init__(self, request, value, staged, keep):
        self._request = request
        self._staged = staged  # a receive into a device tensor lands on the host first
        self._keep = keep  # MPI reads or writes this memory until the request completes
        self._target = value[0]
        self._sender = -1
        super().__init__([], lambda _: value, lambda: self._sender, pending=True)

    def _results(self) -> list:
        self._sender = _wait(self._request)
        if self._staged is not None:
            self._target.copy_(self._staged)
        self._keep = self._staged = None
        return []
