"""Five allreduces, then rank 1 dies (os._exit, no shutdown) and the launcher ends the job while
rank 0 goes on: rank 0's timeline must hold the five ops' events."""

import os
import sys

import torch

import mpidp

mpidp.init()
for i in range(5):
    mpidp.allreduce(torch.ones(4), name=f"before.{i}")
if mpidp.rank() == 1:
    os._exit(int(sys.argv[1]))
for i in range(50):
    try:
        mpidp.allreduce(torch.ones(4), name=f"after.{i}")
    except mpidp.MpidpError:
        pass
