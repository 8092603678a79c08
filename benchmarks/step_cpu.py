"""Where a training step's CPU goes: per rank, the step's wall time and the process's user and
system CPU per step, split between the training thread and the others (mpidp's engine).

    mpiexec -hosts hosta:1,hostb:1 -n 2 python benchmarks/step_cpu.py \
        [--models resnet18,mlp6.3M,wide12.6M] [--modes none,fp32,fp16] [--steps 8]

On the test cluster (tests/integration/multihost_cluster.py) every host shares this machine's
cores, so the kernel's work for each byte on the link competes with the compute: a step whose
CPU per rank is close to its wall time has no core to spare, and no overlap can hide more. The
modes: `none` (the wrapped optimizer alone, no communication), `fp32` (DistributedOptimizer),
`fp16` (with Compression.fp16). Each mode builds its model afresh; two steps warm up.
"""

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cluster_step  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
WARMUP = 2


def thread_cpu():
    """(user s, system s) of the training thread and of all the others, from /proc."""
    main, rest = [0.0, 0.0], [0.0, 0.0]
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:  # a thread that ended meanwhile
            continue
        into = main if int(tid) == os.getpid() else rest
        into[0] += int(fields[11]) / TICK
        into[1] += int(fields[12]) / TICK
    return main + rest


def measure(mpidp, comm, model_name, mode, steps):
    """Median wall time of `steps` steps, and CPU per step: process user and system, and
    [training thread user, system, other threads user, system]."""
    build, make_input, batch, classes = cluster_step.MODELS[model_name]
    torch.manual_seed(0)
    model = build()
    g = torch.Generator().manual_seed(1 + comm.rank)
    x, y = make_input(batch), torch.randint(0, classes, (batch,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if mode != "none":
        opt = mpidp.DistributedOptimizer(
            opt,
            named_parameters=model.named_parameters(),
            compression=mpidp.Compression.fp16 if mode == "fp16" else mpidp.Compression.none,
        )
    walls, users, syss = [], [], []
    threads0 = None
    for i in range(steps + WARMUP):
        comm.Barrier()
        if i == WARMUP:
            threads0 = thread_cpu()
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        if i >= WARMUP:
            walls.append(wall)
            users.append(r1.ru_utime - r0.ru_utime)
            syss.append(r1.ru_stime - r0.ru_stime)
    threads = [(b - a) / steps for a, b in zip(threads0, thread_cpu())]
    return statistics.median(walls), statistics.median(users), statistics.median(syss), threads


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="resnet18,mlp6.3M,wide12.6M")
    parser.add_argument("--modes", default="none,fp32,fp16")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from mpi4py import MPI

    import mpidp

    mpidp.init()
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        print(
            "model       mode  rank   wall ms  user ms  sys ms  CPU/wall   "
            "training thread u/s ms   other threads u/s ms"
        )
    for model_name in args.models.split(","):
        for mode in args.modes.split(","):
            got = comm.gather(measure(mpidp, comm, model_name, mode, args.steps), root=0)
            if comm.rank != 0:
                continue
            for r, (wall, user, sys_, th) in enumerate(got):
                print(
                    f"{model_name:11s} {mode:5s} {r:4d} {wall * 1e3:9.1f} {user * 1e3:8.1f} "
                    f"{sys_ * 1e3:7.1f} {(user + sys_) / wall:9.2f}   "
                    f"{th[0] * 1e3:9.0f} / {th[1] * 1e3:<9.0f}   "
                    f"{th[2] * 1e3:9.0f} / {th[3] * 1e3:.0f}"
                )
    mpidp.shutdown()


if __name__ == "__main__":
    main()
