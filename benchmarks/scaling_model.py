"""Scaling model: allreduce alpha/beta measured here; step time and efficiency up to 1024 ranks.

    mpiexec -n 2 python benchmarks/scaling_model.py measure --label shm [--json FILE]
    python benchmarks/scaling_model.py predict [--measured shm=FILE ...] [--fabric NAME=US,GBPS ...]
                                       [--out benchmarks/results/scaling_model.png]  (and .csv)

As run for BENCHMARKS.md (tests/run_tcp_env.sh forces MPI onto TCP between the two ranks):
    mpiexec -n 2 python benchmarks/scaling_model.py measure --label shm --repeats 25 \
        --json benchmarks/results/scaling_model.alpha_beta_shm.json
    tests/run_tcp_env.sh mpiexec -n 2 python benchmarks/scaling_model.py measure --label tcp \
        --repeats 25 --json benchmarks/results/scaling_model.alpha_beta_tcp.json
    python benchmarks/scaling_model.py predict \
        --measured here-shm=benchmarks/results/scaling_model.alpha_beta_shm.json \
        --measured here-tcp=benchmarks/results/scaling_model.alpha_beta_tcp.json

Across hosts on shaped links (BENCHMARKS.md, "Across hosts on shaped links"): the fits of
benchmarks/multihost.py --summarize --fit-json over 3 launches at 2 hosts x 1 rank per profile
(scaling_model.alpha_beta_<profile>.json, the same format), then
    python benchmarks/scaling_model.py predict \
        --measured 1gbe=benchmarks/results/scaling_model.alpha_beta_1gbe.json ...

measure (np=2): the time (minimum of --repeats samples; medians are kept too) of a blocking
float32 Sum allreduce over message sizes, through mpidp (`mpidp.allreduce`) and through raw
mpi4py (`Allreduce(IN_PLACE)` on a Dup of COMM_WORLD), each fitted to t(n) = a + b*n by least
squares on relative error (so 4 B and 64 MB both count).
At p = 2 the ring cost below is 2*alpha + n*beta, so alpha = a/2 and beta = b.

predict: for each fabric (alpha = one-message latency, beta = 1/bandwidth of one link direction):
  ring allreduce        T(n, p) = 2(p-1)/p * n * beta + 2(p-1) * alpha
  halving-doubling      T(n, p) = 2(p-1)/p * n * beta + 2*log2(p) * alpha  (Rabenseifner, --algo rd)
  hierarchical (--gpus-per-node g): reduce-scatter and allgather inside the node on the intra
    fabric (--intra), ring allreduce across the P = p/g nodes; the g per-GPU cross rings share
    one NIC, so the cross bandwidth term is that of all n bytes: 2(P-1)/P*n*beta_x + 2(P-1)*alpha_x.
The reduction arithmetic is folded into beta (measured) or ignored (presets).

Step model, per rank: compute T_c = forward + backward, backward = --backward-fraction of T_c.
Gradients (fp32, ResNet-50: 25,557,032 parameters in 161 tensors; ResNet-101: 44,549,160 in 314,
torchvision layouts) become ready in reverse layer order, each at a time proportional to the
parameters already back-propagated (backward cost ~ parameter count: pessimistic for overlap,
because the last, parameter-heavy layers do the fewest FLOPs). Ready gradients fill fusion buckets
of --bucket-mb in that order; one bucket is reduced at a time, starting when its last gradient is
ready and the previous bucket is done.
  no overlap: T_step = T_c + sum of the buckets' allreduce times
  overlap:    T_step = max(T_c, end of the last bucket)       (never above the no-overlap time)
  efficiency = T_c / T_step  (weak scaling, fixed batch per rank; the optimizer step, negotiation,
  stragglers, I/O and network contention are not modelled).

Defaults for compute: a V100 doing ResNet-50 at batch 64 in fp32 takes about 0.2 s per step
(assumed); ResNet-101 has 2x its FLOPs (7.6 vs 3.8 GFLOPs, He et al. 2016), so 0.4 s.
Fabric presets (assumptions from vendor figures, one direction): NVLink 150 GB/s and 2 us (V100
NVLink2, 300 GB/s both directions); InfiniBand HDR 200 Gb/s = 25 GB/s and 1.5 us; 25 GbE
3.125 GB/s and 10 us (RoCE is a few us, kernel TCP tens of us).

Horovod's published figures (horovod/horovod docs/benchmarks: 128 servers x 4 Pascal GPUs,
RoCE-capable 25 Gbit/s; 90 % scaling efficiency for Inception V3 and ResNet-101 at 512 GPUs, 68 %
for VGG-16; an earlier version of the page: 90 % at 128 GPUs) are set beside the model's
ResNet-101 on 25 GbE, with a compute time taken from the same page's 16-GPU figure, and beside
the same ResNet-101 step on every other fabric (`beside Horovod`: 8, 64 and 512 ranks).
"""

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

