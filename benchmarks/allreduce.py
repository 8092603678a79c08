"""Allreduce benchmark: mpidp against raw mpi4py, side by side in one MPI job.

    mpiexec -n 2 python benchmarks/allreduce.py [--rounds 15] [--sizes 4,1K,64M] [--skip-idle]
                                                [--json out.json]

Cases: ResNet-18's 62 gradient tensors (11,689,512 float32) and single float32 tensors of 4 B to
64 MB. Contenders, run once each per round, in an order shuffled anew each round:

  mpidp          allreduce_async_(t, name=..., op=Sum) for every tensor, then synchronize() each
  mpidp_grouped  (sets of tensors) grouped_allreduce_async_ of the whole set, then synchronize():
                 one op, every tensor checked at every call (the public API)
  mpidp_bucket   (sets of tensors) the whole set as one op submitted as DistributedOptimizer's
                 step() submits a gradient bucket: checked at the first call, whose request
                 later calls reuse (ops.bucket_allreduce_async_), submitted for the caller to
                 drive (ops.blocking) and synchronized at once
  raw_per_tensor one comm.Allreduce(IN_PLACE) per tensor
  raw_fused      copy every tensor into one buffer, one Allreduce, copy back
  raw_fused_4M   the same buffer reduced in 4 MB chunks (one Allreduce per chunk)
  raw_hybrid     tensors < 64 KB copied into one buffer and reduced at once; each larger tensor
                 reduced in place, in 4 MB chunks (mpidp's own policy, written by hand)
  raw_chunk_4M   (single tensors) one in-place Allreduce per 4 MB slice

"best raw" is, per case, the fastest raw contender of the same run. Every sample is the largest
elapsed time over the ranks, taken after a barrier; tables give medians over the rounds. Raw
calls use MPI.COMM_WORLD.Dup(); mpidp uses its own communicators, as a user's program would.

Also: latency of a blocking 4-byte allreduce (mpidp.allreduce on one named float32 vs raw
Allreduce of 4 B), and the CPU time of an idle engine (process CPU time while the main thread
sleeps, after init(), minus the same measurement before init()).
"""

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

import numpy as np
import torch
from mpi4py import MPI
from rounds import order as rounds_order

import mpidp

MB = 1024 * 1024
CHUNK_BYTES = 4 * MB  # raw chunked strategies
HYBRID_FUSE_BELOW = 64 * 1024  # raw_hybrid: smaller tensors are fused

# ResNet-18 (torchvision) parameters in model.parameters() order: 62 tensors, 11,689,512 floats.
_BN = lambda c: [(c,), (c,)]  # noqa: E731  (weight, bias)


def _basic_block(cin, cout, downsample):
    shapes = [(cout, cin, 3, 3)] + _BN(cout) + [(cout, cout, 3, 3)] + _BN(cout)
    if downsample:
        shapes += [(cout, cin, 1, 1)] + _BN(cout)
    return shapes


RESNET18_SHAPES = (
    [(64, 3, 7, 7)]
    + _BN(64)  # conv1, bn1
    + _basic_block(64, 64, False)
    + _basic_block(64, 64, False)  # layer1
    + _basic_block(64, 128, True)
    + _basic_block(128, 128, False)  # layer2
    + _basic_block(128, 256, True)
    + _basic_block(256, 256, False)  # layer3
    + _basic_block(256, 512, True)
    + _basic_block(512, 512, False)  # layer4
    + [(1000, 512), (1000,)]  # fc
)
assert len(RESNET18_SHAPES) == 62
assert sum(math.prod(s) for s in RESNET18_SHAPES) == 11_689_512

