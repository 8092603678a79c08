"""Rank 0 shuts down while the others wait on an op: they must fail promptly, not hang."""

import time

import torch

import mpidp

mpidp.init()
rank = mpidp.rank()
if rank == 0:
    time.sleep(0.5)
    mpidp.shutdown()
    print("rank 0: shut down", flush=True)
else:
    try:
        mpidp.allreduce(torch.ones(1), name="never.on.rank0")
        print(f"rank {rank}: unexpectedly completed", flush=True)
    except mpidp.EngineShutdownError as exc:
        print(f"rank {rank}: EngineShutdownError: {exc}", flush=True)
    try:
        mpidp.allreduce(torch.ones(1), name="after")
    except mpidp.EngineShutdownError as exc:
        print(f"rank {rank}: later op refused: {exc}", flush=True)
    mpidp.shutdown()
