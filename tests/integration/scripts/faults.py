"""Train a small model; one fault on one rank at a step: raise, kill, stall, engine (its error
raised, or caught and the script ended normally), datapath."""

import argparse
import os
import signal
import sys
import time

import torch

import mpidp

parser = argparse.ArgumentParser()
parser.add_argument(
    "mode", choices=["none", "raise", "kill", "stall", "engine", "engine_caught", "datapath"]
)
parser.add_argument("--rank", type=int, default=1)
parser.add_argument("--step", type=int, default=3)
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()

mpidp.init()
rank, size = mpidp.rank(), mpidp.size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = mpidp.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
)
mpidp.broadcast_parameters(model.state_dict(), root_rank=0)
data = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))


def fault() -> None:
    print(
        f"rank {rank}: injecting {args.mode} at step {args.step} at {time.time():.3f}", flush=True
    )
    if args.mode == "raise":
        raise RuntimeError(f"injected failure on rank {rank} at step {args.step}")
    if args.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.mode == "stall":
        time.sleep(3600)  # stops submitting, as a rank stuck in data loading or a deadlock would
    if args.mode in ("engine", "engine_caught"):
        engine = mpidp.runtime.world.state().engine

        def broken_cycle(*args):
            raise OSError("injected engine failure")

        engine._cycle = broken_cycle
        time.sleep(0.5)  # let the engine thread reach its next cycle and die
        # Later ops on this rank must fail at once with the engine's error, not wait.
        try:
            mpidp.allreduce(torch.ones(1), name="after.engine.failure")
        except mpidp.EngineShutdownError as exc:
            print(f"rank {rank}: later op failed: {exc}", flush=True)
            if args.mode == "engine":
                raise
            sys.exit(0)  # quietly: no excepthook runs, only shutdown() at exit

    if args.mode == "datapath":
        host = mpidp.runtime.world.state().engine.backend.routes["cpu"]

        def broken_pack(*_args, **_kwargs):
            raise MemoryError("injected failure while packing a fusion buffer")

        host._allreduce_packed = broken_pack  # the gradients are small: they are packed


for step in range(args.steps):
    if step == args.step and rank == args.rank and args.mode != "none":
        fault()
    opt.zero_grad()
    loss = model(data).pow(2).mean()
    loss.backward()
    try:
        opt.step()
    except mpidp.MpidpError as exc:
        if args.mode != "datapath":
            raise
        # A script that catches the error and carries on must still not hang its peers.
        print(f"rank {rank}: step {step} failed: {exc}", flush=True)
    print(f"rank {rank}: step {step} done", flush=True)
    time.sleep(0.05)
print(f"rank {rank}: finished", flush=True)
sys.stdout.flush()
