"""Soak: mixed collectives for many engine cycles, every result checked, memory growth measured.

    mpiexec -n 2 python benchmarks/soak.py [--cycles 20000] [--warmup-cycles 2000]
                                            [--max-growth-pct 5] [--no-rss-check]

Each round runs the same mix on every rank: allreduce of varied sizes and dtypes (named from a
small set of cached names, freshly named, and unnamed), a grouped allreduce, an allgather with
uneven first dimensions, a broadcast from a rotating root, an alltoall with splits, a
reduce-scatter, a batch of async submissions completed out of order, and now and then a join()
where one rank keeps reducing after the others joined. Rounds go on until rank 0's engine has run
`--cycles` cycles (rank 0 decides, every rank follows, so the op sequences stay matched).

Resident set size (VmRSS) is sampled on every rank once `--warmup-cycles` have passed and at the
end. Each rank prints (through rank 0, one block) its cycles, ops, RSS and growth; the job exits
non-zero if any result was wrong or, unless --no-rss-check, if any rank grew by the limit or more.
"""

import argparse
import gc
import sys
import time

import torch

import mpidp
from mpidp.runtime import observe

MiB = 1024 * 1024
CACHED_NAMES = 48  # names reused every round: they live in the response cache
SIZES = (1, 7, 100, 4096, 70_000, 300_000)  # elements: fused, unfused and chunked paths
DTYPES = (
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
)


