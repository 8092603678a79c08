"""A job to interrupt with Ctrl-C: idle, training flat out, or training and catching Ctrl-C to
save a checkpoint before it ends (every rank prints 'saved' then)."""

import argparse
import faulthandler
import os
import time

import torch

import mpidp

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["idle", "busy", "catch"])
parser.add_argument("--checkpoint", default="")
args = parser.parse_args()

mpidp.init()
model = torch.nn.Linear(64, 64)
opt = mpidp.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
)
print(f"ready {mpidp.rank()} {os.getpid()}", flush=True)


def train_forever():
    # Back to back: the main thread spends most of its time driving the engine's cycles.
    while True:
        opt.zero_grad()
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        mpidp.allreduce(torch.ones(4), name="interrupt.metric")


if args.mode == "idle":
    while True:
        time.sleep(0.05)
elif args.mode == "busy":
    train_forever()
else:
    try:
        train_forever()
    except KeyboardInterrupt:
        # A save that hangs shows every thread's stack (a hang once seen in CI, never here).
        faulthandler.dump_traceback_later(20)
        mpidp.checkpoint.save(args.checkpoint, model=model, optimizer=opt)
        faulthandler.cancel_dump_traceback_later()
        print(f"saved {mpidp.rank()}", flush=True)
