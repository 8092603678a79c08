"""Autotune against the hand-set defaults on ResNet-18's gradients, side by side in one MPI job.

    mpiexec -n 2 python benchmarks/autotune.py [--rounds 7] [--steps 10] [--compute-ms 20]
        [--sample-s S] [--max-tune-s 240] [--log out/autotune_log.csv]

A step is what DistributedOptimizer does in a backward pass: ResNet-18's 62 gradient tensors
(11.7 M float32, benchmarks/allreduce.py's shapes) submitted with allreduce_async_ in reverse
layer order, with --compute-ms of simulated backward time spread evenly between the submissions
(a sleep, so the ranks' CPUs stay free for the engine as they would be while a real backward
waits on its own kernels), then synchronize() on every handle.

1. Tuning: mpidp.init(autotune=True, autotune_log=--log) and steps
   until rank 0's search ends (or --max-tune-s). Rank 0 prints what it chose and the search's
   samples are in the CSV log.
2. Comparison: "defaults" (mpidp.init() with no knobs) and "autotuned" (init with the chosen
   values set explicitly, which is where a tuned engine settles) alternate for --rounds rounds,
   the order rotated each round; a round runs --warmup untimed then --steps timed steps on a
   fresh engine. A sample is the slowest rank's mean step time; the table gives medians, the
   ratio defaults/autotuned (> 1: autotune is faster) and each engine's communication
   fraction (mpidp.stats_window: time in collectives / wall time) and tensors per collective.

The machine this runs on is shared: a neighbour's load moves both tuning and comparison, which
is why the search takes medians and the comparison alternates.
"""

import argparse
import os
import statistics
import sys
import time

import torch
from mpi4py import MPI

import mpidp
from mpidp.runtime import observe, world

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce import RESNET18_SHAPES  # noqa: E402

TUNED = ("fusion_threshold_bytes", "fuse_below_bytes", "cycle_time_ms")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--compute-ms",
        type=float,
        default=20.0,
        help="simulated backward time per step, spread between the submissions",
    )
    ap.add_argument(
        "--sample-s", type=float, default=None, help="autotune_sample_s (default: mpidp's)"
    )
    ap.add_argument("--max-tune-s", type=float, default=240.0)
    ap.add_argument("--log", default="out/autotune_log.csv", help="autotune CSV log (rank 0)")
    args = ap.parse_args()
    if min(args.rounds, args.steps) < 1 or args.warmup < 0 or args.compute_ms < 0:
        ap.error("--rounds and --steps must be >= 1, --warmup and --compute-ms >= 0")
    return args


class Step:
    """One simulated backward pass with gradient allreduces (reverse layer order)."""

    def __init__(self, compute_ms):
        self.grads = [torch.ones(s) for s in reversed(RESNET18_SHAPES)]
        self.names = [f"grad.{i}" for i in range(len(self.grads))]
        self.gap = compute_ms / 1000.0 / len(self.grads)

    def __call__(self):
        handles = []
        for g, name in zip(self.grads, self.names):
            if self.gap:
                time.sleep(self.gap)
            handles.append(mpidp.allreduce_async_(g, name=name, op=mpidp.Average))
        for h in handles:
            mpidp.synchronize(h)


def tune(comm, step, args):
    """Run steps under autotune until rank 0's search ends; returns (chosen, seconds, steps)."""
    if comm.rank == 0 and args.log:
        os.makedirs(os.path.dirname(os.path.abspath(args.log)), exist_ok=True)
        if os.path.exists(args.log):
            os.remove(args.log)
    knobs = {} if args.sample_s is None else {"autotune_sample_s": args.sample_s}
    mpidp.init(autotune=True, autotune_log=args.log if comm.rank == 0 else "", **knobs)
    engine = world.state().engine
    began = time.perf_counter()
    steps = 0
    while True:
        step()
        steps += 1
        elapsed = time.perf_counter() - began
        done = comm.bcast(engine.sampler.done if comm.rank == 0 else None, 0)
        if done or comm.bcast(elapsed > args.max_tune_s, 0):
            break
    step()  # the final switch reaches every rank within this step
    chosen = engine.params()
    mpidp.shutdown()
    return chosen, done, elapsed, steps


def measure(comm, step, knobs, args):
    """(slowest rank's seconds per step, comm fraction, tensors per collective) on a fresh
    engine with `knobs`."""
    mpidp.init(**knobs)
    for _ in range(args.warmup):
        step()
    comm.Barrier()
    with observe.stats_window() as w:
        began = time.perf_counter()
        for _ in range(args.steps):
            step()
        seconds = (time.perf_counter() - began) / args.steps
    mpidp.shutdown()
    return (comm.allreduce(seconds, op=MPI.MAX), w.comm_fraction, w.stats["tensors_per_collective"])


def human(n):
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def describe(params):
    return (
        f"fusion_threshold_bytes={human(params['fusion_threshold_bytes'])}, "
        f"fuse_below_bytes={human(params['fuse_below_bytes'])}, "
        f"cycle_time_ms={params['cycle_time_ms']}"
    )


def main():
    args = parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    step = Step(args.compute_ms)
    say = (lambda *a: print(*a, flush=True)) if comm.rank == 0 else (lambda *a: None)
    say(
        f"# autotune benchmark, np={comm.size}, {time.strftime('%Y-%m-%d %H:%M:%S')}, "
        f"args {' '.join(sys.argv[1:]) or '(defaults)'}"
    )
    say(
        f"# step: ResNet-18's 62 gradients (46.8 MB float32), Average, {args.compute_ms} ms "
        f"simulated backward"
    )

    chosen, done, tune_s, tune_steps = tune(comm, step, args)
    say(
        f"autotune {'chose' if done else 'had not finished; holding'} {describe(chosen)} "
        f"after {tune_s:.1f} s ({tune_steps} steps); log: {args.log or '(none)'}"
    )

    mpidp.init()
    defaults = {k: getattr(world.state().config, k) for k in TUNED}
    mpidp.shutdown()
    settings = {"defaults": {}, "autotuned": {k: chosen[k] for k in TUNED}}
    order = list(settings)
    samples = {name: [] for name in order}
    for rnd in range(args.rounds):
        for name in order[rnd % 2 :] + order[: rnd % 2]:
            samples[name].append(measure(comm, step, settings[name], args))
    say(f"{'contender':>10} {'knobs':<62} {'step ms':>8} {'comm frac':>9} {'tensors/coll':>12}")
    med = {}
    for name in order:
        knobs = defaults if name == "defaults" else chosen
        t = statistics.median(s[0] for s in samples[name])
        frac = statistics.median(s[1] for s in samples[name])
        per = statistics.median(s[2] for s in samples[name])
        med[name] = t
        say(f"{name:>10} {describe(knobs):<62} {t * 1e3:>8.1f} {frac:>9.3f} {per:>12.1f}")
    say(
        f"defaults / autotuned step time: {med['defaults'] / med['autotuned']:.2f} "
        f"(> 1: the autotuned knobs are faster; medians of {args.rounds} rounds x "
        f"{args.steps} steps)"
    )


if __name__ == "__main__":
    main()
