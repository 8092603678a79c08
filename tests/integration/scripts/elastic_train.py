"""elastic.run training that commits every C steps; rank 1 may SIGKILL itself at step D.

Usage: elastic_train.py STEPS C D OUT (D = 0: never). The commit path comes from
MPIDP_ELASTIC_CHECKPOINT, so a second launch of the same command resumes from the last commit.
"""

import os
import signal
import sys

from ckpt_common import seed_rank, setup, step, write_result

import mpidp
from mpidp import elastic

steps, every, die_at = (int(a) for a in sys.argv[1:4])
out = sys.argv[4]
mpidp.init()
rank = mpidp.rank()
seed_rank(rank)
model, opt, sampler, loader = setup()
state = elastic.TorchState(model, opt, sampler=sampler, epoch=0, step=0)
state.register_reset_callbacks([lambda: print(f"rank {rank}: reset callback", flush=True)])


@elastic.run
def train(state):
    print(f"rank {rank}: start at step {state.step} epoch {state.epoch}", flush=True)
    while state.step < steps:
        state.sampler.set_epoch(state.epoch)
        for i, (x, y) in enumerate(loader):
            step(state.model, state.optimizer, x, y)
            state.sampler.record_batch(i, x.shape[0])
            state.step += 1
            if state.step % every == 0:
                state.commit()
                print(f"rank {rank}: committed step {state.step}", flush=True)
            if state.step == die_at and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step == steps:
                break
        else:
            state.epoch += 1


train(state)
write_result(model, out)
print(f"rank {rank}: finished {state.step} steps", flush=True)
