"""Where a training step's time goes across hosts: each rank's engine calls, step by step.

    mpiexec -hosts hosta:1,hostb:1 -n 2 python benchmarks/step_calls.py --link-gbit 0.993 \
        [--model resnet18] [--compression fp16] [--steps 3] [--calls]
    (on `python -m tests.integration.multihost_cluster up 2 --profile 1gbe`; its `check`
    prints the link's measured rate)

One torch thread per rank, overlap forced on. After 4 untimed steps, each of --steps steps
records on every rank: the forward pass, when each gradient is ready (hooks registered before
DistributedOptimizer's, which keep its overlap: a hook registered after it holds its bucket to
the end of backward), every data reduction the engine runs (`mpi.allreduce`: start, end,
bytes) and every negotiation round that waited more than 1 ms (`mpi.allreduce_band`), the end
of backward (every reduction is done by then) and of the update. Per step it prints the bound
that the gradients' ready times and the wire set on the reductions' end: the latest, over the
gradients, of the time the last rank had it plus the wire's time for it and every gradient
ready after it (each byte of a reduction crosses each way 2(n-1)/n times; 16 bits an element
with --compression), the time the last reduction ended, and the difference; then per rank the
phases. --calls also lists every call. Synchronization: a barrier before each step, and
gathers to rank 0 after it.

This wraps two functions of mpidp's engine (engine/mpi/calls.py) with timestamps; it measures
mpidp as it is, with that wrapping's few microseconds per call added.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_step import MODELS  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", choices=sorted(MODELS))
    parser.add_argument("--compression", default="none", choices=("none", "fp16", "bf16"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--link-gbit", type=float, required=True, help="the link's rate")
    parser.add_argument(
        "--large", type=int, default=200_000, help="--calls lists gradients this large"
    )
    parser.add_argument("--calls", action="store_true", help="list every call")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from mpi4py import MPI

    import mpidp
    from mpidp.engine import mpi as engine_mpi

    mpidp.init()
    comm = MPI.COMM_WORLD
    log = []
    allreduce, band = engine_mpi.allreduce, engine_mpi.allreduce_band

    def timed_allreduce(c, send, recv, op, *rest, **kw):
        start = time.perf_counter()
        allreduce(c, send, recv, op, *rest, **kw)
        log.append(("reduce", start, time.perf_counter(), getattr(recv, "nbytes", 0)))

    def timed_band(*a, **kw):
        start = time.perf_counter()
        band(*a, **kw)
        if time.perf_counter() - start > 1e-3:
            log.append(("band", start, time.perf_counter(), 0))

    engine_mpi.allreduce, engine_mpi.allreduce_band = timed_allreduce, timed_band

    build, make_input, batch, classes = MODELS[args.model]
    torch.manual_seed(0)
    model = build()
    ready = []
    params = list(model.parameters())
    for i, p in enumerate(params):  # before the optimizer's hooks, so as to keep its overlap
        p.register_post_accumulate_grad_hook(lambda p, i=i: ready.append((time.perf_counter(), i)))
    compression = getattr(mpidp.Compression, args.compression)
    opt = mpidp.DistributedOptimizer(
        torch.optim.SGD(params, lr=0.01, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=compression,
    )
    opt._overlap = True  # what MPIDP_OVERLAP=1 decides (mpidp/training/overlap.py)
    g = torch.Generator().manual_seed(comm.rank)
    x, y = make_input(batch), torch.randint(0, classes, (batch,), generator=g)
    # Seconds on the wire per element of each gradient: 2(n-1)/n crossings each way.
    per_byte = 2 * (comm.size - 1) / comm.size / (args.link_gbit * 1e9 / 8)
    width = [2 if args.compression != "none" else p.element_size() for p in params]
    wire = [p.numel() * w * per_byte for p, w in zip(params, width)]
    for _ in range(4):
        comm.Barrier()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    beyond = []
    for step in range(args.steps):
        comm.Barrier()
        log.clear()
        ready.clear()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()

        def ms(t):
            return 1e3 * (t - t0)

        reduces = [b for kind, _, b, _ in log if kind == "reduce"]
        mine = {
            "forward": ms(t1),
            "last": ms(max(reduces, default=t2)),
            "backward": ms(t2),
            "step": ms(t3),
            "ready": {i: ms(t) for t, i in ready},
            "calls": [(kind, ms(a), ms(b), n) for kind, a, b, n in log],
        }
        every = comm.gather(mine)
        if comm.rank != 0:
            continue
        # Each gradient is ready everywhere once the last rank has it; the link must still
        # carry it and every gradient ready after it.
        when = {i: max(d["ready"].get(i, d["backward"]) for d in every) for i in range(len(params))}
        order = sorted(when, key=when.get, reverse=True)
        bound, behind = 0.0, 0.0
        for i in order:
            behind += 1e3 * wire[i]
            bound = max(bound, when[i] + behind)
        last = max(d["last"] for d in every)
        beyond.append(last - bound)
        print(
            f"== step {step} ({args.model}, compression {args.compression}): the reductions "
            f"could end at {bound:.1f} ms (ready times and the wire), ended at {last:.1f}: "
            f"{last - bound:+.1f} ms"
        )
        for r, d in enumerate(every):
            print(
                f"rank {r}: forward {d['forward']:.1f}, last reduction done {d['last']:.1f}, "
                f"backward done {d['backward']:.1f}, step {d['step']:.1f} ms"
            )
            if args.calls:
                large = sorted(
                    (t, params[i].numel())
                    for i, t in d["ready"].items()
                    if params[i].numel() >= args.large
                )
                print("  ready: " + " ".join(f"{t:.0f}:{n // 1000}k" for t, n in large))
                print(
                    "  calls: "
                    + " ".join(
                        f"{k[0].upper()}{a:.0f}-{b:.0f}" + (f"/{n // 1000}kB" if n else "")
                        for k, a, b, n in d["calls"]
                    )
                )
    if comm.rank == 0:
        print(
            f"the reductions ended {statistics.median(beyond):+.1f} ms (median of "
            f"{len(beyond)} steps) after the bound that ready times and the wire set"
        )


if __name__ == "__main__":
    main()
