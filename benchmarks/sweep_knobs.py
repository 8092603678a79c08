"""Launch benchmarks/allreduce.py several times on a quiet machine and collect medians.

    python benchmarks/sweep_knobs.py final [--launches 3] [--out DIR] [--env MPIDP_X=V ...]
        the full benchmark, --launches times; prints medians of the per-launch medians
    python benchmarks/sweep_knobs.py sweep [--launches 3] [--knobs fuse_below,threshold,...]
        one knob at a time (the others at their defaults): ResNet-18 set and 16/64 MB tensors,
        4-byte latency for cycle time (the idle back-off knob it once swept is gone)

Before every launch it waits (up to --max-wait s) until the machine is quiet: the 1-minute load
average at most --max-load, or under 5 % of the CPUs busy over a 3 s sample while the average is
below twice that (it lags by a minute), or under 10 % busy when only this script's own previous
launch keeps the average up. After each launch it computes how much CPU other
processes used while it ran (all CPU time from /proc/stat minus the launch's own); a launch
disturbed by more than --max-foreign of a core is thrown away and run again (twice at most).
Run it with the venv's python (mpiexec is taken from the same bin/).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MB = 1024 * 1024

SWEEPS = {
    # knob: (env var, values, what to measure, other variables held for this sweep)
    "fuse_below": ("MPIDP_FUSE_BELOW_BYTES", [16 * 1024, 64 * 1024, 256 * 1024, MB], "data", {}),
    # At the default fuse_below (64 KB) ResNet-18 fuses only ~110 KB, so the threshold is inert;
    # sweep it with every tensor eligible for fusion (Horovod's policy) to see what it buys.
    "threshold": (
        "MPIDP_FUSION_THRESHOLD_BYTES",
        [MB, 4 * MB, 16 * MB, 64 * MB],
        "data",
        {"MPIDP_FUSE_BELOW_BYTES": 128 * MB},
    ),
    "chunk": ("MPIDP_CHUNK_BYTES", [MB, 4 * MB, 16 * MB, 0], "data", {}),
    "cycle": ("MPIDP_CYCLE_TIME_MS", [0, 0.5, 1], "cycle", {}),
    "bucket": ("MPIDP_BUCKET_BYTES", [MB, 4 * MB, 25 * MB, 0], "data", {}),
}
MODE_ARGS = {
    "data": ["--sizes", "16M,64M", "--skip-latency", "--skip-idle"],
    "cycle": ["--sizes", "", "--latency-iters", "1000", "--skip-idle"],
    "idle": ["--skip-resnet", "--sizes", "", "--latency-iters", "500", "--idle-seconds", "5"],
    "final": [],
}


def loadavg1() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def cpu_jiffies():
    """(busy, total) jiffies over all CPUs."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    total = sum(vals[:8])
    return total - idle, total


def busy_fraction(seconds=3.0) -> float:
    b0, t0 = cpu_jiffies()
    time.sleep(seconds)
    b1, t1 = cpu_jiffies()
    return (b1 - b0) / max(1, t1 - t0)


_last_end = [0.0]


def wait_quiet(max_load, max_wait):
    start = time.time()
    while True:
        load = loadavg1()
        recent_self = time.time() - _last_end[0] < 120
        if load <= max_load:
            return {"load1": load, "waited_s": round(time.time() - start)}
        busy = busy_fraction()
        # The load average lags by a minute: a quiet CPU sample while it decays (or while only
        # this script's previous launch keeps it up) counts as quiet too.
        if busy < 0.05 and load < 2 * max_load or recent_self and busy < 0.10:
            return {"load1": load, "busy": busy, "waited_s": round(time.time() - start)}
        if time.time() - start > max_wait:
            print(
                f"  machine not quiet after {max_wait:.0f} s (load {load}, busy "
                f"{100 * busy:.0f} %); launching anyway",
                flush=True,
            )
            return {
                "load1": load,
                "busy": busy,
                "waited_s": round(time.time() - start),
                "not_quiet": True,
            }
        print(f"  load {load:.2f}, busy {100 * busy:.0f} %: waiting", flush=True)
        time.sleep(20)


