"""A short tour of mpidp's engine: every collective once, asynchrony, and the blocking latency.

Run with: mpiexec -n 2 python examples/engine_demo.py
"""

import time

import torch

import mpidp


def main():
    mpidp.init()
    rank, size = mpidp.rank(), mpidp.size()

    x = torch.full((4,), float(rank + 1))
    results = {
        "allreduce Sum": mpidp.allreduce(x, op=mpidp.Sum, name="demo.sum"),
        "allreduce Average": mpidp.allreduce(x, name="demo.avg"),
        "allgather (rank r sends r+1 rows)": mpidp.allgather(torch.full((rank + 1,), rank)),
        "broadcast from the last rank": mpidp.broadcast(torch.tensor([rank]), size - 1),
        "alltoall": mpidp.alltoall(torch.arange(2 * size) + 100 * rank),
        "reducescatter Sum of ones": mpidp.reducescatter(torch.ones(size + 1), op=mpidp.Sum),
    }

    # Submit many ops at once; the engine negotiates them together and fuses the small ones.
    handles = [
        mpidp.allreduce_async(torch.full((1000,), float(i)), name=f"demo.async.{i}", op=mpidp.Sum)
        for i in range(32)
    ]
    pending_at_submit = sum(not mpidp.poll(h) for h in handles)
    sums = [mpidp.synchronize(h)[0].item() for h in handles]
    assert sums == [float(i * size) for i in range(32)], sums

    one = torch.ones(1)
    for _ in range(200):
        mpidp.allreduce(one, name="demo.latency")
    start = time.perf_counter()
    n = 1000
    for _ in range(n):
        mpidp.allreduce(one, name="demo.latency")
    latency_us = (time.perf_counter() - start) / n * 1e6

    # Every rank's figure goes to rank 0, which prints one block instead of interleaved lines.
    views = mpidp.allgather(torch.tensor([latency_us]))
    if rank == 0:
        print(f"mpidp engine demo: {size} ranks")
        for label, value in results.items():
            print(f"  {label:36s} {value.tolist()}")
        print(
            f"  32 async allreduces: {pending_at_submit} still pending right after "
            f"submission, all correct after synchronize"
        )
        print(
            f"  blocking 4-byte allreduce latency per rank (us): "
            f"{[round(v, 1) for v in views.tolist()]}"
        )
    mpidp.shutdown()


if __name__ == "__main__":
    main()
