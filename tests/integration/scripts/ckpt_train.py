"""Train to a step count; or stop at step K after a checkpoint (rank 1 SIGKILLs itself); or resume.

Usage: ckpt_train.py MODE STEPS K CHECKPOINT OUT, MODE in full | part | resume | resume_norng.
"""

import os
import signal
import sys

from ckpt_common import seed_rank, setup, step, write_result

import mpidp
from mpidp import checkpoint

mode, steps, kill_at, path, out = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    sys.argv[4],
    sys.argv[5],
)
mpidp.init()
rank = mpidp.rank()
seed_rank(rank)
model, opt, sampler, loader = setup()
epoch, done = 0, 0
if mode.startswith("resume"):
    rest = checkpoint.load(
        path, restore_rng=(mode == "resume"), model=model, optimizer=opt, sampler=sampler
    )
    epoch, done = rest["epoch"], rest["step"]
    print(f"rank {rank}: resumed at step {done} epoch {epoch}", flush=True)
while done < steps:
    sampler.set_epoch(epoch)
    for i, (x, y) in enumerate(loader):
        step(model, opt, x, y)
        sampler.record_batch(i, x.shape[0])
        done += 1
        if mode == "part" and done == kill_at:
            checkpoint.save(
                path, model=model, optimizer=opt, sampler=sampler, epoch=epoch, step=done
            )
            print(f"rank {rank}: saved at step {done}", flush=True)
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        if done == steps:
            break
    else:
        epoch += 1
write_result(model, out)
print(f"rank {rank}: finished {done} steps", flush=True)
