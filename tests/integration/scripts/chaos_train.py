"""Train a small model with a checkpoint every step, resuming from it; one fault on one rank at a
step (tests/integration/chaos.py): kill, term, raise, datapath, stall, disk (fill the checkpoint's
file system)."""

import argparse
import os
import signal
import socket
import sys
import time
import zlib

import torch

import mpidp
import mpidp.checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint", required=True)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument(
    "--fault",
    default="none",
    choices=["none", "kill", "term", "raise", "datapath", "stall", "disk"],
)
parser.add_argument("--fault-rank", type=int, default=1)
parser.add_argument("--fault-step", type=int, default=3)
parser.add_argument("--tag", default="", help="marks this job's processes for the orphan check")
args = parser.parse_args()

mpidp.init()
rank = mpidp.rank()
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4)
)
opt = mpidp.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
    named_parameters=model.named_parameters(),
)
mpidp.broadcast_parameters(model.state_dict(), root_rank=0)
start = 0
if os.path.exists(args.checkpoint):
    # The corrupt trial's fault is met here: its time bound runs from this stamp, not from a
    # launch whose start-up (4 ranks importing torch on 2 cores) alone can take seconds.
    print(f"chaos: loading {args.checkpoint} at {time.time()}", flush=True)
    start = mpidp.checkpoint.load(args.checkpoint, model=model, optimizer=opt)["step"]
    print(f"rank {rank}: resumed at step {start}", flush=True)


def fault() -> None:
    # The runner times the job's end from this line.
    print(
        f"chaos: {args.fault} on rank {rank} ({socket.gethostname()}) at step {args.fault_step} "
        f"at {time.time():.3f}",
        flush=True,
    )
    if args.fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.fault == "term":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
    if args.fault == "raise":
        raise RuntimeError(f"injected failure on rank {rank} at step {args.fault_step}")
    if args.fault == "stall":
        time.sleep(3600)  # a rank stuck in data loading or a deadlock
    if args.fault == "datapath":
        host = mpidp.runtime.world.state().engine.backend.routes["cpu"]

        def broken(*_args, **_kwargs):
            raise MemoryError("injected failure in the data path")

        host._allreduce_packed = broken
    if args.fault == "disk":
        # Fill the checkpoint's file system (a small tmpfs) so this step's save finds no room.
        filler = os.path.join(os.path.dirname(args.checkpoint), "filler")
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 16))
                    f.flush()
            except OSError:
                pass


for step in range(start, args.steps):
    if args.fault != "none" and step == args.fault_step and rank == args.fault_rank:
        fault()
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    mpidp.checkpoint.save(args.checkpoint, model=model, optimizer=opt, step=step + 1)

sums = [zlib.crc32(p.detach().numpy().tobytes()) for p in model.parameters()]
if rank == 0:
    print(f"final {sums}", flush=True)
mpidp.shutdown()
sys.exit(0)
