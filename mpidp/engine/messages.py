"""Requests a rank submits and the responses the coordinator orders, identical on every rank."""

import enum
from typing import NamedTuple, Tuple


class OpType(enum.IntEnum):
    """What a request asks the engine to do."""

    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    JOIN = 6
    ERROR = 7  # response only: the request failed on every rank
    SHUTDOWN = 8  # response only: the coordinator stops the engine


class ReduceOp(enum.IntEnum):
    """Reduction of allreduce and reducescatter; Horovod's values, which scripts may pass as
    plain integers (op=3 is Min there)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5
    # Bitwise, on integers and bool only (torch.distributed's BAND, BOR and BXOR).
    BAND = 6
    BOR = 7
    BXOR = 8


# Names of calls whose ranks must make them in the same order (torch.distributed's rule): the
# stall inspector compares what each rank waits for under this prefix (stall.py).
ORDERED_PREFIX = "torch."
JOIN_NAME = "mpidp.join"  # the one name join() requests use on every rank

OP_NAMES = {
    OpType.ALLREDUCE: "allreduce",
    OpType.ALLGATHER: "allgather",
    OpType.BROADCAST: "broadcast",
    OpType.ALLTOALL: "alltoall",
    OpType.REDUCESCATTER: "reducescatter",
    OpType.BARRIER: "barrier",
    OpType.JOIN: "join",
}


class Request(NamedTuple):
    """One rank's submission; small, pickled only on the negotiation slow path."""

    name: str
    op: int
    dtype: str = ""
    shape: Tuple[int, ...] = ()
    device: str = "cpu"
    reduce_op: int = ReduceOp.SUM
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1
    cacheable: bool = True
    serial: int = 0  # JOIN only: how many unnamed ops this rank has numbered
    # ALLREDUCE of several tensors (a gradient bucket, a grouped op): each tensor's shape, in
    # order; `shape` is then the flat length of them all. Empty for one tensor.
    parts: Tuple[Tuple[int, ...], ...] = ()
    # JOIN only: prefixes of the names this rank still submits while joined (a ShardedOptimizer's
    # shard is stepped until every rank has joined); the others wait for those as for anyone's.
    serves: Tuple[str, ...] = ()

    def signature(self) -> tuple:
        """What must be equal on every rank for one name (alltoall/allgather: dim 0 may differ)."""
        if self.op in (OpType.ALLGATHER, OpType.ALLTOALL):
            shape = ("*",) + tuple(self.shape[1:]) if self.shape else ("scalar",)
        else:
            shape = self.shape
        return (
            self.op,
            self.dtype,
            shape,
            self.device.split(":")[0],
            self.reduce_op,
            self.prescale,
            self.postscale,
            self.root,
            self.parts,
        )

    def cache_key(self) -> tuple:
        """What must not change for a cached response to be reused by this rank.

        An allgather's response holds every rank's dim 0, so its own dim 0 is part of the key.
        """
        if self.op == OpType.ALLGATHER:
            return self.signature() + (tuple(self.shape),)
        return self.signature()


def part_shapes(request: Request) -> Tuple[Tuple[int, ...], ...]:
    """The shapes of the tensors an op carries: its parts, or its one shape."""
    return request.parts or (tuple(request.shape),)


class Response(NamedTuple):
    """One ordered decision of the coordinator; every rank executes the same list in order."""

    name: str
    op: int
    request: Request  # canonical metadata (used by joined ranks too)
    first_dims: Tuple[int, ...] = ()  # allgather: each rank's dim 0
    error: str = ""  # ERROR/SHUTDOWN: the message for every rank
    last_joined: int = -1  # JOIN: the rank that joined last
    joined: Tuple[int, ...] = ()  # ranks joined when this response was made
    serial: int = 0  # JOIN: the highest unnamed-op count of any rank
    # JOIN: names that some ranks sent the coordinator while ranks were joined (so off their
    # cache bits); the others must send theirs there too, even if their cache has the name.
    pending: Tuple[str, ...] = ()


def op_label(request: Request) -> str:
    """`allreduce 'fc1.weight'`: how messages name a request."""
    return f"{OP_NAMES.get(OpType(request.op), 'op')} {request.name!r}"
