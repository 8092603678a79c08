"""CUDA data paths: does MPI take device buffers, stream ordering, staging through host memory.

The staged route and the stream waits ran on an H100 (2026-11-27, `make gpu-check`); the
CUDA-aware route has never run on a GPU (no CUDA-aware MPI there). The staging logic also runs
in every test session as its CPU twin (`StagedBackend(inner, pin_memory=False)` on CPU
tensors, where the "device" copies are CPU to CPU and the stream waits are no-ops).

Stream ordering, conservatively: the engine runs on its own thread, whose current stream is not
the stream that produced a tensor (ops/ records none), so before a batch touches device memory
the whole device is synchronized (every stream, the producer's included). After the batch, the
engine thread's stream is synchronized before the handles complete, so a consumer on any stream
that waits for the handle sees the result. Recording a CUDA event at submission and waiting on
that event alone would be cheaper; it needs ops/ to record one.
"""

import math
from typing import List, Optional

import torch

from .. import dtypes, mpi_library, scaling
from ..messages import OpType, ReduceOp, Response, part_shapes
from ..tensor_queue import Entry
from .parts import local_device


def cuda_aware_mpi(setting: str) -> bool:
    """Whether to hand CUDA buffers to MPI: the `cuda_aware_mpi` knob ('1', '0'), or for 'auto'
    what the MPI library reports (MPIX_Query_cuda_support); unknown counts as no."""
    if setting == "1":
        return True
    if setting == "0":
        return False
    return bool(mpi_library.cuda_aware_support())


def wait_producers(device: torch.device) -> None:
    """Block until every kernel queued on `device` has finished; a no-op for host memory."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def finish(device: torch.device) -> None:
    """Block until the engine thread's stream on `device` is done; a no-op for host memory."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class StreamOrdered:
    """Wraps a backend that works on device memory in place (CUDA-aware MPI, NCCL) with the
    stream waits described in the module docstring."""

    def __init__(self, inner):
        self.inner = inner

    def execute(
        self, batch: List[Response], entries: List[Optional[Entry]], *fusion_limits
    ) -> list:
        """Run one batch on device memory. Synchronization: the device, then the inner backend's
        collectives, then the engine thread's stream."""
        device = local_device(batch, entries)
        wait_producers(device)
        results = self.inner.execute(batch, entries, *fusion_limits)
        finish(device)
        return results


