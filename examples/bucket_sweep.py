"""Sweep mpidp's fusion (bucket) size over a training loop: step time, throughput, comm share.

    mpiexec -n 2 python examples/bucket_sweep.py [--model resnet18|mlp] [--sizes 0,64K,...,64M]
        [--rounds 5] [--steps 10] [--csv out/bucket_sweep.csv] [--png out/bucket_sweep.png]

For every fusion size S in --sizes the same model is trained for --steps steps (after --warmup
untimed ones) with mpidp.DistributedOptimizer, and once more per round with no wrapper at all
(local gradients, nothing communicated). From the medians:

    step_ms        time per training step (the slowest rank's, since ranks wait for each other)
    samples_per_s  batch size x ranks / step time
    comm_fraction  1 - t_nocomm / t_step: the share of a step that gradient exchange costs,
                   communication that overlaps the backward pass counting only for what it
                   delays. Noise can push it slightly below 0 when communication costs little.

and, from mpidp's stats_window() around rank 0's timed steps (mpidp's own counters):

    engine_busy    time the engine spent in collectives / wall time: the share of the step the
                   data path was busy, overlapped or not (an upper bound on comm_fraction)
    MB_per_step    bytes reduced per step (the gradients; the same for every size)
    tensors/coll   gradients carried per collective: how much fusion the size allowed

What S sets. mpidp has three size knobs (mpidp/config.py): DistributedOptimizer groups
gradients into buckets of at most `bucket_bytes`, each bucket one engine operation submitted when
its last gradient is ready; inside the data path (mpidp/engine/fusion.py) a bucket's parts and
other allreduces smaller than `fuse_below_bytes` are packed into buffers of at most
`fusion_threshold_bytes`, and larger ones are reduced alone, in place (in `chunk_bytes` pieces).
This sweep moves all three together, as one bucket size in the manner of Horovod's
HOROVOD_FUSION_THRESHOLD and DDP's bucket_cap_mb:

    mpidp.init(bucket_bytes=S, fusion_threshold_bytes=S, fuse_below_bytes=max(S, 1))

so gradients are submitted in buckets of at most S bytes, every gradient smaller than S may share
a buffer of at most S bytes, and gradients of S bytes or more go alone. S = 0 turns bucketing and
fusion off: one operation and one allreduce per gradient. The knobs are read once by
init(), so each setting runs on a fresh engine: mpidp.shutdown(), then init() with the new
values. `--chunk-bytes` (default: mpidp's) applies to every setting; it also cuts fusion buffers
larger than itself into pieces.

Noise. The machine is shared and noisy, so the settings (no-communication baseline included)
alternate within each round, the order rotated from round to round, and each result is the
median over --rounds rounds. A round's time for a setting is the slowest rank's mean over its
--steps steps. Each measurement starts from the same initial weights on a new model (so the
optimizer hooks of one setting never see the next).

Rank 0 prints a table and writes the CSV (fusion_bytes, step_ms, samples_per_s, comm_fraction,
ranks, engine_busy, bytes_per_step, tensors_per_collective) and a PNG plot (step time and
communication fraction against fusion size, log x axis).
"""

import argparse
import csv
import gc
import os
import re
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import mpidp
from mpidp.runtime import observe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from synthetic_benchmark import cpu_count, resnet18  # noqa: E402  (the same ResNet-18)

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1024,
    "KB": 1024,
    "KIB": 1024,
    "M": 1024**2,
    "MB": 1024**2,
    "MIB": 1024**2,
    "G": 1024**3,
    "GB": 1024**3,
    "GIB": 1024**3,
}