def launch(extra_args, env_over, out_json, args):
    env = dict(os.environ)
    env.update({k: str(v) for k, v in env_over.items()})
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        "timeout",
        "-k",
        "10",
        "300",
        os.path.join(bindir, "mpiexec"),
        "-n",
        str(args.np),
        os.path.join(bindir, "python"),
        os.path.join(HERE, "allreduce.py"),
        "--rounds",
        str(args.rounds),
        "--json",
        out_json,
    ] + extra_args
    for attempt in range(3):
        gate = wait_quiet(args.max_load, args.max_wait)
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        b0, t0 = cpu_jiffies()
        w0 = time.time()
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        w1 = time.time()
        b1, t1 = cpu_jiffies()
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        _last_end[0] = time.time()
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout + proc.stderr)
            raise SystemExit(f"launch failed ({proc.returncode}): {' '.join(cmd)}")
        hz = os.sysconf("SC_CLK_TCK")
        mine = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
        foreign = max(0.0, (b1 - b0) / hz - mine) / (w1 - w0)  # cores used by others
        with open(out_json) as f:
            res = json.load(f)
        res["launch"] = dict(
            gate,
            foreign_cores=round(foreign, 3),
            wall_s=round(w1 - w0, 1),
            env=env_over,
            cmd=" ".join(
                [f"{k}={v}" for k, v in env_over.items()]
                + [
                    "mpiexec",
                    "-n",
                    str(args.np),
                    "python",
                    "benchmarks/allreduce.py",
                    "--rounds",
                    str(args.rounds),
                ]
                + [a if a else "''" for a in extra_args]
            ),
        )
        with open(out_json, "w") as f:
            json.dump(res, f, indent=1)
        print(
            f"  {res['launch']['cmd']}: {w1 - w0:.1f} s, load {gate['load1']:.2f}, "
            f"others used {foreign:.2f} cores",
            flush=True,
        )
        if foreign <= args.max_foreign:
            return res
        print("  disturbed by other processes: again", flush=True)
    return res


def med(values):
    return statistics.median(values) if values else float("nan")


def aggregate(runs):
    """Medians over launches of each launch's medians (and of its per-launch ratios)."""
    agg = {"launches": len(runs), "cases": {}}
    for name in runs[0]["cases"]:
        cs = [r["cases"][name] for r in runs]
        labels = cs[0]["median_s"].keys()
        medians = {lab: med([c["median_s"][lab] for c in cs]) for lab in labels}
        raws = {lab: v for lab, v in medians.items() if lab.startswith("raw")}
        best = min(raws, key=raws.get)
        agg["cases"][name] = {
            "median_s": medians,
            "best_raw": best,
            "ratio_of_medians": medians["mpidp"] / raws[best],
            "median_ratio": med([c["ratio"] for c in cs]),
            "ratios": [c["ratio"] for c in cs],
            "best_raw_per_launch": [c["best_raw"] for c in cs],
        }
    if "latency4" in runs[0]:
        agg["latency4"] = {k: med([r["latency4"][k] for r in runs]) for k in runs[0]["latency4"]}
        agg["latency4_per_launch"] = [r["latency4"]["mpidp"] for r in runs]
    if "wake4" in runs[0]:
        agg["wake4_median"] = med([r["wake4"]["median"] for r in runs])
        agg["wake4_max"] = max(r["wake4"]["max"] for r in runs)
        agg["wake4_raw_median"] = med([r["wake4"].get("raw_median", float("nan")) for r in runs])
    if "idle" in runs[0]:
        agg["idle_engine_core_frac"] = med([max(r["idle"]["engine_core_frac"]) for r in runs])
        agg["idle_per_launch"] = [r["idle"]["engine_core_frac"] for r in runs]
    agg["launch"] = [r["launch"] for r in runs]
    return agg


def ms(s):
    return f"{s * 1e3:.2f}"