class StagedBackend:
    """Runs device batches on a host backend through host copies of the tensors.

    For each batch: wait for the producers, copy inputs to (pinned) host buffers, run the host
    backend on a copy of the batch that says 'cpu', copy results to the device (into the
    caller's output tensor where the op has one), then wait for those copies. Host buffers come
    from torch's caching pinned allocator.

    An allreduce (not Adasum) crosses as one flat tensor per op, whatever its parts: flattened
    on the device, one copy each way, one part for the host backend (gloo pays about 3 ms a
    call; per part, the ResNet-18 gradient set took 105 ms there against 46 as one), and
    Average's 1/size and the postscale applied on the device where the host would reduce in
    the tensor's own dtype (a 16-bit sum widened by MPI is scaled before it is narrowed, so it
    stays on the host). Every rank rewrites a response the same way, joined ranks included.
    The host backend must offer `size` and `reduce_dtype(dtype, device)` (HostBackend does).
    """

    _MEMO_LIMIT = 1024

    def __init__(self, inner, pin_memory: bool = True):
        self.inner = inner
        self.pin_memory = pin_memory
        # id(response) -> (response, its flat host form, post factor moved to the device): a
        # cached response comes back as the same object every step, so the host backend's
        # plan for it is made once.
        self._flat: dict = {}

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin_memory)
        host.copy_(t)
        return host

    def _host_parts(self, entry: Entry) -> Entry:
        """An allreduce's parts flattened on the device into one tensor, copied to host once,
        and viewed there as the parts again; results come back the same way (_back)."""
        flat = torch.cat([t.reshape(-1) for t in entry.tensor])
        host = self._to_host(flat)
        views = [
            v.view(t.shape)
            for v, t in zip(host.split([t.numel() for t in entry.tensor]), entry.tensor)
        ]
        return Entry(
            entry.request._replace(device="cpu"), views, views, entry.extra, entry.cache_key
        )

    def _host_entry(self, entry: Optional[Entry]) -> Optional[Entry]:
        if entry is None:
            return None
        if isinstance(entry.tensor, list):
            return self._host_parts(entry)
        tensor = None if entry.tensor is None else self._to_host(entry.tensor)
        if entry.output is None or entry.output is entry.tensor:
            output = None if entry.output is None else tensor
        else:  # every op with a separate output overwrites it: no need to copy it over
            output = torch.empty(
                entry.output.shape,
                dtype=entry.output.dtype,
                device="cpu",
                pin_memory=self.pin_memory,
            )
        return Entry(
            entry.request._replace(device="cpu"), tensor, output, entry.extra, entry.cache_key
        )

    def _back(self, result, host_entry: Optional[Entry], entry: Optional[Entry], device):
        if isinstance(result, list):  # allreduce parts: one copy of the whole bucket back
            flat = torch.cat([r.reshape(-1) for r in result]).to(device)
            sizes = [r.numel() for r in result]
            if entry is None:
                return [v.view(r.shape) for v, r in zip(flat.split(sizes), result)]
            torch._foreach_copy_([o.view(-1) for o in entry.output], list(flat.split(sizes)))
            return entry.output
        if isinstance(result, tuple):  # alltoall: (rows, received splits); splits stay on host
            return (self._back(result[0], host_entry, entry, device),) + result[1:]
        if not isinstance(result, torch.Tensor):
            return result
        if entry is not None and host_entry is not None and result is host_entry.output:
            entry.output.copy_(result)
            return entry.output
        return result.to(device)

    def _flat_response(self, resp: Response, size: int):
        """(host response carrying the op as one flat part, factor left for the device)."""
        hit = self._flat.get(id(resp))
        if hit is not None and hit[0] is resp:
            return hit[1], hit[2]
        if len(self._flat) >= self._MEMO_LIMIT:
            self._flat.clear()
        req = resp.request
        total = sum(math.prod(s) for s in part_shapes(req))
        host_req = req._replace(device="cpu", parts=(), shape=(total,))
        dtype = dtypes.BY_NAME[req.dtype]
        post = 1.0
        if (
            req.reduce_op in (ReduceOp.SUM, ReduceOp.AVERAGE)
            and dtype.is_floating_point
            and self.inner.reduce_dtype(dtype, torch.device("cpu")) is dtype
        ):
            post = scaling.after_factor(req.reduce_op, req.postscale, size)
            host_req = host_req._replace(reduce_op=ReduceOp.SUM, postscale=1.0)
        host = resp._replace(request=host_req)
        self._flat[id(resp)] = (resp, host, post)
        return host, post

    def _allreduce(self, batch, entries, device, fusion_limits) -> list:
        """An allreduce batch, each op as one flat tensor: device cat, one copy to host, the
        host backend, one copy back, the factor moved to the device, split into the outputs."""
        size = self.inner.size
        flat = [self._flat_response(r, size) for r in batch]
        host_entries: List[Optional[Entry]] = []
        for (host, _), entry in zip(flat, entries):
            if entry is None:
                host_entries.append(None)
                continue
            parts = entry.tensor
            src = (
                parts[0].reshape(-1)
                if len(parts) == 1
                else torch.cat([t.reshape(-1) for t in parts])
            )
            buf = self._to_host(src)
            host_entries.append(Entry(host.request, [buf], [buf], entry.extra, entry.cache_key))
        results = self.inner.execute([h for h, _ in flat], host_entries, *fusion_limits)
        out = []
        for resp, (_, post), entry, result in zip(batch, flat, entries, results):
            back = result[0].to(device)  # a joined rank's too: the others' sum, as on the host
            if post != 1.0:
                scaling.scale_(back, post)
            shapes = part_shapes(resp.request)
            pieces = back.split([math.prod(s) for s in shapes])
            if entry is None:
                out.append([p.view(s) for p, s in zip(pieces, shapes)])
                continue
            torch._foreach_copy_([o.view(-1) for o in entry.output], list(pieces))
            out.append(entry.output)
        return out

    def execute(
        self, batch: List[Response], entries: List[Optional[Entry]], *fusion_limits
    ) -> list:
        """Run one device batch through host memory. Synchronization: the device, the host
        backend's collectives, then the copies back."""
        device = local_device(batch, entries)
        wait_producers(device)
        req = batch[0].request
        if batch[0].op == OpType.ALLREDUCE and req.reduce_op != ReduceOp.ADASUM:
            out = self._allreduce(batch, entries, device, fusion_limits)
            finish(device)
            return out
        host_batch = [
            r._replace(request=r.request._replace(device="cpu")) if r.request else r for r in batch
        ]
        host_entries = [self._host_entry(e) for e in entries]
        results = self.inner.execute(host_batch, host_entries, *fusion_limits)
        out = [self._back(r, h, e, device) for r, h, e in zip(results, host_entries, entries)]
        finish(device)
        return out