DEFAULT_SIZES = "4,16,64,256,1K,4K,16K,64K,256K,1M,4M,16M,64M"


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B")
    mult = {"K": 1024, "M": MB, "G": 1024 * MB}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def fmt_bytes(n: int) -> str:
    for unit, div in (("GB", 1024 * MB), ("MB", MB), ("KB", 1024)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def fmt_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    return f"{s * 1e3:.2f} ms"


# ---- raw strategies ----


class Raw:
    """Raw mpi4py strategies on a list of float32 tensors, on the benchmark's own communicator."""

    def __init__(self, comm, tensors):
        self.comm = comm
        self.tensors = tensors
        self.flat = [t.view(-1) for t in tensors]
        self.arrays = [t.view(-1).numpy() for t in tensors]
        self.sizes = [t.numel() for t in tensors]
        total = sum(self.sizes)
        self.buf = torch.empty(total, dtype=torch.float32)
        self.buf_np = self.buf.numpy()
        self.parts = list(self.buf.split(self.sizes))
        small = [i for i, t in enumerate(tensors) if t.numel() * 4 < HYBRID_FUSE_BELOW]
        self.small = small
        self.large = [i for i in range(len(tensors)) if i not in set(small)]
        n_small = sum(self.sizes[i] for i in small)
        self.sbuf = torch.empty(max(n_small, 1), dtype=torch.float32)[:n_small]
        self.sbuf_np = self.sbuf.numpy()
        self.sparts = list(self.sbuf.split([self.sizes[i] for i in small]))
        self.sflat = [self.flat[i] for i in small]

    def _chunked(self, arr):
        step = CHUNK_BYTES // 4
        if arr.size <= step:
            self.comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM)
            return
        for lo in range(0, arr.size, step):
            self.comm.Allreduce(MPI.IN_PLACE, arr[lo : lo + step], op=MPI.SUM)

    def per_tensor(self):
        for a in self.arrays:
            self.comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)

    def chunked_per_tensor(self):
        for a in self.arrays:
            self._chunked(a)

    def fused(self):
        torch.cat(self.flat, out=self.buf)
        self.comm.Allreduce(MPI.IN_PLACE, self.buf_np, op=MPI.SUM)
        torch._foreach_copy_(self.flat, self.parts)

    def fused_chunked(self):
        torch.cat(self.flat, out=self.buf)
        self._chunked(self.buf_np)
        torch._foreach_copy_(self.flat, self.parts)

    def hybrid(self):
        if self.small:
            torch.cat(self.sflat, out=self.sbuf)
            self.comm.Allreduce(MPI.IN_PLACE, self.sbuf_np, op=MPI.SUM)
            torch._foreach_copy_(self.sflat, self.sparts)
        for i in self.large:
            self._chunked(self.arrays[i])


def mpidp_run(tensors, prefix, op):
    handles = [
        mpidp.allreduce_async_(t, name=f"{prefix}.{i}", op=op) for i, t in enumerate(tensors)
    ]
    for h in handles:
        mpidp.synchronize(h)


def mpidp_grouped(tensors, prefix, op):
    """The whole set as one op through the public grouped call."""
    mpidp.synchronize(mpidp.grouped_allreduce_async_(tensors, name=f"{prefix}.grouped", op=op))


class BucketOp:
    """The whole set as one op, as DistributedOptimizer submits a gradient bucket: the first
    call goes through grouped_allreduce_async_, later calls reuse its checked request."""

    def __init__(self, tensors, prefix, op):
        self.tensors, self.name, self.op = tensors, f"{prefix}.bucket", op
        self.request = self.cache_key = None

    def __call__(self):
        if self.request is None:
            handle = mpidp.grouped_allreduce_async_(self.tensors, name=self.name, op=self.op)
            entry = mpidp.runtime.world.state().handles.members(handle)[0]
            self.request, self.cache_key = entry.request, entry.cache_key
        else:
            with mpidp.ops.blocking():  # as the optimizer's step() submits what it waits for
                handle = mpidp.ops.bucket_allreduce_async_(
                    self.request, self.tensors, None, self.cache_key
                )
        mpidp.synchronize(handle)


# ---- measurement ----


def timed(comm, fn, reps: int) -> float:
    """Seconds per call of fn (reps calls after a barrier), the largest over the ranks."""
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    dt = (time.perf_counter() - t0) / reps
    return comm.allreduce(dt, op=MPI.MAX)


