"""Allreduce across hosts, side by side in one MPI job: raw MPI, mpidp flat, mpidp hierarchical,
as time per call and as bus bandwidth against the link rate.

    mpiexec -hosts hosta:2,hostb:2 -n 4 python benchmarks/multihost.py [--rounds 5]
        [--sizes 4K,16K,...,256M] [--iters 10] [--min-time 0.3] [--link-gbit 1] [--json F]
    python benchmarks/multihost.py --summarize a.json b.json ... [--fit-json F]

Meant for several hosts (docs/clusters.md says how to build a cluster of network namespaces on
one machine for it, with links shaped to a network profile). Each round runs raw mpi4py
Allreduce on one buffer, mpidp with the flat allreduce and, where there are several hosts and
several ranks on each, mpidp with `hierarchical_allreduce` (reduce-scatter in the host,
allreduce across hosts, allgather in the host), in an order shuffled anew each round.
mpidp is started with init(hierarchical_allreduce=...) and stopped with shutdown() for each
contender. A sample is the largest time over the ranks of up to `--iters` blocking float32
allreduces (Sum) after a barrier, per call: the warm-up call's time decides how many, so that a
sample lasts about --min-time (one call at least). The table gives medians over the rounds, the
bus bandwidth as nccl-tests reports it, busbw = bytes * 2(n-1)/n / time (at n ranks the ring
moves that many bytes through each link), its ratio to --link-gbit, mpidp / raw and hier / flat.

--summarize reads the --json files of several launches: per-launch figures and medians over
launches per size; with --fit-json, a fit of t(n) = a + b*n to the launches' median times (raw
MPI and mpidp; benchmarks/scaling_model.py's fit and file format: `scaling_model.py predict
--measured LABEL=F` reads it; at 2 ranks alpha = a/2, beta = b), over --fit-sizes if given: a
shaper lets a burst through at the full speed of the machine (`htb ... burst`: 1 ms at the rate),
so mid-sized messages can beat the rate and pull the fit off the link's.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np
from rounds import order as rounds_order

UNITS = {"K": 1024, "M": 1024 * 1024}
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M,256M"
NAMES = ("raw", "flat", "hierarchical")


def parse_size(text):
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def show_size(n):
    for unit, k in (("M", UNITS["M"]), ("K", UNITS["K"])):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)


def timed(comm, call, iters, min_time):
    """Seconds per call, the slowest rank's, over a batch sized from a timed warm-up call (the
    warm-up is also, for mpidp, the negotiation that the cache then skips)."""
    from mpi4py import MPI

    comm.Barrier()
    start = time.perf_counter()
    call()
    first = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    iters = max(1, min(iters, math.ceil(min_time / max(first, 1e-9))))
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return comm.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX)


def run_mpidp(comm, sizes, iters, min_time, hierarchical):
    import torch

    import mpidp

    mpidp.init(hierarchical_allreduce=int(hierarchical))
    path = mpidp.runtime.world.state().engine.backend.routes["cpu"]
    if path.hierarchical != hierarchical:
        raise SystemExit(
            f"asked for hierarchical={hierarchical}, the engine has "
            f"{path.hierarchical}: need >1 host and >1 rank per host, equal counts"
        )
    out = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        name = f"bench.{nbytes}"
        out[nbytes] = timed(
            comm, lambda: mpidp.allreduce_(t, op=mpidp.Sum, name=name), iters, min_time
        )
    mpidp.shutdown()
    return out


def run_raw(comm, sizes, iters, min_time):
    from mpi4py import MPI

    out = {}
    for nbytes in sizes:
        buf = np.ones(nbytes // 4, dtype=np.float32)
        out[nbytes] = timed(
            comm, lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), iters, min_time
        )
    return out


def busbw(nbytes, ranks, secs):
    """Bus bandwidth in bit/s (nccl-tests: algbw * 2(n-1)/n)."""
    return nbytes * 8 * 2 * (ranks - 1) / ranks / secs


def print_table(result, med, link_bit_s, out=sys.stdout):
    ranks, names = result["ranks"], [n for n in NAMES if n in med]
    head = f"{'bytes':>6}" + "".join(f" {n[:4] + ' ms':>10}" for n in names)
    head += "".join(f" {n[:4] + ' Gb/s':>10}" for n in names)
    if link_bit_s:
        head += "".join(f" {n[:4] + '/link':>10}" for n in names)
    head += f" {'mpidp/raw':>10}" + (f" {'hier/flat':>10}" if "hierarchical" in med else "")
    print(head, file=out)
    for n in result["sizes"]:
        t = {name: med[name][n] for name in names}
        bw = {name: busbw(n, ranks, t[name]) for name in names}
        line = f"{show_size(n):>6}" + "".join(f" {t[k] * 1e3:>10.3f}" for k in names)
        line += "".join(f" {bw[k] / 1e9:>10.3f}" for k in names)
        if link_bit_s:
            line += "".join(f" {bw[k] / link_bit_s:>10.3f}" for k in names)
        line += f" {t['flat'] / t['raw']:>10.3f}"
        if "hierarchical" in t:
            line += f" {t['hierarchical'] / t['flat']:>10.3f}"
        print(line, file=out)


def measure(args):
    from mpi4py import MPI

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    comm = MPI.COMM_WORLD.Dup()
    hosts = len(set(comm.allgather(MPI.Get_processor_name())))
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    contenders = {
        "raw": lambda: run_raw(comm, sizes, args.iters, args.min_time),
        "flat": lambda: run_mpidp(comm, sizes, args.iters, args.min_time, False),
    }
    if hosts > 1 and local > 1:
        contenders["hierarchical"] = lambda: run_mpidp(comm, sizes, args.iters, args.min_time, True)
    names = list(contenders)
    samples = {name: {n: [] for n in sizes} for name in names}
    for r in range(args.rounds):
        for name in rounds_order(names, r):
            for nbytes, secs in contenders[name]().items():
                samples[name][nbytes].append(secs)
    if comm.Get_rank() != 0:
        return
    link = args.link_gbit * 1e9 if args.link_gbit else None
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cluster_step import commit

    result = {
        "commit": commit(),
        "ranks": comm.Get_size(),
        "hosts": hosts,
        "per_host": local,
        "sizes": sizes,
        "rounds": args.rounds,
        "link_bit_s": link,
        "label": args.label,
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "library": MPI.Get_library_version().splitlines()[0].strip(),
        "samples": {k: {str(n): v for n, v in s.items()} for k, s in samples.items()},
    }
    print(
        f"{comm.Get_size()} ranks on {hosts} host(s), {args.rounds} rounds; medians over "
        f"rounds; busbw = bytes * 2(n-1)/n / time"
        + (f"; link {args.link_gbit:g} Gbit/s" if link else "")
    )
    med = {k: {n: statistics.median(v) for n, v in s.items()} for k, s in samples.items()}
    print_table(result, med, link)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


def summarize(paths, fit_json, fit_sizes=None):
    runs = [json.load(open(p)) for p in paths]
    first = runs[0]
    sizes, ranks, link = first["sizes"], first["ranks"], first["link_bit_s"]
    names = [n for n in NAMES if n in first["samples"]]
    # One figure per launch: the median over its rounds; then the median over launches.
    per = {
        k: {n: [statistics.median(r["samples"][k][str(n)]) for r in runs] for n in sizes}
        for k in names
    }
    med = {k: {n: statistics.median(v) for n, v in per[k].items()} for k in names}
    print(
        f"{ranks} ranks on {first['hosts']} hosts, {len(runs)} launches "
        f"({', '.join(r.get('commit', '?') + ' ' + r['date'][11:16] for r in runs)}), "
        f"label {first.get('label')}; medians "
        f"of the launches' medians" + (f"; link {link / 1e9:g} Gbit/s" if link else "")
    )
    print_table(first, med, link)
    print("per launch:")
    for n in sizes:
        cells = []
        for k in names:
            bw = [busbw(n, ranks, t) / 1e9 for t in per[k][n]]
            cells.append(
                f"{k} {' / '.join(f'{t * 1e3:.3f}' for t in per[k][n])} ms "
                f"({' / '.join(f'{b:.3f}' for b in bw)} Gbit/s)"
            )
        ratio = [f / r for f, r in zip(per["flat"][n], per["raw"][n])]
        cells.append(f"mpidp/raw {' / '.join(f'{x:.3f}' for x in ratio)}")
        if "hierarchical" in per:
            ratio = [h / f for h, f in zip(per["hierarchical"][n], per["flat"][n])]
            cells.append(f"hier/flat {' / '.join(f'{x:.3f}' for x in ratio)}")
        print(f"  {show_size(n):>5}: " + "; ".join(cells))
    if fit_json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from scaling_model import fit_alpha_beta

        out = {
            "sizes": sizes,
            "np": ranks,
            "library": first["library"],
            "label": first.get("label"),
            "source": "benchmarks/multihost.py --summarize",
            "launches": [os.path.basename(p) for p in paths],
        }
        fit = [parse_size(s) for s in fit_sizes.split(",")] if fit_sizes else sizes
        out["fit_sizes"] = fit
        for key, name in (("mpi4py", "raw"), ("mpidp", "flat")):
            times = [med[name][n] for n in sizes]
            out[key] = {
                "times": times,
                "medians": times,
                "fit": fit_alpha_beta(fit, [med[name][n] for n in fit]),
            }
            f = out[key]["fit"]
            print(
                f"{key}: alpha={f['alpha'] * 1e6:.1f} us  beta=1/({f['gbytes_per_s']:.4f} "
                f"GB/s)  R2={f['r2']:.4f}  median|rel err|={f['median_rel_err']:.2f}"
            )
        with open(fit_json, "w") as fh:
            json.dump(out, fh, indent=1)
        print(f"wrote {fit_json}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10, help="calls per sample, at most")
    parser.add_argument(
        "--min-time",
        type=float,
        default=0.3,
        help="seconds a sample should last (fewer calls for large sizes)",
    )
    parser.add_argument("--sizes", default=DEFAULT_SIZES)
    parser.add_argument(
        "--link-gbit", type=float, default=0.0, help="the link rate, for busbw / link"
    )
    parser.add_argument("--label", default="")
    parser.add_argument("--json")
    parser.add_argument("--summarize", nargs="+", metavar="JSON")
    parser.add_argument("--fit-json", help="with --summarize: alpha/beta fit written here")
    parser.add_argument(
        "--fit-sizes",
        help="with --fit-json: fit these sizes only (leave out "
        "those a shaper's burst lets through faster than its rate)",
    )
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize, args.fit_json, args.fit_sizes)
    else:
        measure(args)


if __name__ == "__main__":
    main()