MB = 1024 * 1024
# horovod/horovod docs/benchmarks: 90 % for ResNet-101 at 512 GPUs (128 servers x 4 Pascal,
# RoCE-capable 25 Gbit/s); an earlier version of the page: 90 % at 128 GPUs (32 servers).
HOROVOD_PUBLISHED = {128: 90, 512: 90}
HOROVOD_PANEL = "Horovod's set-up: resnet101, 25gbe"
RANKS = (8, 16, 32, 64, 128, 256, 512, 1024)
TABLE_RANKS = (8, 64, 128, 512, 1024)
DEFAULT_SIZES = [4 * 4**k for k in range(13)]  # 4 B ... 64 MB


@dataclass(frozen=True)
class Fabric:
    """One link: latency alpha (s) and inverse bandwidth beta (s/byte)."""

    name: str
    alpha: float
    beta: float

    @classmethod
    def from_us_gbps(cls, name: str, alpha_us: float, gbytes_per_s: float) -> "Fabric":
        return cls(name, alpha_us * 1e-6, 1.0 / (gbytes_per_s * 1e9))


PRESETS = {
    "nvlink": Fabric.from_us_gbps("nvlink", 2.0, 150.0),
    "ib-hdr": Fabric.from_us_gbps("ib-hdr", 1.5, 25.0),
    "25gbe": Fabric.from_us_gbps("25gbe", 10.0, 3.125),
}


# ---- gradient sets ----


def bottleneck_resnet_shapes(blocks) -> list:
    """Parameter shapes of a torchvision bottleneck ResNet (e.g. blocks=(3, 4, 6, 3): ResNet-50)."""
    bn = lambda c: [(c,), (c,)]  # noqa: E731  (weight, bias)
    shapes = [(64, 3, 7, 7)] + bn(64)
    inplanes = 64
    for planes, count in zip((64, 128, 256, 512), blocks):
        for i in range(count):
            shapes += [(planes, inplanes, 1, 1)] + bn(planes)
            shapes += [(planes, planes, 3, 3)] + bn(planes)
            shapes += [(planes * 4, planes, 1, 1)] + bn(planes * 4)
            if i == 0:
                shapes += [(planes * 4, inplanes, 1, 1)] + bn(planes * 4)
            inplanes = planes * 4
    return shapes + [(1000, 2048), (1000,)]


MODELS = {"resnet50": (3, 4, 6, 3), "resnet101": (3, 4, 23, 3)}


def gradient_bytes(model: str, itemsize: int = 4) -> list:
    """Bytes of each gradient tensor of `model`, in forward (model.parameters()) order."""
    return [math.prod(s) * itemsize for s in bottleneck_resnet_shapes(MODELS[model])]


# ---- allreduce cost ----


def ring_allreduce_time(nbytes: float, p: int, fabric: Fabric) -> float:
    """Ring allreduce: 2(p-1) steps, each one alpha plus n/p bytes."""
    if p <= 1:
        return 0.0
    return 2.0 * (p - 1) / p * nbytes * fabric.beta + 2.0 * (p - 1) * fabric.alpha