def check(comm, tensors, fn, what):
    """One correctness check: every rank fills rank+1, the sum must come back everywhere."""
    size = comm.Get_size()
    for t in tensors:
        t.fill_(comm.Get_rank() + 1)
    fn()
    want = size * (size + 1) / 2
    bad = [i for i, t in enumerate(tensors) if not bool((t == want).all())]
    if bad:
        raise AssertionError(f"{what}: wrong result in tensors {bad[:5]} on rank {comm.Get_rank()}")
    for t in tensors:
        t.zero_()


def reps_for(nbytes: int) -> int:
    """Calls per sample: enough that small cases are not one timer tick."""
    if nbytes <= 64 * 1024:
        return 50
    if nbytes <= MB:
        return 10
    return 1


def bench_case(comm, name, tensors, contenders, rounds, warmup, reps):
    """{contender: [seconds per call, one per round]}; contenders shuffled anew each round."""
    for label, fn in contenders:
        check(comm, tensors, fn, f"{name}/{label}")
        for _ in range(warmup):
            fn()
    samples = {label: [] for label, _ in contenders}
    for r in range(rounds):
        for label, fn in rounds_order(contenders, r):
            samples[label].append(timed(comm, fn, reps))
    return samples


def case_contenders(comm, tensors, prefix, op):
    raw = Raw(comm, tensors)
    run_mpidp = lambda: mpidp_run(tensors, prefix, op)  # noqa: E731
    if len(tensors) == 1:
        return [
            ("mpidp", run_mpidp),
            ("raw_per_tensor", raw.per_tensor),
            ("raw_chunk_4M", raw.chunked_per_tensor),
        ]
    run_grouped = lambda: mpidp_grouped(tensors, prefix, op)  # noqa: E731
    return [
        ("mpidp", run_mpidp),
        ("mpidp_grouped", run_grouped),
        ("mpidp_bucket", BucketOp(tensors, prefix, op)),
        ("raw_per_tensor", raw.per_tensor),
        ("raw_fused", raw.fused),
        ("raw_fused_4M", raw.fused_chunked),
        ("raw_hybrid", raw.hybrid),
    ]


def summarize(samples):
    med = {label: statistics.median(v) for label, v in samples.items()}
    raws = {k: v for k, v in med.items() if k.startswith("raw")}
    best = min(raws, key=raws.get)
    out = {
        "median_s": med,
        "best_raw": best,
        "ratio": med["mpidp"] / raws[best],
        "samples_s": samples,
    }
    for label in ("mpidp_grouped", "mpidp_bucket"):
        if label in med:
            out["ratio_" + label[len("mpidp_") :]] = med[label] / raws[best]
    return out


