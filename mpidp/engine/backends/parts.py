"""An allreduce batch's parts on this rank: their device, their tensors, their fusion buffers."""

from typing import List, Optional

import torch

from .. import dtypes
from ..fusion import PartGroup
from ..messages import Response, part_shapes
from ..tensor_queue import Entry


def local_device(batch: List[Response], entries: List[Optional[Entry]]) -> torch.device:
    """The device this rank runs `batch` on: its own tensors' device (the response names the
    coordinator's, whose index may differ), or for a joined rank the current device of the kind."""
    for entry in entries:
        if entry is not None and entry.tensor is not None:
            first = entry.tensor[0] if isinstance(entry.tensor, list) else entry.tensor
            return first.device
    kind = batch[0].request.device.split(":")[0]
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def gather(batch: List[Response], entries: List[Optional[Entry]]):
    """(device, sources, outputs, one result per op): every op's parts in order, zeros of the
    agreed shapes for an op this joined rank did not submit (entry None)."""
    if len(entries) == 1 and entries[0] is not None:  # one op (a bucket): no lists to join
        srcs, outs = entries[0].tensor, entries[0].output
        return srcs[0].device, srcs, outs, [outs]
    device = local_device(batch, entries)
    dtype = dtypes.BY_NAME[batch[0].request.dtype]
    srcs, outs, results = [], [], []
    for resp, entry in zip(batch, entries):
        if entry is None:
            zeros = [torch.zeros(s, dtype=dtype, device=device) for s in part_shapes(resp.request)]
            srcs += zeros
            outs += zeros
            results.append(zeros)
        else:
            srcs += entry.tensor
            outs += entry.output
            results.append(entry.output)
    return device, srcs, outs, results


class FusionBuffers:
    """One persistent buffer per (dtype, device), grown on demand, that small parts are packed
    into; and for each part group the views of it in the parts' shapes, made once."""

    def __init__(self):
        self._bufs = {}

    def views(self, group: PartGroup, dtype: torch.dtype, device):
        """(flat, views): the start of the buffer for `group`'s parts, and one view of it per
        part in its shape. Kept on the group while the buffer stays, so a bucket packed every
        step makes no views after its first (they cost more than the copies, in Python)."""
        buf = self._bufs.get((dtype, device))
        bound = group.bound
        if bound is not None and bound[0] is buf:
            return bound[1], bound[2]
        buf = self._at_least(dtype, device, group.total)
        flat = buf[: group.total]
        views = [v.view(s) for v, s in zip(flat.split(group.numels), group.shapes)]
        group.bound = (buf, flat, views)
        return flat, views

    def scratch(self, dtype: torch.dtype, device, n: int) -> torch.Tensor:
        """`n` elements of the buffer, for one reduction that finishes before the next use
        (the data path runs one at a time): kept, so its pages are not faulted in anew."""
        return self._at_least(dtype, device, n)[:n]

    def _at_least(self, dtype: torch.dtype, device, n: int) -> torch.Tensor:
        buf = self._bufs.get((dtype, device))
        if buf is None or buf.numel() < n:
            # Grown at least twofold: a group keeps the buffer it was bound to until it is used
            # again (or the planner forgets it), so what stale groups hold stays under the
            # size of the newest buffer.
            grown = 2 * buf.numel() if buf is not None else 1024
            buf = torch.empty(max(n, grown), dtype=dtype, device=device)
            self._bufs[(dtype, device)] = buf
        return buf