def rd_allreduce_time(nbytes: float, p: int, fabric: Fabric) -> float:
    """Reduce-scatter by recursive halving + allgather by recursive doubling (p a power of 2)."""
    if p <= 1:
        return 0.0
    return 2.0 * (p - 1) / p * nbytes * fabric.beta + 2.0 * math.log2(p) * fabric.alpha


def hierarchical_allreduce_time(
    nbytes: float,
    p: int,
    intra: Fabric,
    cross: Fabric,
    per_node: int,
    cross_algo=ring_allreduce_time,
) -> float:
    """Reduce-scatter in the node, allreduce of the shards across nodes, allgather in the node."""
    g = min(per_node, p)
    nodes = max(p // g, 1)
    inside = 2.0 * ((g - 1) / g * nbytes * intra.beta + (g - 1) * intra.alpha)
    return inside + cross_algo(nbytes, nodes, cross)


# ---- step model ----


def buckets(sizes_backward_order, bucket_bytes: float) -> list:
    """Group tensors, in the order they become ready, into buckets of at least bucket_bytes
    (the last one may be smaller). Returns (index of the bucket's last tensor, bytes) pairs."""
    out, acc = [], 0
    for i, n in enumerate(sizes_backward_order):
        acc += n
        if acc >= bucket_bytes:
            out.append((i, acc))
            acc = 0
    if acc:
        out.append((len(sizes_backward_order) - 1, acc))
    return out


def step_times(
    grad_bytes, compute_s: float, backward_fraction: float, bucket_bytes: float, allreduce
) -> tuple:
    """(no-overlap, overlap) step time for one rank; allreduce(nbytes) gives one bucket's time."""
    backward = list(reversed(grad_bytes))
    total = float(sum(backward))
    t_forward = compute_s * (1.0 - backward_fraction)
    t_backward = compute_s * backward_fraction
    done = np.cumsum(backward) / total
    plan = buckets(backward, bucket_bytes)
    costs = [allreduce(nbytes) for _, nbytes in plan]
    end = 0.0
    for (last, _), cost in zip(plan, costs):
        ready = t_forward + t_backward * float(done[last])
        end = max(ready, end) + cost
    return compute_s + sum(costs), max(compute_s, end)


def efficiency(compute_s: float, step_s: float) -> float:
    """Weak-scaling efficiency: the share of the step spent computing."""
    return compute_s / step_s


# ---- fitting ----


def fit_alpha_beta(sizes, times) -> dict:
    """Least squares of t = a + b*n on relative error, a and b >= 0; alpha = a/2, beta = b (the
    ring cost at p = 2)."""
    n = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    w = 1.0 / t
    design = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    # Noise (a shared machine) can push one coefficient below zero: refit with it at zero.
    clamped = ""
    if a < 0:
        a, b, clamped = 0.0, float(np.sum(w * w * n * t) / np.sum(w * w * n * n)), "a"
    elif b < 0:
        a, b, clamped = float(np.sum(w * w * t) / np.sum(w * w)), 0.0, "b"
    pred = a + b * n
    resid = t - pred
    r2 = 1.0 - float(np.sum(resid**2) / np.sum((t - t.mean()) ** 2))
    rel = np.abs(resid) / t
    return {
        "a": float(a),
        "b": float(b),
        "alpha": float(a) / 2.0,
        "beta": float(b),
        "gbytes_per_s": (1.0 / float(b) / 1e9) if b > 0 else float("inf"),
        "r2": r2,
        "median_rel_err": float(np.median(rel)),
        "max_rel_err": float(rel.max()),
        "clamped_to_zero": clamped,
    }


# ---- measurement (under mpiexec -n 2) ----


def measure(sizes, repeats: int, min_time: float) -> dict:
    """Blocking-allreduce time per size (min and median of `repeats` samples, each the slowest
    rank's mean over a batch of calls) for mpidp and raw mpi4py, and fits of the minima."""
    import torch
    from mpi4py import MPI

    import mpidp

    mpidp.init()
    comm = MPI.COMM_WORLD.Dup()
    results = {"mpidp": [], "mpi4py": []}
    medians = {"mpidp": [], "mpi4py": []}
    for n in sizes:
        tensor = torch.ones(max(n // 4, 1), dtype=torch.float32)
        array = tensor.numpy()
        for contender in ("mpi4py", "mpidp"):
            iters = 1
            call = (
                (lambda: comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM))
                if contender == "mpi4py"
                else (lambda: mpidp.allreduce(tensor, name=f"sm.{n}", op=mpidp.Sum))
            )
            call()
            samples = []
            for _ in range(repeats):
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    call()
                elapsed = comm.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX)
                samples.append(elapsed)
                if elapsed * iters < min_time and iters < 4096:
                    iters *= 2  # same decision on every rank: elapsed is the max
            # The minimum estimates the uncontended cost on a shared machine; medians are kept.
            results[contender].append(min(samples))
            medians[contender].append(statistics.median(samples))
    library = MPI.Get_library_version().splitlines()[0].strip()
    comm.Free()
    mpidp.shutdown()
    out = {"sizes": list(sizes), "np": MPI.COMM_WORLD.Get_size(), "library": library}
    for contender, times in results.items():
        out[contender] = {
            "times": times,
            "medians": medians[contender],
            "fit": fit_alpha_beta(sizes, times),
        }
    return out


# ---- predictions and output ----


def parse_fabric(text: str) -> Fabric:
    name, _, spec = text.partition("=")
    alpha_us, _, gbps = spec.partition(",")
    return Fabric.from_us_gbps(name, float(alpha_us), float(gbps))


def predict(fabrics, compute, args, intra=None) -> list:
    """Rows of (model, fabric, ranks, compute, no-overlap and overlap step time and efficiency);
    with args.gpus_per_node > 1, every fabric but `intra` is the cross-node one."""
    algo = rd_allreduce_time if args.algo == "rd" else ring_allreduce_time
    rows = []
    for model, compute_s in compute.items():
        grads = gradient_bytes(model)
        for fabric in fabrics:
            for p in args.ranks:
                if args.gpus_per_node > 1 and fabric.name != intra.name:
                    cost = lambda n: hierarchical_allreduce_time(  # noqa: E731
                        n, p, intra, fabric, args.gpus_per_node, algo
                    )
                else:
                    cost = lambda n: algo(n, p, fabric)  # noqa: E731
                plain, over = step_times(
                    grads, compute_s, args.backward_fraction, args.bucket_mb * MB, cost
                )
                rows.append(
                    {
                        "model": model,
                        "fabric": fabric.name,
                        "ranks": p,
                        "alpha_us": fabric.alpha * 1e6,
                        "gbytes_per_s": 1e-9 / fabric.beta,
                        "compute_s": compute_s,
                        "step_no_overlap_s": plain,
                        "step_overlap_s": over,
                        "eff_no_overlap": efficiency(compute_s, plain),
                        "eff_overlap": efficiency(compute_s, over),
                    }
                )
    return rows


def write_plot(rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 5.4), sharey=True)
    axes = np.atleast_1d(axes)
    colors = {f: f"C{i}" for i, f in enumerate(dict.fromkeys(r["fabric"] for r in rows))}
    for ax, panel in zip(axes, panels):
        for fabric, color in colors.items():
            sel = [r for r in rows if r["model"] == panel and r["fabric"] == fabric]
            if not sel:
                continue
            ranks = [r["ranks"] for r in sel]
            ax.plot(
                ranks,
                [100 * r["eff_overlap"] for r in sel],
                "-o",
                color=color,
                ms=3,
                label=f"{fabric}, overlap",
            )
            ax.plot(
                ranks,
                [100 * r["eff_no_overlap"] for r in sel],
                "--",
                color=color,
                label=f"{fabric}, no overlap",
            )
        if panel.startswith(HOROVOD_PANEL):
            ax.plot(
                list(HOROVOD_PUBLISHED),
                list(HOROVOD_PUBLISHED.values()),
                "k*",
                ms=12,
                label="Horovod, published",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks (GPUs)")
        ax.set_title(panel, fontsize=9)
        ax.set_ylim(0, 102)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, loc="lower left")
    axes[0].set_ylabel("scaling efficiency, % (compute / step time)")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_csv(rows, path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def print_table(rows) -> None:
    present = sorted({r["ranks"] for r in rows})
    ranks = TABLE_RANKS if set(TABLE_RANKS) <= set(present) else present
    print(f"| model | fabric | {' | '.join(str(p) for p in ranks)} |")
    print("|---|---|" + "---:|" * len(ranks))
    for key in dict.fromkeys((r["model"], r["fabric"]) for r in rows):
        cells = {r["ranks"]: r for r in rows if (r["model"], r["fabric"]) == key}
        text = [
            f"{100 * cells[p]['eff_no_overlap']:.0f} / {100 * cells[p]['eff_overlap']:.0f}"
            for p in ranks
        ]
        print(f"| {key[0]} | {key[1]} | {' | '.join(text)} |")


def print_beside_horovod(fabrics, compute_s, args, intra) -> None:
    """ResNet-101 with Horovod's compute per step on every fabric at 8, 64 and 512 ranks, with
    overlap and without, beside Horovod's published efficiency."""
    ranks = (8, 64, 512)
    sub = argparse.Namespace(**dict(vars(args), ranks=list(ranks)))
    rows = predict(fabrics, {"resnet101": compute_s}, sub, intra)
    print(
        f"beside Horovod: ResNet-101, {compute_s:g} s compute per step, efficiency % "
        f"overlap (no overlap) at {', '.join(map(str, ranks))} ranks"
    )
    for fab in fabrics:
        cells = {r["ranks"]: r for r in rows if r["fabric"] == fab.name}
        text = ", ".join(
            f"{100 * cells[p]['eff_overlap']:.0f} ({100 * cells[p]['eff_no_overlap']:.0f})"
            for p in ranks
        )
        print(f"  {fab.name:>10} ({fab.alpha * 1e6:.1f} us, {1e-9 / fab.beta:.4g} GB/s): {text}")
    print(
        f"  {'Horovod':>10} published (25 GbE RoCE, Pascal GPUs): "
        f"{', '.join(f'{v} % at {k}' for k, v in HOROVOD_PUBLISHED.items())}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="fit alpha/beta here (run under mpiexec -n 2)")
    m.add_argument("--label", default="here")
    m.add_argument("--json", default="")
    m.add_argument("--repeats", type=int, default=15)
    m.add_argument("--min-time", type=float, default=0.02, help="seconds per sample, at least")
    p = sub.add_parser("predict", help="predict step time and efficiency")
    p.add_argument(
        "--measured",
        action="append",
        default=[],
        metavar="LABEL=JSON[:mpidp]",
        help="a fabric from a measure run (its raw mpi4py fit, or with :mpidp mpidp's)",
    )
    p.add_argument(
        "--fabric",
        action="append",
        default=[],
        metavar="NAME=ALPHA_US,GBYTES_S",
        help="add or override a fabric (presets: nvlink, ib-hdr, 25gbe)",
    )
    p.add_argument("--only", default="", help="comma-separated fabric names to keep")
    p.add_argument("--compute-resnet50", type=float, default=0.2)
    p.add_argument("--compute-resnet101", type=float, default=0.4)
    p.add_argument(
        "--horovod-compute",
        type=float,
        default=0.62,
        help="ResNet-101 s/step on Horovod's GPUs (64 images / (1656.82 / 16) img/s)",
    )
    p.add_argument("--backward-fraction", type=float, default=2.0 / 3.0)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--algo", choices=("ring", "rd"), default="ring")
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--intra", default="nvlink", help="intra-node fabric when --gpus-per-node > 1")
    p.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=list(RANKS))
    p.add_argument("--out", default="benchmarks/results/scaling_model.png")
    args = parser.parse_args(argv)

    if args.cmd == "measure":
        result = measure(DEFAULT_SIZES, args.repeats, args.min_time)
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() == 0:
            result["label"] = args.label
            result["env"] = {
                k: v for k, v in os.environ.items() if k.startswith(("MPIR_CVAR_", "FI_", "UCX_"))
            }
            print(f"{result['library']}, np={result['np']}, env={result['env']}")
            print("| bytes | mpi4py min | mpi4py median | mpidp min | mpidp median |")
            print("|---:|---:|---:|---:|---:|")
            raw, ours = result["mpi4py"], result["mpidp"]
            for i, n in enumerate(result["sizes"]):
                print(
                    f"| {n} | {raw['times'][i] * 1e6:.1f} us | {raw['medians'][i] * 1e6:.1f} us "
                    f"| {ours['times'][i] * 1e6:.1f} us | {ours['medians'][i] * 1e6:.1f} us |"
                )
            for contender in ("mpi4py", "mpidp"):
                f = result[contender]["fit"]
                print(
                    f"{contender}: alpha={f['alpha'] * 1e6:.2f} us  "
                    f"beta=1/({f['gbytes_per_s']:.2f} GB/s)  R2={f['r2']:.4f}  "
                    f"median|rel err|={f['median_rel_err']:.2f}  max={f['max_rel_err']:.2f}"
                )
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(result, fh, indent=1)
        return 0

    fabrics = dict(PRESETS)
    for item in args.measured:
        label, _, path = item.partition("=")
        path, _, contender = path.partition(":")
        with open(path) as fh:
            fit = json.load(fh)[contender or "mpi4py"]["fit"]
        fabrics[label] = Fabric(label, fit["alpha"], fit["beta"])
    for text in args.fabric:
        fab = parse_fabric(text)
        fabrics[fab.name] = fab
    intra = fabrics[args.intra]
    if args.only:
        fabrics = {k: fabrics[k] for k in args.only.split(",")}
    compute = {"resnet50": args.compute_resnet50, "resnet101": args.compute_resnet101}
    rows = predict(list(fabrics.values()), compute, args, intra)
    # Horovod's own set-up: ResNet-101, Pascal GPUs (compute from its 16-GPU throughput), 25 GbE.
    hvd_compute = args.horovod_compute
    hvd_rows = predict(
        [fabrics["25gbe"] if "25gbe" in fabrics else PRESETS["25gbe"]],
        {"resnet101": hvd_compute},
        args,
        intra,
    )
    for row in hvd_rows:
        row["model"] = f"{HOROVOD_PANEL} ({hvd_compute:g} s compute)"
    hier = f" (hierarchical, intra-node {intra.name})" if args.gpus_per_node > 1 else ""
    print(
        f"algo={args.algo} gpus_per_node={args.gpus_per_node}{hier} bucket={args.bucket_mb} MB "
        f"backward={args.backward_fraction:.2f} compute={compute}"
    )
    for fab in fabrics.values():
        print(f"  {fab.name}: alpha={fab.alpha * 1e6:.2f} us, {1e-9 / fab.beta:.3f} GB/s")
    print("efficiency %, no overlap / overlap")
    print_table(rows + hvd_rows)
    print(
        f"Horovod published (ResNet-101, Pascal GPUs, 25 GbE RoCE): "
        f"{', '.join(f'{v} % at {k}' for k, v in HOROVOD_PUBLISHED.items())} GPUs"
    )
    print_beside_horovod(list(fabrics.values()), hvd_compute, args, intra)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        write_csv(rows + hvd_rows, os.path.splitext(args.out)[0] + ".csv")
        write_plot(
            rows + hvd_rows,
            args.out,
            f"model, weak scaling: {args.algo} allreduce, {args.bucket_mb:g} MB buckets, "
            f"backward {args.backward_fraction:.2f} of compute, gpus/node "
            f"{args.gpus_per_node}; compute s/step {compute}",
        )
        print(f"wrote {args.out} and {os.path.splitext(args.out)[0]}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