def bench_latency(comm, iters, blocks=10):
    """Blocking 4-byte allreduce, per-call seconds; mpidp and raw alternate in blocks."""
    t = torch.ones(1, dtype=torch.float32)
    a = np.ones(1, dtype=np.float32)
    per = max(1, iters // blocks)
    for _ in range(200):  # warm-up: the name gets its cache bit
        mpidp.allreduce(t, name="lat4", op=mpidp.Sum)
        comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
    out = {"mpidp": [], "raw": []}
    for _ in range(blocks):
        comm.Barrier()
        for _ in range(per):
            t0 = time.perf_counter()
            mpidp.allreduce(t, name="lat4", op=mpidp.Sum)
            out["mpidp"].append(time.perf_counter() - t0)
        comm.Barrier()
        for _ in range(per):
            t0 = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
            out["raw"].append(time.perf_counter() - t0)
    # Per-call medians on each rank; report the larger.
    res = {}
    for k, v in out.items():
        mine = statistics.median(v)
        res[k] = comm.allreduce(mine, op=MPI.MAX)
        p90 = comm.allreduce(float(np.percentile(v, 90)), op=MPI.MAX)
        res[k + "_p90"] = p90
    return res


def bench_wake(comm, trials, idle_s=0.2):
    """Blocking 4-byte allreduce after each rank idled `idle_s` (the engine asleep),
    mpidp and raw alternating; raw shows what a cold process costs on its own."""
    t = torch.ones(1, dtype=torch.float32)
    a = np.ones(1, dtype=np.float32)
    out = {"mpidp": [], "raw": []}
    for i in range(2 * trials):
        which = "mpidp" if i % 2 == 0 else "raw"
        comm.Barrier()
        time.sleep(idle_s)
        t0 = time.perf_counter()
        if which == "mpidp":
            mpidp.allreduce(t, name="wake4", op=mpidp.Sum)
        else:
            comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
        out[which].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return {
        "median": statistics.median(out["mpidp"]),
        "max": max(out["mpidp"]),
        "raw_median": statistics.median(out["raw"]),
        "raw_max": max(out["raw"]),
        "samples": out["mpidp"],
        "raw_samples": out["raw"],
    }


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def idle_cpu(comm, seconds):
    """Fraction of one core used by this process while the main thread sleeps `seconds`."""
    comm.Barrier()
    c0, w0 = cpu_seconds(), time.perf_counter()
    time.sleep(seconds)
    c1, w1 = cpu_seconds(), time.perf_counter()
    return (c1 - c0) / (w1 - w0)


# ---- main ----


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help="single-tensor sizes in bytes, comma separated (K, M suffixes); '' for none",
    )
    ap.add_argument("--skip-resnet", action="store_true")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--skip-idle", action="store_true")
    ap.add_argument("--idle-seconds", type=float, default=10.0)
    ap.add_argument("--latency-iters", type=int, default=2000)
    ap.add_argument(
        "--wake-trials",
        type=int,
        default=10,
        help="after the idle measurement: blocking 4 B allreduces, each after "
        "0.2 s of idling (the latency waking an idle engine adds)",
    )
    ap.add_argument(
        "--op",
        choices=("sum", "average"),
        default="sum",
        help="mpidp reduce op (Average adds one scaling pass over the data)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--json", help="write every sample and median here (rank 0)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    world = MPI.COMM_WORLD
    comm = world.Dup()  # the raw contenders' communicator
    rank, size = comm.Get_rank(), comm.Get_size()
    op = mpidp.Sum if args.op == "sum" else mpidp.Average

    result = {
        "np": size,
        "argv": sys.argv[1:],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "env": {k: v for k, v in os.environ.items() if k.startswith("MPIDP_")},
        "cases": {},
    }

    if not args.skip_idle:
        base = idle_cpu(comm, args.idle_seconds)  # before init(): MPI + torch alone

    mpidp.init()
    result["config"] = {
        k: v for k, v in vars(mpidp.runtime.world.state().config).items() if k != "explicit"
    }

    cases = []
    if not args.skip_resnet:
        cases.append(("resnet18", [torch.zeros(s, dtype=torch.float32) for s in RESNET18_SHAPES]))
    for text in filter(None, args.sizes.split(",")):
        nbytes = parse_size(text)
        cases.append((fmt_bytes(nbytes), [torch.zeros(max(1, nbytes // 4), dtype=torch.float32)]))

    for name, tensors in cases:
        nbytes = sum(t.numel() for t in tensors) * 4
        reps = 1 if len(tensors) > 1 else reps_for(nbytes)
        contenders = case_contenders(comm, tensors, f"c.{name}", op)
        samples = bench_case(comm, name, tensors, contenders, args.rounds, args.warmup, reps)
        summary = summarize(samples)
        summary.update(bytes=nbytes, tensors=len(tensors), reps=reps)
        result["cases"][name] = summary
        del tensors, contenders

    if not args.skip_latency:
        result["latency4"] = bench_latency(comm, args.latency_iters)

    if not args.skip_idle:
        # Let the engine fall asleep first, as it would between training steps.
        time.sleep(0.5)
        busy = idle_cpu(comm, args.idle_seconds)
        per_rank = comm.gather((base, busy), root=0)
        wake = bench_wake(comm, args.wake_trials) if args.wake_trials else None
        if rank == 0:
            result["idle"] = {
                "baseline_core_frac": [b for b, _ in per_rank],
                "mpidp_core_frac": [m for _, m in per_rank],
                "engine_core_frac": [m - b for b, m in per_rank],
                "seconds": args.idle_seconds,
            }
            if wake:
                result["wake4"] = wake

    if rank == 0:
        report(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    mpidp.shutdown()
    comm.Free()


def report(res):
    print(
        f"# mpidp allreduce benchmark, np={res['np']}, {res['date']}, "
        f"args {' '.join(res['argv']) or '(defaults)'}"
    )
    cfg = res.get("config", {})
    print(
        "# knobs: "
        + ", ".join(
            f"{k}={v}"
            for k, v in cfg.items()
            if k
            in (
                "fusion_threshold_bytes",
                "fuse_below_bytes",
                "chunk_bytes",
                "cycle_time_ms",
                "bucket_bytes",
            )
        )
    )
    labels = [
        "mpidp",
        "mpidp_grouped",
        "mpidp_bucket",
        "raw_per_tensor",
        "raw_fused",
        "raw_fused_4M",
        "raw_hybrid",
        "raw_chunk_4M",
    ]
    head = (
        f"{'case':>10} "
        + " ".join(f"{lab:>14}" for lab in labels)
        + f" {'best raw':>14} {'mpidp/best':>10}"
    )
    print(head)
    for name, c in res["cases"].items():
        med = c["median_s"]
        cells = " ".join(f"{fmt_time(med[lab]) if lab in med else '-':>14}" for lab in labels)
        print(f"{name:>10} {cells} {c['best_raw']:>14} {c['ratio']:>10.2f}")
    if "resnet18" in res["cases"]:
        c = res["cases"]["resnet18"]
        r = c.get("ratio_bucket", float("nan"))
        print(
            f"ResNet-18 set: per-tensor ops {c['ratio']:.2f} x best raw, one grouped call "
            f"{c.get('ratio_grouped', float('nan')):.2f} x, one bucket op as the optimizer "
            f"submits it {r:.2f} x; goal (bucket op) <= 1.05 x best raw: "
            f"{'MET' if r <= 1.05 else 'NOT MET'}"
        )
    if "latency4" in res:
        lat = res["latency4"]
        print(
            f"blocking 4 B allreduce: mpidp median {fmt_time(lat['mpidp'])} "
            f"(p90 {fmt_time(lat['mpidp_p90'])}), raw {fmt_time(lat['raw'])} "
            f"(p90 {fmt_time(lat['raw_p90'])}); goal <= 50 us: "
            f"{'MET' if lat['mpidp'] <= 50e-6 else 'NOT MET'}"
        )
    if "idle" in res:
        idle = res["idle"]
        worst = max(idle["engine_core_frac"])
        print(
            f"idle engine over {idle['seconds']:g} s: "
            + ", ".join(
                f"rank {i} {100 * e:.2f} % (process {100 * m:.2f} %, baseline {100 * b:.2f} %)"
                for i, (e, m, b) in enumerate(
                    zip(
                        idle["engine_core_frac"],
                        idle["mpidp_core_frac"],
                        idle["baseline_core_frac"],
                    )
                )
            )
            + f"; goal < 0.2 %: {'MET' if worst < 0.002 else 'NOT MET'}"
        )
    if "wake4" in res:
        w = res["wake4"]
        print(
            f"blocking 4 B allreduce after 0.2 s idle: median {fmt_time(w['median'])}, "
            f"max {fmt_time(w['max'])} over {len(w['samples'])} trials; raw the same way: "
            f"median {fmt_time(w['raw_median'])}, max {fmt_time(w['raw_max'])}; goal <= 2 x "
            f"raw: {w['median'] / w['raw_median']:.2f} x "
            f"{'MET' if w['median'] <= 2 * w['raw_median'] else 'NOT MET'}"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
