"""Stream ordering on CUDA tensors: inputs written on a side stream that is still busy when the op
is submitted, results read on another stream right after synchronize(), no device synchronize
in between (docs/data_paths.md, "Stream ordering"). A race shows as a sum of stale inputs.

On cpu the same ops and assertions run with no streams (a check of the values alone); the cuda
case is what this file is for, and runs where a GPU is present (devices.py).
"""

import contextlib

import pytest
import torch
from mpi_util import assert_all, rank, size, tensor_diff

import mpidp

STALE = -1000.0  # what a tensor holds before its producer's kernel has run
N = 1 << 16


def _streams(device):
    """(producer, consumer) streams, or two null contexts on the host."""
    if device.type != "cuda":
        return contextlib.nullcontext, contextlib.nullcontext
    prod, cons = torch.cuda.Stream(device), torch.cuda.Stream(device)
    return (lambda: torch.cuda.stream(prod)), (lambda: torch.cuda.stream(cons))


def _late(value, device, producer):
    """A tensor holding STALE now and `value` once the producer stream, kept busy first, gets to
    it. Its memory is written on the current stream and synchronized, so a stale read is STALE."""
    x = torch.full((N,), STALE, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with producer():
        if device.type == "cuda":
            torch.cuda._sleep(100_000_000)  # ~0.05-0.1 s of GPU time before the write
        x.fill_(value)
    return x


def _consume(t, consumer):
    """`t` as read on the consumer stream (the copy to the host is ordered on that stream
    alone)."""
    with consumer():
        return (t * 1).cpu()


@pytest.mark.mpi
@pytest.mark.parametrize("form", ["async", "blocking_on_producer_stream", "in_place", "grouped"])
def test_allreduce_waits_for_the_producer_stream(device, form):
    producer, consumer = _streams(device)
    n, me = size(), rank()
    name = f"test_cuda_streams.allreduce.{form}"
    x = _late(float(me + 1), device, producer)
    if form == "async":
        out = mpidp.synchronize(mpidp.allreduce_async(x, op=mpidp.Sum, name=name))
    elif form == "blocking_on_producer_stream":
        with producer():  # the engine may run on this thread, with this stream current
            out = mpidp.allreduce(x, op=mpidp.Sum, name=name)
    elif form == "in_place":
        mpidp.synchronize(mpidp.allreduce_async_(x, op=mpidp.Sum, name=name))
        out = x
    else:
        y = _late(float(2 * (me + 1)), device, producer)
        out, out2 = mpidp.grouped_allreduce([x, y], op=mpidp.Sum, name=name)
        want2 = torch.full((N,), float(n * (n + 1)))
    want = torch.full((N,), float(n * (n + 1) // 2))
    problems = [tensor_diff(_consume(out, consumer), want)]
    if form == "grouped":
        problems.append(tensor_diff(_consume(out2, consumer), want2))
    problems = [p for p in problems if p]
    assert_all(not problems, f"{form}: {'; '.join(problems)}")


@pytest.mark.mpi
def test_allgather_and_broadcast_wait_for_the_producer_stream(device):
    producer, consumer = _streams(device)
    n, me = size(), rank()
    gathered = mpidp.allgather(
        _late(float(me), device, producer).view(1, N), name="test_cuda_streams.allgather"
    )
    root = n - 1
    sent = _late(float(7 + me), device, producer)
    got = mpidp.broadcast(sent, root_rank=root, name="test_cuda_streams.broadcast")
    problems = [
        tensor_diff(
            _consume(gathered, consumer),
            torch.arange(n, dtype=torch.float32).view(n, 1).expand(n, N),
        ),
        tensor_diff(_consume(got, consumer), torch.full((N,), float(7 + root))),
    ]
    problems = [p for p in problems if p]
    assert_all(not problems, "; ".join(problems))
