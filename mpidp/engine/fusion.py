"""Fusion policy: which ready allreduces share one buffer; decided from metadata only, so every rank agrees."""

import math
from typing import Dict, List

import torch

from .messages import OpType, Response

_ITEMSIZE = {name: torch.empty((), dtype=getattr(torch, name)).element_size()
             for name in ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
                          "float32", "float64", "bool")}


def nbytes(response: Response) -> int:
    req = response.request
    return math.prod(req.shape) * _ITEMSIZE[req.dtype]


def plan(responses: List[Response], fuse_below_bytes: int,
         fusion_threshold_bytes: int) -> List[List[Response]]:
    """Group ready responses into batches executed in order.

    Allreduces smaller than `fuse_below_bytes` with equal dtype, reduce op, scale factors, device
    and joined ranks share a batch of at most `fusion_threshold_bytes`; everything else runs alone
    (large tensors are latency-free already and reducing them in place saves two copies).
    """
    batches: List[List[Response]] = []
    open_batch: Dict[tuple, int] = {}
    open_bytes: Dict[tuple, int] = {}
    for resp in responses:
        if resp.op != OpType.ALLREDUCE or fusion_threshold_bytes == 0:
            batches.append([resp])
            continue
        size = nbytes(resp)
        if size >= fuse_below_bytes or size > fusion_threshold_bytes:
            batches.append([resp])
            continue
        req = resp.request
        # Device kind, not index: the response carries the coordinator's device string, and each
        # rank runs its batches on its own GPU (whatever its index), so only the kind is shared.
        key = (req.dtype, req.reduce_op, req.prescale, req.postscale,
               req.device.split(":")[0], resp.joined)
        idx = open_batch.get(key)
        if idx is not None and open_bytes[key] + size <= fusion_threshold_bytes:
            batches[idx].append(resp)
            open_bytes[key] += size
        else:
            open_batch[key] = len(batches)
            open_bytes[key] = size
            batches.append([resp])
    return batches
