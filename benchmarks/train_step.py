"""Training-step time side by side: no communication, mpidp, DDP (gloo), hand-written MPI.

    mpiexec -n 2 python benchmarks/train_step.py [--rounds 6] [--steps 8] [--json out.json]
        [--overlap-ab]

One torch thread per rank. Each round runs every contender for --steps steps on its own copy of
the model (same initial weights), in a rotating order; medians over all rounds are reported with
ratios: mpidp / the best hand-written MPI strategy after backward (per-tensor: one in-place
Allreduce per gradient; hybrid: gradients < 64 KB packed into one buffer, larger ones in place in
4 MB chunks), DDP step / mpidp step, DDP over backend "mpidp" (mpidp.distributed) against DDP
over gloo and against mpidp's own optimizer (also with DDP's gradient_as_bucket_view, which
saves DDP's copies into and out of its buckets, and with a comm hook that reduces nothing: DDP's
own work, a floor no backend lowers), and scaling efficiency (no-communication step / mpidp
step).
--overlap-ab adds two mpidp contenders that overlap reductions with backward and that do not,
whatever MPIDP_OVERLAP's auto picks here (docs: README, MPIDP_OVERLAP).
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
from rounds import order as rounds_order  # noqa: E402

import mpidp  # noqa: E402

MODELS = {
    "resnet18": (models.ResNet18, lambda b: torch.randn(b, 3, 32, 32), 16, 1000),
    "mlp6.3M": (models.mlp, lambda b: torch.randn(b, 1024), 32, 10),
}


def workload(name):
    """(model, input batch, labels) of MODELS[name], seeded: the same on every rank and run."""
    make, make_input, batch, classes = MODELS[name]
    torch.manual_seed(0)
    return make(), make_input(batch), torch.randint(0, classes, (batch,))


MPIDP_GROUP = []  # torch.distributed group on backend "mpidp", beside gloo's default group


def setup_gloo(comm):
    """torch.distributed with gloo for the DDP contender, rendezvous address sent over MPI."""
    port = comm.bcast(29500 + os.getpid() % 1000 if comm.rank == 0 else None, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
    import mpidp.distributed  # noqa: F401  (registers backend "mpidp")

    MPIDP_GROUP.append(dist.new_group(backend="mpidp"))


class Contender:
    def __init__(self, name, model, optimizer, after_backward=None):
        self.name, self.model, self.optimizer = name, model, optimizer
        self.after_backward = after_backward
        self.times = []

    def step(self, x, y):
        start = time.perf_counter()
        self.optimizer.zero_grad()
        F.cross_entropy(self.model(x), y).backward()
        if self.after_backward:
            self.after_backward()
        self.optimizer.step()
        return time.perf_counter() - start


def _no_reduction(_state, bucket):
    """A DDP comm hook that hands the bucket back as it came: what is left of a DDP step is
    DDP's own work (its copies into and out of the buckets, its hooks), which no backend saves."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def contenders(build, comm, overlap_ab=False):
    torch.manual_seed(0)
    base = build()
    size = comm.size

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

    out = []
    m = copy.deepcopy(base)
    out.append(Contender("no communication", m, sgd(m)))
    m = copy.deepcopy(base)
    out.append(
        Contender(
            "mpidp", m, mpidp.DistributedOptimizer(sgd(m), named_parameters=m.named_parameters())
        )
    )
    for mode in (("overlap", True), ("no overlap", False)) if overlap_ab else ():
        m = copy.deepcopy(base)
        opt = mpidp.DistributedOptimizer(sgd(m), named_parameters=m.named_parameters())
        opt._overlap = mode[1]  # what MPIDP_OVERLAP=1 / 0 would decide (mpidp/training/overlap.py)
        out.append(Contender(f"mpidp {mode[0]}", m, opt))
    m = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    out.append(Contender("DDP (gloo)", m, sgd(m)))
    m = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), process_group=MPIDP_GROUP[0])
    out.append(Contender("DDP (mpidp backend)", m, sgd(m)))
    m = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(base), process_group=MPIDP_GROUP[0], gradient_as_bucket_view=True
    )
    out.append(Contender("DDP (mpidp backend, bucket view)", m, sgd(m)))
    m = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), process_group=MPIDP_GROUP[0])
    m.register_comm_hook(None, _no_reduction)
    out.append(Contender("DDP (mpidp backend), no reduction", m, sgd(m)))
    m = copy.deepcopy(base)
    raw = comm.Dup()

    def per_tensor():
        for p in m.parameters():
            raw.Allreduce(MPI.IN_PLACE, p.grad.numpy())
            p.grad.div_(size)

    out.append(Contender("per-tensor MPI after backward", m, sgd(m), per_tensor))
    h = copy.deepcopy(base)
    small = [p for p in h.parameters() if p.numel() * 4 < 64 * 1024]
    large = [p for p in h.parameters() if p.numel() * 4 >= 64 * 1024]
    buf = torch.empty(sum(p.numel() for p in small))
    step = 4 * 1024 * 1024 // 4

    def hybrid():
        grads = [p.grad.view(-1) for p in small]
        torch.cat(grads, out=buf)
        raw.Allreduce(MPI.IN_PLACE, buf.numpy())
        buf.div_(size)
        torch._foreach_copy_(grads, list(buf.split([g.numel() for g in grads])))
        for p in large:
            flat = p.grad.view(-1)
            for lo in range(0, flat.numel(), step):
                part = flat[lo : lo + step]
                raw.Allreduce(MPI.IN_PLACE, part.numpy())
                part.div_(size)

    out.append(Contender("hybrid MPI after backward", h, sgd(h), hybrid))
    return out


