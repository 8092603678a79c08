"""The coordinator's pure logic: count which ranks submitted each name, validate, order them."""

from typing import Dict, List, Sequence, Tuple

from .messages import JOIN_NAME, OP_NAMES, OpType, ReduceOp, Request, Response, op_label


def _ranks(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))


def _describe(field: str, request: Request):
    if field == "op":
        return OP_NAMES.get(OpType(request.op), str(request.op))
    if field == "reduce_op":
        return ReduceOp(request.reduce_op).name.capitalize()
    if field == "shape":
        if request.parts:
            shapes = ", ".join(str(tuple(p)) for p in request.parts)
            return f"{len(request.parts)} tensors of shapes [{shapes}] {request.dtype}"
        return f"shape {tuple(request.shape)} {request.dtype}"
    if field == "trailing":
        return (
            f"shape (*, {', '.join(map(str, request.shape[1:]))}) {request.dtype}"
            if len(request.shape) > 1
            else f"shape {tuple(request.shape)} {request.dtype}"
        )
    if field == "device":
        return f"device {request.device.split(':')[0]}"
    return f"{field} {getattr(request, field)!r}"


def _fields(op: int) -> List[str]:
    fields = ["op", "dtype", "device"]
    if op in (OpType.ALLREDUCE, OpType.BROADCAST, OpType.REDUCESCATTER):
        fields.append("shape")
    if op in (OpType.ALLGATHER, OpType.ALLTOALL):
        fields.append("trailing")
    if op in (OpType.ALLREDUCE, OpType.REDUCESCATTER):
        fields += ["reduce_op", "prescale", "postscale"]
    if op == OpType.BROADCAST:
        fields.append("root")
    return fields


def _key(field: str, request: Request):
    if field == "device":
        return request.device.split(":")[0]
    if field == "trailing":
        return (len(request.shape) > 0, tuple(request.shape[1:]), request.dtype)
    if field == "shape":
        return (tuple(request.shape), request.parts, request.dtype)
    return getattr(request, field)


def _first_differing_part(requests: Dict[int, Request]):
    """Index of the first tensor whose shape differs between ranks' multi-tensor requests of
    the same length, or None."""
    parts = {req.parts for req in requests.values()}
    if len(parts) < 2 or len({len(p) for p in parts}) > 1 or not all(parts):
        return None
    return next(i for i, shapes in enumerate(zip(*parts)) if len(set(shapes)) > 1)


def validate(requests: Dict[int, Request], joined: Sequence[int]) -> str:
    """Empty if the ranks' requests agree, else one message naming tensor, ranks and field."""
    first = requests[min(requests)]
    label = op_label(first)
    part = _first_differing_part(requests)
    if part is not None:  # name the tensor of a group that differs, as '<name>.<index>'
        label = op_label(first._replace(name=f"{first.name}.{part}"))
        requests = {
            r: req._replace(shape=req.parts[part] if part < len(req.parts) else (), parts=())
            for r, req in requests.items()
        }
    for field in _fields(first.op) if all(r.op == first.op for r in requests.values()) else ["op"]:
        groups: Dict[object, List[int]] = {}
        for rank, req in requests.items():
            groups.setdefault(_key(field, req), []).append(rank)
        if len(groups) > 1:
            parts = [
                f"{_ranks(ranks)} sent {_describe(field, requests[ranks[0]])}"
                for ranks in sorted(groups.values())
            ]
            return f"{label}: " + ", ".join(parts)
    if joined and first.op not in (OpType.ALLREDUCE, OpType.BARRIER):
        hint = (
            "; a sparse allreduce is an allgather: DistributedOptimizer(..., "
            "sparse_as_dense=True) reduces sparse gradients as dense ones, which can run"
            if first.op == OpType.ALLGATHER
            else ""
        )
        return (
            f"{label}: {_ranks(joined)} already called join(); only allreduce may run while "
            f"ranks are joined{hint}"
        )
    if (
        first.op == OpType.ALLREDUCE
        and joined
        and first.reduce_op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT, ReduceOp.BAND)
    ):
        # Zeros from joined ranks would silently change a min, max or product.
        return (
            f"{label}: reduce op {ReduceOp(first.reduce_op).name.capitalize()} cannot run "
            f"while {_ranks(joined)} are joined (they contribute zeros); use Sum or Average"
        )
    return ""


class MessageTable:
    """Rank 0's table of submissions not yet answered, in order of first arrival."""

    def __init__(self, size: int):
        self.size = size
        self.table: Dict[str, Dict[int, Request]] = {}
        self.joined: List[int] = []
        self.serves: Dict[int, Tuple[str, ...]] = {}  # joined rank -> name prefixes it still sends
        self.join_serial = 0

    def add(self, rank: int, requests: Sequence[Request]) -> None:
        for req in requests:
            if req.op == OpType.JOIN:
                if rank not in self.joined:
                    self.joined.append(rank)
                self.serves[rank] = tuple(req.serves)
                self.join_serial = max(self.join_serial, req.serial)
                continue
            slot = self.table.setdefault(req.name, {})
            slot[rank] = req

    def drop(self, names) -> None:
        """Forget the submissions of `names` (answered otherwise: the ranks disagreed)."""
        for name in names:
            self.table.pop(name, None)

    def ready(self) -> List[Response]:
        """Responses for every name now submitted by all ranks that have not joined (or that
        joined but still serve the name's prefix), in order."""
        joined = set(self.joined)
        out = []
        for name in list(self.table):
            slot = self.table[name]
            absent = {r for r in joined - set(slot) if not name.startswith(self.serves[r])}
            if len(slot) + len(absent) < self.size:
                continue
            del self.table[name]
            error = validate(slot, sorted(absent))
            first = slot[min(slot)]
            if error:
                out.append(Response(name, OpType.ERROR, first, error=error))
                continue
            dims: Tuple[int, ...] = ()
            if first.op == OpType.ALLGATHER:
                dims = tuple(slot[r].shape[0] if slot[r].shape else 1 for r in range(self.size))
            out.append(
                Response(name, first.op, first, first_dims=dims, joined=tuple(sorted(absent)))
            )
        if len(self.joined) == self.size:
            out.append(
                Response(
                    JOIN_NAME,
                    OpType.JOIN,
                    Request(JOIN_NAME, OpType.JOIN),
                    last_joined=self.joined[-1],
                    serial=self.join_serial,
                    pending=tuple(self.table),
                )
            )
            self.joined, self.serves = [], {}
            self.join_serial = 0
        return out
