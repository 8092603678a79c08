"""CUDA data paths: does MPI take device buffers, stream ordering, staging through host memory.

None of the CUDA-specific lines here has run on a GPU (this project's machines have none); the
staging logic runs in tests as its CPU twin (`StagedBackend(inner, pin_memory=False)` on CPU
tensors, where the "device" copies are CPU to CPU and the stream waits are no-ops).

Stream ordering, conservatively: the engine runs on its own thread, whose current stream is not
the stream that produced a tensor (ops/ records none), so before a batch touches device memory
the whole device is synchronized (every stream, the producer's included). After the batch, the
engine thread's stream is synchronized before the handles complete, so a consumer on any stream
that waits for the handle sees the result. Recording a CUDA event at submission and waiting on
that event alone would be cheaper; it needs ops/ to record one.
"""

from typing import List, Optional

import torch

from .. import mpi_library
from ..messages import Response
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
    caller's output tensor where the op has one), then wait for those copies. A fresh host
    buffer per batch: simple, and the copies dominate anyway; a pinned pool would save the
    allocations.
    """

    def __init__(self, inner, pin_memory: bool = True):
        self.inner = inner
        self.pin_memory = pin_memory

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

    def execute(
        self, batch: List[Response], entries: List[Optional[Entry]], *fusion_limits
    ) -> list:
        """Run one device batch through host memory. Synchronization: the device, the host
        backend's collectives, then the copies back."""
        device = local_device(batch, entries)
        wait_producers(device)
        host_batch = [
            r._replace(request=r.request._replace(device="cpu")) if r.request else r for r in batch
        ]
        host_entries = [self._host_entry(e) for e in entries]
        results = self.inner.execute(host_batch, host_entries, *fusion_limits)
        out = [self._back(r, h, e, device) for r, h, e in zip(results, host_entries, entries)]
        finish(device)
        return out