def bench_model(name, comm, rounds, steps, overlap_ab):
    build, make_input, batch, classes = MODELS[name]
    runners = contenders(build, comm, overlap_ab)
    g = torch.Generator().manual_seed(comm.rank)
    x, y = make_input(batch), torch.randint(0, classes, (batch,), generator=g)
    for c in runners:  # warm-up: allocator, caches, mpidp's response cache (a torch.distributed
        for _ in range(5):  # call's 4 names, mpidp/distributed/naming.py)
            c.step(x, y)
    for r in range(rounds):
        for c in rounds_order(runners, r):
            comm.Barrier()
            c.times += [c.step(x, y) for _ in range(steps)]
    med = {c.name: statistics.median(c.times) * 1e3 for c in runners}
    # The slowest rank sets the pace: take each contender's max median over ranks.
    med = {k: max(v) for k, v in zip(med, zip(*comm.allgather(list(med.values()))))}
    return med


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--json")
    parser.add_argument(
        "--overlap-ab",
        action="store_true",
        help="also mpidp with and without overlap, side by side",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    mpidp.init()
    setup_gloo(comm)
    results = {}
    for name in args.models.split(","):
        results[name] = bench_model(name, comm, args.rounds, args.steps, args.overlap_ab)
    if comm.rank == 0:
        print(
            f"train step, np={comm.size}, 1 torch thread per rank, medians of "
            f"{args.rounds}x{args.steps} steps (ms)"
        )
        for name, med in results.items():
            base, ours, ddp = med["no communication"], med["mpidp"], med["DDP (gloo)"]
            raw = min(med["per-tensor MPI after backward"], med["hybrid MPI after backward"])
            print(f"\n{name}")
            for k, v in med.items():
                print(f"  {k:32s} {v:8.1f}")
            print(f"  mpidp / best hand-written MPI    {ours / raw:8.3f}   (goal <= 1.03)")
            for mode in ("overlap", "no overlap") if args.overlap_ab else ():
                print(f"  mpidp {mode:10s} / best hand-written {med[f'mpidp {mode}'] / raw:6.3f}")
            print(f"  DDP (gloo) / mpidp               {ddp / ours:8.3f}   (goal > 1)")
            on_us = med["DDP (mpidp backend)"]
            print(f"  DDP (mpidp backend) / DDP (gloo) {on_us / ddp:8.3f}   (goal <= 0.80)")
            print(f"  DDP (mpidp backend) / mpidp      {on_us / ours:8.3f}   (goal <= 1.05)")
            view = med["DDP (mpidp backend, bucket view)"]
            print(f"  the same, gradient_as_bucket_view {view / ours:7.3f}")
            bare = med["DDP (mpidp backend), no reduction"]
            print(f"  DDP, gradients not reduced / mpidp {bare / ours:6.3f}   (DDP's own work)")
            print(
                f"  scaling efficiency               {base / ours:8.3f}   (no communication "
                f"/ mpidp)"
            )
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=1)
    dist.destroy_process_group()
    mpidp.shutdown()


if __name__ == "__main__":
    main()