def rss_bytes() -> int:
    """This process's resident set size, from /proc/self/status (VmRSS, in kB)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS line in /proc/self/status")


def cycles() -> int:
    """Engine cycles this rank has run since init() (idle ones included)."""
    return observe.stats()["cycles"]


class Soak:
    """One rank's side of the soak: submits the round's ops and checks every result."""

    def __init__(self, join_every: int):
        self.rank, self.size = mpidp.rank(), mpidp.size()
        self.join_every = join_every
        self.ops = 0
        self.joins = 0
        self.errors = []

    def check(self, ok: bool, what: str) -> None:
        if not ok and len(self.errors) < 20:
            self.errors.append(what)

    def allreduce(self, i: int) -> None:
        n, r = self.size, self.rank
        numel = SIZES[i % len(SIZES)]
        dtype = DTYPES[(i // len(SIZES)) % len(DTYPES)]
        kind = i % 3
        name = (f"soak.ar.{i % CACHED_NAMES}", f"soak.new.{i}", None)[kind]
        # Small integers: exact in every dtype, sums of n ranks stay small.
        t = torch.full((numel,), (r + i) % 3, dtype=dtype)
        want = sum((k + i) % 3 for k in range(n))
        out = mpidp.allreduce(t, op=mpidp.Sum, name=name)
        self.ops += 1
        self.check(
            out.dtype == dtype
            and out.numel() == numel
            and float(out[0]) == want
            and float(out[-1]) == want,
            f"round {i}: allreduce {dtype} x{numel} gave {out[:2].tolist()}, want {want}",
        )

    def grouped(self, i: int) -> None:
        n = self.size
        tensors = [torch.full((k * 13 + 1,), float(self.rank + k)) for k in range(3 + i % 3)]
        name = f"soak.group.{i % 8}" if i % 2 else None
        outs = mpidp.grouped_allreduce(tensors, op=mpidp.Sum, name=name)
        self.ops += 1
        self.check(
            all(float(o[0]) == n * k + n * (n - 1) / 2 for k, o in enumerate(outs)),
            f"round {i}: grouped_allreduce {[o[0].item() for o in outs]}",
        )

    def gather_bcast(self, i: int) -> None:
        n, r = self.size, self.rank
        g = mpidp.allgather(
            torch.full((r + 1 + i % 2, 3), r, dtype=torch.int32), name=f"soak.ag.{i % CACHED_NAMES}"
        )
        want = [k for k in range(n) for _ in range(k + 1 + i % 2)]
        self.check(g[:, 2].tolist() == want, f"round {i}: allgather {g[:, 0].tolist()}")
        root = i % n
        b = mpidp.broadcast(
            torch.full((64,), float(r * 10 + i % 7)),
            root,
            name=f"soak.bc.{i}" if i % 4 == 0 else None,
        )
        self.check(float(b[0]) == root * 10 + i % 7, f"round {i}: broadcast {b[0].item()}")
        self.ops += 2

    def alltoall_rs(self, i: int) -> None:
        n, r = self.size, self.rank
        splits = [(k + i) % 3 for k in range(n)]
        rows = torch.arange(sum(splits) * 2, dtype=torch.float64).reshape(-1, 2) + 1000 * r
        out, received = mpidp.alltoall(rows, splits=splits, name=f"soak.a2a.{i % 5}")
        self.check(
            received.tolist() == [(r + i) % 3] * n and out.shape[0] == n * ((r + i) % 3),
            f"round {i}: alltoall received {received.tolist()}",
        )
        rs = mpidp.reducescatter(torch.ones(2 * n + i % 3, 4), op=mpidp.Sum)
        rows_here = (2 * n + i % 3) // n + (1 if r < (2 * n + i % 3) % n else 0)
        self.check(
            tuple(rs.shape) == (rows_here, 4) and bool((rs == n).all()),
            f"round {i}: reducescatter shape {tuple(rs.shape)}",
        )
        self.ops += 2

    def async_batch(self, i: int) -> None:
        n = self.size
        handles = [
            mpidp.allreduce_async(
                torch.full((k + 1,), float(k)), op=mpidp.Sum, name=f"soak.async.{k}"
            )
            for k in range(8)
        ]
        for k in reversed(range(8)):  # completed out of submission order
            out = mpidp.synchronize(handles[k])
            self.check(float(out[0]) == k * n, f"round {i}: async {k} gave {out[0].item()}")
        self.ops += 8

    def join_round(self, i: int) -> None:
        """Every rank but the last joins at once; the last reduces alone (the joined ranks
        contribute zeros), then joins too."""
        n, r = self.size, self.rank
        if r == n - 1:
            out = mpidp.allreduce(torch.full((5,), 3.0), op=mpidp.Sum, name="soak.after_join")
            self.check(
                out.tolist() == [3.0] * 5,
                f"round {i}: allreduce beside joined ranks {out.tolist()}",
            )
            self.ops += 1
        last = mpidp.join()
        self.check(last == n - 1, f"round {i}: join() said rank {last} joined last")
        self.ops += 1
        self.joins += 1

    def round(self, i: int) -> None:
        for k in range(4):
            self.allreduce(4 * i + k)
        self.grouped(i)
        self.gather_bcast(i)
        self.alltoall_rs(i)
        if i % 5 == 0:
            self.async_batch(i)
        if i % self.join_every == self.join_every - 1:
            self.join_round(i)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=20000)
    parser.add_argument("--warmup-cycles", type=int, default=2000)
    parser.add_argument("--max-growth-pct", type=float, default=5.0)
    parser.add_argument("--join-every", type=int, default=50, help="rounds between join() rounds")
    parser.add_argument(
        "--no-rss-check",
        action="store_true",
        help="report RSS growth but do not fail on it (short runs in tests)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    mpidp.init()
    soak = Soak(args.join_every)
    start = time.perf_counter()
    rss_warm = warm_cycles = warm_ops = None
    i = 0
    while True:
        soak.round(i)
        i += 1
        # Rank 0's count decides for everyone, so every rank runs the same rounds.
        state = torch.tensor(
            [cycles() >= args.warmup_cycles, cycles() >= args.cycles], dtype=torch.int32
        )
        warm, done = mpidp.broadcast(state, 0, name="soak.progress").tolist()
        soak.ops += 1
        if warm and rss_warm is None:
            gc.collect()
            rss_warm, warm_cycles, warm_ops = rss_bytes(), cycles(), soak.ops
        if done:
            break
    gc.collect()
    rss_end, seconds = rss_bytes(), time.perf_counter() - start
    growth = 100.0 * (rss_end - rss_warm) / rss_warm
    rss_ok = growth < args.max_growth_pct or args.no_rss_check
    counters = observe.stats()
    mine = dict(
        rank=soak.rank,
        rounds=i,
        cycles=counters["cycles"],
        ops=soak.ops,
        joins=soak.joins,
        errors=soak.errors,
        hits=counters["cache_hits"],
        misses=counters["cache_misses"],
        rss_warm=rss_warm,
        rss_end=rss_end,
        growth=growth,
        rss_ok=rss_ok,
        warm_cycles=warm_cycles,
        warm_ops=warm_ops,
    )
    views = mpidp.allgather_object(mine, name="soak.report")
    if soak.rank == 0:
        print(
            f"mpidp soak: {soak.size} ranks, {i} rounds in {seconds:.1f} s, RSS limit "
            f"{args.max_growth_pct:g} % after {args.warmup_cycles} warm-up cycles"
            f"{' (not enforced)' if args.no_rss_check else ''}"
        )
        for v in views:
            verdict = "PASS" if v["rss_ok"] and not v["errors"] else "FAIL"
            print(
                f"rank {v['rank']}: {v['cycles']} cycles, {v['ops']} ops, {v['joins']} joins "
                f"({v['ops'] - v['warm_ops']} after warm-up at cycle {v['warm_cycles']}; "
                f"cache {v['hits']} hits, {v['misses']} misses), "
                f"RSS {v['rss_warm'] / MiB:.1f} -> {v['rss_end'] / MiB:.1f} MiB, growth "
                f"{v['growth']:+.2f} %, {len(v['errors'])} wrong results: {verdict}"
            )
            for e in v["errors"]:
                print(f"  rank {v['rank']}: {e}")
        sys.stdout.flush()
    mpidp.shutdown()
    failed = any(v["errors"] or not v["rss_ok"] for v in views)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
