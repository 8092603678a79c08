"""Five allreduces, then rank 1 dies (os._exit, no shutdown) and the launcher ends the job while
rank 0 goes on: rank 0's timeline must hold the five ops' events.

Rank 1 waits 0.1 s before it dies: the timeline promises its events reach the file within
milliseconds of the op (its writer coalesces for 5 ms), not before the op returns, and the
launcher's SIGKILL can reach rank 0 within a millisecond of rank 1's exit. 0.1 s is 20 times that
window and shorter than the 0.25 s period at which events were once written, so a writer that
only flushed periodically would still fail most runs."""

import os
import sys
import time

import torch

import mpidp

mpidp.init()
for i in range(5):
    mpidp.allreduce(torch.ones(4), name=f"before.{i}")
if mpidp.rank() == 1:
    time.sleep(0.1)
    os._exit(int(sys.argv[1]))
for i in range(50):
    try:
        mpidp.allreduce(torch.ones(4), name=f"after.{i}")
    except mpidp.MpidpError:
        pass
