"""Fusion policy, from metadata only: which allreduces share a buffer, which parts are packed."""

import math
import operator
from typing import Dict, List, Optional, Sequence, Tuple

from .dtypes import ITEMSIZE as _ITEMSIZE
from .messages import OpType, Response, part_shapes


def nbytes(response: Response) -> int:
    req = response.request
    return math.prod(req.shape) * _ITEMSIZE[req.dtype]


def tensor_count(batch: Sequence[Response]) -> int:
    """Tensors a batch carries: every part of a multi-tensor op counts."""
    return sum(len(r.request.parts) or 1 if r.request is not None else 1 for r in batch)


def plan(
    responses: List[Response], fuse_below_bytes: int, fusion_threshold_bytes: int
) -> List[List[Response]]:
    """Group ready responses into batches executed in order.

    Single-tensor allreduces smaller than `fuse_below_bytes` with equal dtype, reduce op, scale
    factors, device and joined ranks share a batch of at most `fusion_threshold_bytes`;
    everything else runs alone (large tensors are latency-free already and reducing them in
    place saves two copies). A multi-tensor allreduce (a bucket) is a batch of its own, whose
    parts the data path groups with `part_groups`.
    """
    if len(responses) == 1:
        return [responses]
    batches: List[List[Response]] = []
    open_batch: Dict[tuple, int] = {}
    open_bytes: Dict[tuple, int] = {}
    for resp in responses:
        if resp.op != OpType.ALLREDUCE or fusion_threshold_bytes == 0 or resp.request.parts:
            batches.append([resp])
            continue
        size = nbytes(resp)
        if size >= fuse_below_bytes or size > fusion_threshold_bytes:
            batches.append([resp])
            continue
        req = resp.request
        # Device kind, not index: the response carries the coordinator's device string, and each
        # rank runs its batches on its own GPU (whatever its index), so only the kind is shared.
        key = (
            req.dtype,
            req.reduce_op,
            req.prescale,
            req.postscale,
            req.device.split(":")[0],
            resp.joined,
        )
        idx = open_batch.get(key)
        if idx is not None and open_bytes[key] + size <= fusion_threshold_bytes:
            batches[idx].append(resp)
            open_bytes[key] += size
        else:
            open_batch[key] = len(batches)
            open_bytes[key] = size
            batches.append([resp])
    return batches


class PartGroup:
    """Parts of a batch reduced together: packed into one buffer, or one part in place."""

    __slots__ = ("packed", "idx", "shapes", "numels", "total", "bound")

    def __init__(self, packed: bool, idx: List[int], shapes: List[Tuple[int, ...]]):
        self.packed = packed
        self.idx = idx
        self.shapes = [shapes[i] for i in idx]
        self.numels = [math.prod(s) for s in self.shapes]
        self.total = sum(self.numels)
        # The data path's views of its fusion buffer for this group (the same every step of a
        # cached bucket): (buffer, flat, views), rebuilt when the buffer is replaced.
        self.bound: Optional[tuple] = None


class PartPlanner:
    """How the parts of one batch are reduced: groups of part indices, each either packed into
    one buffer (small parts, at most the threshold together) or a single part reduced in place.

    Memoized per batch of response objects: a cached bucket comes back as the same Response
    every step, so its plan is computed once.
    """

    _LIMIT = 1024

    def __init__(self):
        self._memo: Dict[tuple, Tuple[List[Response], tuple, List[PartGroup]]] = {}

    def __call__(
        self, batch: List[Response], fuse_below_bytes: int, fusion_threshold_bytes: int
    ) -> List[PartGroup]:
        """The groups, in the order they are reduced (every rank the same)."""
        key = tuple(map(id, batch))
        limits = (fuse_below_bytes, fusion_threshold_bytes)
        hit = self._memo.get(key)
        if hit is not None and hit[1] == limits and all(map(operator.is_, hit[0], batch)):
            return hit[2]
        if len(self._memo) >= self._LIMIT:
            self._memo.clear()
        shapes = [s for r in batch for s in part_shapes(r.request)]
        groups = [
            PartGroup(packed, idx, shapes)
            for packed, idx in _groups(batch, shapes, fuse_below_bytes, fusion_threshold_bytes)
        ]
        self._memo[key] = (list(batch), limits, groups)
        return groups


def _groups(
    batch: List[Response], shapes, fuse_below_bytes: int, fusion_threshold_bytes: int
) -> List[Tuple[bool, List[int]]]:
    item = _ITEMSIZE[batch[0].request.dtype]
    if len(batch) > 1:  # a batch that plan() fused is packed whole, as plan() sized it
        return [(True, list(range(len(shapes))))]
    groups: List[Tuple[bool, List[int]]] = []
    packed: List[int] = []
    packed_bytes = 0
    for i, shape in enumerate(shapes):
        size = math.prod(shape) * item
        small = (
            fusion_threshold_bytes > 0
            and size < fuse_below_bytes
            and size <= fusion_threshold_bytes
        )
        if not small:
            groups.append((False, [i]))
            continue
        if packed and packed_bytes + size > fusion_threshold_bytes:
            groups.append((True, packed))
            packed, packed_bytes = [], 0
        packed.append(i)
        packed_bytes += size
    if packed:
        groups.append((True, packed))
    return [g for g in groups if g[0]] + [g for g in groups if not g[0]]