def parse_size(text: str) -> int:
    """'0', '4096', '64K', '1M', '1.5MiB' -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 0, 4096, 64K, 1M)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def parse_sizes(text: str):
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError("--sizes is empty")
    if len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"--sizes has duplicates: {text!r}")
    return sorted(sizes)


def human(nbytes: int) -> str:
    for unit, scale in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


DEFAULT_SIZES = parse_sizes("0,64K,256K,1M,4M,16M,64M")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("resnet18", "mlp"), default="resnet18")
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=DEFAULT_SIZES,
        help="fusion sizes in bytes, comma-separated, K/M/G suffixes (binary); 0 = no fusion",
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds over all settings")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per setting and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="per rank (default: 16 for resnet18, 32 for mlp)",
    )
    parser.add_argument("--image-size", type=int, default=32, help="resnet18 input size")
    parser.add_argument("--mlp-width", type=int, default=1024, help="mlp: features per layer")
    parser.add_argument("--mlp-depth", type=int, default=6, help="mlp: hidden layers")
    parser.add_argument(
        "--chunk-bytes",
        type=parse_size,
        default=None,
        help="mpidp chunk_bytes for every setting (default: mpidp's; 0 = never chunk)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank (default: CPUs / ranks on this host)",
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--csv", default="out/bucket_sweep.csv")
    parser.add_argument(
        "--png", default="out/bucket_sweep.png", help="plot file; empty string: no plot"
    )
    args = parser.parse_args()
    if args.batch_size is None:
        args.batch_size = 16 if args.model == "resnet18" else 32
    for name in ("rounds", "steps", "batch_size", "image_size", "mlp_width", "mlp_depth"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    return args


class MLP(nn.Module):
    """`depth` hidden layers of `width` features, ReLU, 10 classes: ~6.3 M parameters by default."""

    def __init__(self, width, depth, num_classes=10):
        super().__init__()
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, num_classes)

    def forward(self, x):
        for layer in self.hidden:
            x = F.relu(layer(x))
        return self.out(x)


def build(args):
    if args.model == "resnet18":
        model, classes = resnet18(1000), 1000
        shape = (args.batch_size, 3, args.image_size, args.image_size)
    else:
        model, classes = MLP(args.mlp_width, args.mlp_depth), 10
        shape = (args.batch_size, args.mlp_width)
    return model, shape, classes


def init_engine(size_bytes, args):
    """A fresh engine whose buckets and fusion buffers hold at most `size_bytes` (0: one
    operation and one allreduce per gradient)."""
    mpidp.shutdown()
    knobs = {
        "bucket_bytes": size_bytes,
        "fusion_threshold_bytes": size_bytes,
        "fuse_below_bytes": max(size_bytes, 1),
    }
    if args.chunk_bytes is not None:
        knobs["chunk_bytes"] = args.chunk_bytes
    mpidp.init(**knobs)


def measure(setting, args, initial_state, data, target):
    """(seconds per step on this rank, mpidp's counters over the timed steps or None) for one
    setting: a fusion size, or None (no communication)."""
    if setting is not None:
        init_engine(setting, args)
    model, _, _ = build(args)
    model.load_state_dict(initial_state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if setting is not None:
        optimizer = mpidp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    def step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    gc.collect()  # frees the previous setting's model now rather than during the timed steps
    mpidp.barrier()  # every rank starts timing together
    window = observe.stats_window().start() if setting is not None else None
    began = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = (time.perf_counter() - began) / args.steps
    if window is None:
        return seconds, None
    counts = window.stop()
    return seconds, {
        "engine_busy": window.comm_fraction,
        "bytes_per_step": counts["bytes"] / args.steps,
        "tensors_per_collective": counts["tensors_per_collective"],
    }


def write_csv(path, rows):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "fusion_bytes",
                "step_ms",
                "samples_per_s",
                "comm_fraction",
                "ranks",
                "engine_busy",
                "bytes_per_step",
                "tensors_per_collective",
            ]
        )
        for r in rows:
            writer.writerow(
                [
                    r["fusion_bytes"],
                    f"{r['step_ms']:.3f}",
                    f"{r['samples_per_s']:.2f}",
                    f"{r['comm_fraction']:.4f}",
                    r["ranks"],
                    f"{r['engine_busy']:.4f}",
                    f"{r['bytes_per_step']:.0f}",
                    f"{r['tensors_per_collective']:.2f}",
                ]
            )


def plot(path, rows, nocomm_ms, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["fusion_bytes"] for r in rows]
    nonzero = [s for s in sizes if s > 0]
    # 0 (no fusion) has no place on a log axis: draw it one step left of the smallest size.
    zero_x = (min(nonzero) / 4) if nonzero else 1.0
    xs = [s if s > 0 else zero_x for s in sizes]
    labels = [human(s) if s > 0 else "off" for s in sizes]

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(xs, [r["step_ms"] for r in rows], "o-", color="tab:blue", label="step time")
    ax.axhline(nocomm_ms, color="tab:blue", linestyle=":", label="no communication")
    ax.set_xscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels)
    ax.minorticks_off()
    ax.set_xlabel("fusion buffer size (bytes; off = one allreduce per gradient)")
    ax.set_ylabel("step time (ms)", color="tab:blue")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.plot(
        xs,
        [r["comm_fraction"] for r in rows],
        "s--",
        color="tab:red",
        label="communication fraction",
    )
    ax2.set_ylabel("communication fraction 1 - t_nocomm / t_step", color="tab:red")
    low = min(0.0, min(r["comm_fraction"] for r in rows))
    ax2.set_ylim(low, max(0.5, max(r["comm_fraction"] for r in rows) * 1.15))
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="best", fontsize="small")
    ax.set_title(title, fontsize="medium")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    args = parse_args()
    mpidp.init()
    rank, size = mpidp.rank(), mpidp.size()
    threads = args.threads or max(1, cpu_count() // mpidp.local_size())
    torch.set_num_threads(threads)

    torch.manual_seed(args.seed)
    model, shape, classes = build(args)
    initial_state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.numel() * p.element_size() for p in model.parameters()]  # bytes per gradient
    n_params = sum(p.numel() for p in model.parameters())
    del model
    generator = torch.Generator().manual_seed(args.seed + rank)
    data = torch.randn(*shape, generator=generator)
    target = torch.randint(0, classes, (args.batch_size,), generator=generator)

    settings = [None] + list(args.sizes)  # None: the no-communication baseline
    if rank == 0:
        what = (
            f"resnet18 ({args.image_size}x{args.image_size} input)"
            if args.model == "resnet18"
            else f"mlp ({args.mlp_depth} x {args.mlp_width})"
        )
        print(
            f"bucket sweep: {what}, {n_params / 1e6:.2f} M parameters in {len(grads)} "
            f"tensors ({sum(grads) / 1e6:.1f} MB of gradients), batch {args.batch_size} per "
            f"rank, {size} rank(s), {threads} torch thread(s) per rank; {args.rounds} rounds "
            f"x {len(settings)} settings x {args.steps} steps",
            flush=True,
        )

    # One untimed pass with and without communication: torch's and mpidp's first-use costs
    # (lazy imports, allocator growth, first negotiation) land here. Then freeze what exists:
    # a full collection scans every object torch created (0.5 s here), so the collection before
    # each timed block should look only at what the sweep allocated since.
    measure(None, args, initial_state, data, target)
    measure(args.sizes[-1], args, initial_state, data, target)
    gc.collect()
    gc.freeze()
    times = {s: [] for s in settings}  # this rank's seconds per step, one entry per round
    counters = {s: [] for s in args.sizes}  # this rank's engine counters, one per round
    began = time.perf_counter()
    for rnd in range(args.rounds):
        shift = rnd % len(settings)
        for setting in settings[shift:] + settings[:shift]:
            seconds, counts = measure(setting, args, initial_state, data, target)
            times[setting].append(seconds)
            if counts is not None:
                counters[setting].append(counts)
        if rank == 0:
            print(
                f"round {rnd + 1}/{args.rounds} done ({time.perf_counter() - began:.0f} s)",
                flush=True,
            )

    everyone = mpidp.allgather_object(times, name="bucket_sweep.times")
    mpidp.shutdown()
    if rank != 0:
        return

    def median_ms(setting):
        # Per round the slowest rank's time (ranks wait for each other), then the median.
        return 1e3 * statistics.median(
            max(t[setting][r] for t in everyone) for r in range(args.rounds)
        )

    nocomm_ms = median_ms(None)
    rows = []
    for s in args.sizes:
        step_ms = median_ms(s)
        row = {
            "fusion_bytes": s,
            "step_ms": step_ms,
            "samples_per_s": args.batch_size * size / (step_ms / 1e3),
            "comm_fraction": 1.0 - nocomm_ms / step_ms,
            "ranks": size,
        }
        for key in ("engine_busy", "bytes_per_step", "tensors_per_collective"):
            row[key] = statistics.median(c[key] for c in counters[s])  # rank 0's engine
        rows.append(row)

    print(
        f"no communication: {nocomm_ms:.1f} ms/step "
        f"({args.batch_size * size / (nocomm_ms / 1e3):.1f} samples/s)"
    )
    print(
        f"{'fusion':>8} {'fusable':>14} {'step ms':>9} {'samples/s':>10} "
        f"{'comm fraction':>14} {'engine_busy':>11} {'MB_per_step':>11} {'tensors/coll':>12}"
    )
    for r in rows:
        s = r["fusion_bytes"]
        fusable = sum(1 for g in grads if g < s)
        print(
            f"{human(s) if s else 'off':>8} {fusable:>8} of {len(grads):<3} {r['step_ms']:>9.1f} "
            f"{r['samples_per_s']:>10.1f} {r['comm_fraction']:>14.3f} "
            f"{r['engine_busy']:>11.3f} {r['bytes_per_step'] / 1e6:>11.1f} "
            f"{r['tensors_per_collective']:>12.1f}"
        )
    best = min(rows, key=lambda r: r["step_ms"])
    print(
        f"fastest: {human(best['fusion_bytes']) if best['fusion_bytes'] else 'off'} "
        f"({best['step_ms']:.1f} ms/step)"
    )
    write_csv(args.csv, rows)
    print(f"wrote {args.csv}")
    if args.png:
        plot(
            args.png,
            rows,
            nocomm_ms,
            f"{args.model}, {size} ranks, batch {args.batch_size}/rank, "
            f"medians of {args.rounds} rounds",
        )
        print(f"wrote {args.png}", flush=True)


if __name__ == "__main__":
    main()