def print_final(agg):
    labels = ["mpidp", "raw_per_tensor", "raw_fused", "raw_fused_4M", "raw_hybrid", "raw_chunk_4M"]
    print(f"\nmedians of {agg['launches']} launches (ms)")
    print("| case | " + " | ".join(labels) + " | best raw | mpidp / best raw |")
    print("|---|" + "---:|" * (len(labels) + 2))
    for name, c in agg["cases"].items():
        m = c["median_s"]
        cells = " | ".join(f"{m[lab] * 1e3:.3f}" if lab in m else "–" for lab in labels)
        print(
            f"| {name} | {cells} | {c['best_raw']} | {c['median_ratio']:.2f} "
            f"({', '.join(f'{r:.2f}' for r in c['ratios'])}) |"
        )
    if "latency4" in agg:
        lat = agg["latency4"]
        print(
            f"latency 4 B: mpidp {lat['mpidp'] * 1e6:.1f} us "
            f"(p90 {lat['mpidp_p90'] * 1e6:.1f}), raw {lat['raw'] * 1e6:.1f} us; per launch "
            f"{[round(x * 1e6, 1) for x in agg['latency4_per_launch']]}"
        )
    if "idle_engine_core_frac" in agg:
        print(
            f"idle engine: {100 * agg['idle_engine_core_frac']:.2f} % of a core (worst rank, "
            f"median of launches); per launch "
            f"{[[round(100 * x, 2) for x in r] for r in agg['idle_per_launch']]}"
        )
    if "wake4_median" in agg:
        print(
            f"4 B allreduce after 0.2 s idle: median {agg['wake4_median'] * 1e6:.0f} us, "
            f"max {agg['wake4_max'] * 1e6:.0f} us; raw MPI the same way "
            f"{agg['wake4_raw_median'] * 1e6:.0f} us"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("final", "sweep"))
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--knobs", default=",".join(SWEEPS))
    ap.add_argument(
        "--values",
        help="comma-separated values overriding the list of a single "
        "knob given with --knobs (bytes for the *_BYTES knobs)",
    )
    ap.add_argument("--max-load", type=float, default=0.7)
    ap.add_argument("--max-wait", type=float, default=600)
    ap.add_argument(
        "--max-foreign",
        type=float,
        default=0.15,
        help="cores used by other processes during a launch before it is redone",
    )
    ap.add_argument("--out", default="/tmp/mpidp-bench")
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="VAR=VALUE",
        help="final mode: set this knob variable for every launch (repeatable)",
    )
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    if args.mode == "final":
        env = dict(item.split("=", 1) for item in args.env)
        runs = [
            launch(MODE_ARGS["final"], env, os.path.join(args.out, f"final.{i}.json"), args)
            for i in range(args.launches)
        ]
        agg = aggregate(runs)
        print_final(agg)
        with open(os.path.join(args.out, "final.json"), "w") as f:
            json.dump(agg, f, indent=1)
        return

    table = {}
    for knob in args.knobs.split(","):
        var, values, mode, held = SWEEPS[knob]
        if args.values:
            values = [float(v) if "." in v else int(v) for v in args.values.split(",")]
        print(f"== {knob} ({var}) {values} {held or ''}", flush=True)
        for value in values:
            runs = [
                launch(
                    MODE_ARGS[mode],
                    dict(held, **{var: value}),
                    os.path.join(args.out, f"{knob}.{value}.{i}.json"),
                    args,
                )
                for i in range(args.launches)
            ]
            agg = aggregate(runs)
            table[f"{var}={value}"] = agg
            row = [f"{var}={value}"]
            for name, c in agg["cases"].items():
                row.append(
                    f"{name}: mpidp {ms(c['median_s']['mpidp'])} ms, "
                    f"best raw "
                    f"{ms(min(v for k, v in c['median_s'].items() if k != 'mpidp'))}"
                    f" ms ({c['best_raw']}), ratio {c['median_ratio']:.2f}"
                )
            if "latency4" in agg:
                row.append(f"lat4 {agg['latency4']['mpidp'] * 1e6:.0f} us")
            if "wake4_median" in agg:
                row.append(
                    f"after idle {agg['wake4_median'] * 1e6:.0f} us "
                    f"(max {agg['wake4_max'] * 1e6:.0f}; raw "
                    f"{agg['wake4_raw_median'] * 1e6:.0f})"
                )
            if "idle_engine_core_frac" in agg:
                row.append(f"idle {100 * agg['idle_engine_core_frac']:.2f} %")
            print("  " + "; ".join(row), flush=True)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
