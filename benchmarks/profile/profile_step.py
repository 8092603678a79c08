"""One training step, timed and profilable, at np=2 (rank 0 prints the results).

    mpiexec -n 2 python benchmarks/profile/profile_step.py --model resnet18|mlp --steps N \
        [--mode mpidp|raw]

Takes `mpidp` from PYTHONPATH (nothing here depends on the package's internals except the
optional --time-hooks, which patches DistributedOptimizer._hook only if it exists), so it runs
unchanged against the baseline and the rewritten engine.

--mode mpidp: SGD(lr=0.01, momentum=0.9) wrapped in
mpidp.DistributedOptimizer(named_parameters=...).
--mode raw:   plain SGD; after backward, per-tensor Allreduce(IN_PLACE) on a Dup of COMM_WORLD and
              grad.div_(size) (no mpidp engine involved; mpidp.init() is still called so MPI is
              initialised the same way).

Models are those of benchmarks/models.py, imported from --models-dir (default: the benchmarks
dir next to the mpidp package found on PYTHONPATH, else the one above this script).
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def _models_module(models_dir):
    if models_dir is None:
        import mpidp

        cand = os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(mpidp.__file__))), "benchmarks"
        )
        models_dir = (
            cand
            if os.path.exists(os.path.join(cand, "models.py"))
            else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        )
    sys.path.insert(0, models_dir)
    import models

    return models


def build(name, models):
    if name == "resnet18":
        return models.ResNet18(), (lambda: torch.randn(16, 3, 32, 32)), 16, 1000
    if name == "mlp":
        return models.mlp(), (lambda: torch.randn(32, 1024)), 32, 10
    raise SystemExit(f"unknown model {name!r}")


def timed_loop(step, x, y, n):
    """The timed steps (a separate function so profiles can find the window by this frame)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t0)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("resnet18", "mlp"), default="resnet18")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--mode", choices=("mpidp", "raw"), default="mpidp")
    ap.add_argument("--models-dir", default=None)
    ap.add_argument(
        "--time-hooks",
        action="store_true",
        help="time DistributedOptimizer._hook per call (perf_counter wrapper)",
    )
    ap.add_argument("--json", default=None, help="rank 0 writes the results here")
    args = ap.parse_args()

    torch.set_num_threads(1)
    from mpi4py import MPI

    import mpidp

    models = _models_module(args.models_dir)
    mpidp.init()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()

    hook_times = []
    if args.time_hooks and args.mode == "mpidp" and hasattr(mpidp.DistributedOptimizer, "_hook"):
        orig = mpidp.DistributedOptimizer._hook

        def timed_hook(self, p, _orig=orig, _pc=time.perf_counter, _rec=hook_times.append):
            t0 = _pc()
            r = _orig(self, p)
            _rec(_pc() - t0)
            return r

        mpidp.DistributedOptimizer._hook = timed_hook

    torch.manual_seed(0)
    model, make_x, batch, classes = build(args.model, models)
    x = make_x()
    y = torch.randint(0, classes, (batch,), generator=torch.Generator().manual_seed(rank))
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    params = list(model.parameters())

    if args.mode == "mpidp":
        opt = mpidp.DistributedOptimizer(sgd, named_parameters=model.named_parameters())

        def step(x, y):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    else:
        raw = comm.Dup()
        opt = sgd

        def step(x, y):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            for p in params:
                raw.Allreduce(MPI.IN_PLACE, p.grad.numpy())
                p.grad.div_(size)
            opt.step()

    for _ in range(args.warmup):
        step(x, y)
    comm.Barrier()
    hook_times.clear()
    have_stats = args.mode == "mpidp" and hasattr(mpidp, "stats")
    before = mpidp.stats() if have_stats else None
    t_start = time.perf_counter()
    times = timed_loop(step, x, y, args.steps)
    t_window = time.perf_counter() - t_start
    after = mpidp.stats() if have_stats else None
    comm.Barrier()

    med = statistics.median(times) * 1e3
    meds = comm.gather(med, root=0)
    res = {
        "model": args.model,
        "mode": args.mode,
        "np": size,
        "steps": args.steps,
        "median_ms_rank0": med,
        "median_ms_per_rank": meds,
        "median_ms_max_rank": max(meds) if meds else None,
        "mean_ms_rank0": statistics.fmean(times) * 1e3,
        "min_ms_rank0": min(times) * 1e3,
        "window_s_rank0": t_window,
        "n_params": len(params),
        "n_elems": sum(p.numel() for p in params),
    }
    if have_stats:
        delta = {}
        for k, v in after.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k in before:
                delta[k] = v - before[k]
        per_step = {k: v / args.steps for k, v in delta.items()}
        res["stats_delta"] = delta
        res["stats_per_step"] = per_step
        res["params"] = after.get("params")
    if hook_times:
        res["hook_calls_per_step"] = len(hook_times) / args.steps
        res["hook_us_median"] = statistics.median(hook_times) * 1e6
        res["hook_us_mean"] = statistics.fmean(hook_times) * 1e6
        res["hook_ms_per_step"] = sum(hook_times) * 1e3 / args.steps
    if rank == 0:
        print(
            f"[{args.mode} {args.model} np={size}] median step {med:.2f} ms (rank 0), "
            f"per-rank medians {[round(m, 2) for m in meds]}, mean {res['mean_ms_rank0']:.2f}, "
            f"min {res['min_ms_rank0']:.2f}, {args.steps} steps"
        )
        if have_stats:
            ps = res["stats_per_step"]
            print(
                "  engine per step: "
                + ", ".join(
                    f"{k}={ps[k]:.3g}"
                    for k in (
                        "cycles",
                        "slow_cycles",
                        "cache_hits",
                        "cache_misses",
                        "collectives",
                        "fused_collectives",
                        "tensors",
                        "bytes",
                        "negotiate_s",
                        "collective_s",
                    )
                    if k in ps
                )
            )
        if hook_times:
            print(
                f"  hook: {res['hook_calls_per_step']:.0f} calls/step, median "
                f"{res['hook_us_median']:.1f} us, mean {res['hook_us_mean']:.1f} us, "
                f"{res['hook_ms_per_step']:.2f} ms/step"
            )
        print("RESULT " + json.dumps(res))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=1)
    mpidp.shutdown()


if __name__ == "__main__":
    main()
