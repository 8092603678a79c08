"""init, a few allreduces, rank 0 late to shutdown (the others' engines asleep or waiting), three
times over: every wake-up sent is received before the engine ends."""

import time

import torch

import mpidp

for _ in range(3):
    mpidp.init()
    for i in range(20):
        mpidp.allreduce(torch.ones(10), name=f"x{i % 3}")
    if mpidp.rank() == 0:
        time.sleep(0.3)
    mpidp.shutdown()
print("done", flush=True)
