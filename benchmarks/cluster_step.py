"""Training step across hosts on a shaped link, every contender in one job, against its limit.

    mpiexec -hosts hosta:1,hostb:1 -n 2 python benchmarks/cluster_step.py --profile 1gbe \
        [--rounds 3] [--steps 3] [--models resnet18,mlp6.3M,wide12.6M] [--json out.json]
    python benchmarks/cluster_step.py --summarize a.json b.json ... [--plot out.png]

Run on the test cluster of tests/integration/multihost_cluster.py (docs/clusters.md), at
2 hosts x 1 rank or 2 hosts x 2 ranks. One torch thread per rank. Contenders, each on its own
copy of the model (same initial weights), in an order shuffled anew each round:
- no communication (t_compute);
- mpidp default (MPIDP_OVERLAP as set, `auto` unless the environment says otherwise), overlap
  forced on and forced off (what MPIDP_OVERLAP=1 / 0 decide, set on the optimizer as
  train_step.py --overlap-ab does), fp16 compression (Compression.fp16);
- mpidp hierarchical (only with several ranks on each host): the default optimizer with the
  engine's host path switched to the hierarchical allreduce around its steps (what
  MPIDP_HIERARCHICAL_ALLREDUCE=1 decides at init);
- hand-written MPI after backward: one in-place Allreduce per gradient (train_step.py's);
- DDP over gloo, and DDP with torch's fp16_compress_hook, on the same links: the gloo store
  at rank 0's address on the cluster's bridge (MASTER_ADDR), GLOO_SOCKET_IFNAME the interface
  that address is on;
- DDP over mpidp's torch.distributed backend (a group on backend "mpidp"), and with the fp16
  hook: what a torch.distributed script gets across hosts by switching gloo for mpidp.

Each step's time is the slowest rank's median. The limits, for gradient bytes G (fp32; half for
the fp16 contenders), n hosts, the link rate R (one direction; from --profile's entry in
tests/integration/netshape.PROFILES or --link-gbit) and the one-way delay d (the profile's where
the kernel has netem, else none is added):
  t_comm   = 2(n-1)/n * G / R + buckets * 2(n-1) * d
  t_last   = 2(n-1)/n * L / R, L the bytes of the gradient that backward produces last (the first
             layer's): no reduction of it can start before backward ends
  t_limit  = max(t_compute, t_comm - t_last) + t_last   (perfect overlap)
  t_serial = t_compute + t_comm                          (no overlap)
with n the number of hosts: whatever the algorithm, each host must send 2(n-1)/n * G through its
link (at 2 hosts, G), and MPICH's allreduce already reduces inside a host before it crosses
(a ring over all ranks, 2(ranks-1)/ranks * G, would push 1.5 G at 2 x 2). t_limit is issue 27's
max(t_compute, t_comm) + t_last where compute hides the communication; where the link is busy
for longer than the compute, the last transfer is part of t_comm, not added to it. The row also
gives t_limit with mpidp's own buckets (L = the bucket that holds the first layer): what perfect
overlap could reach with MPIDP_BUCKET_BYTES as set.

--summarize reads the --json files of several launches, prints per-launch figures and medians
by (profile, layout, model), and --plot draws step time against link rate per contender with
both limits.
"""

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import link_load  # noqa: E402
import train_step  # noqa: E402
from rounds import order as rounds_order  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOW = 1.3  # a step this many times its contender's median counts as slow in the report


def wide():
    """12.6 M parameters in two layers, trained at batch 4: 50 MB of gradients for a few
    milliseconds of compute, so the step is bound by the network at any rate here."""
    return nn.Sequential(nn.Linear(4096, 3072), nn.ReLU(), nn.Linear(3072, 10))


MODELS = dict(train_step.MODELS)
MODELS["wide12.6M"] = (wide, lambda b: torch.randn(b, 4096), 4, 10)

CONTENDERS = (
    "no communication",
    "no communication, link busy",
    "mpidp",
    "mpidp overlap",
    "mpidp no overlap",
    "mpidp fp16",
    "mpidp hierarchical",
    "per-tensor MPI after backward",
    "DDP (gloo)",
    "DDP fp16 hook",
    "DDP (mpidp)",
    "DDP (mpidp) fp16 hook",
)


def profile_link(name):
    """(rate in bit/s or None when unshaped, one-way delay in s) of a cluster profile."""
    sys.path.insert(0, ROOT)
    from tests.integration.netshape import PROFILES, has_netem

    return PROFILES[name].rate_bit_s, PROFILES[name].delay_s if has_netem() else 0.0


def own_address():
    """This host's address other hosts reach it at, and its interface: the first global IPv4
    address `ip` lists (the cluster's hosts have one, eth0 on the bridge)."""
    out = subprocess.run(
        ["ip", "-o", "-4", "addr", "show", "scope", "global"], capture_output=True, text=True
    ).stdout.split("\n")
    for line in out:
        parts = line.split()
        if len(parts) >= 4:
            return parts[3].split("/")[0], parts[1]
    return "127.0.0.1", "lo"


def setup_gloo(comm):
    """train_step.setup_gloo with the store on rank 0's host address (not loopback)."""
    addr, iface = own_address()
    addr, iface = comm.bcast((addr, iface), root=0)
    os.environ.setdefault("MASTER_ADDR", addr)
    # Every host names its own interface; the cluster's are all eth0.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", own_address()[1])
    train_step.setup_gloo(comm)
    return addr


def commit():
    """The checkout's commit (a COMMIT file in an exported tree, else git's HEAD)."""
    path = os.path.join(ROOT, "COMMIT")
    if os.path.exists(path):
        return open(path).read().strip()
    return subprocess.run(
        ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()


def host_path():
    import mpidp.runtime.world

    return mpidp.runtime.world.state().engine.backend.routes["cpu"]


class Phased(train_step.Contender):
    """A step without communication, its forward, backward and update timed apart; with
    `load` (link_load.LinkLoad), taken while every link carries plain TCP traffic at its rate."""

    def __init__(self, name, model, optimizer, load=None):
        super().__init__(name, model, optimizer)
        self.load = load
        self.phases = []
        # Without load: when each gradient is ready, in seconds after backward() began (the
        # floor's `ready`), a list per step in the order of model.parameters().
        self.ready = []
        self._began = 0.0
        self._now: dict = {}
        if load is None:
            for i, p in enumerate(model.parameters()):
                p.register_post_accumulate_grad_hook(self._ready_hook(i))

    def _ready_hook(self, i):
        def hook(_p):
            self._now[i] = time.perf_counter() - self._began

        return hook

    def begin(self):
        if self.load is not None:
            self.load.on()

    def end(self):
        if self.load is not None:
            self.load.off()

    def step(self, x, y):
        start = time.perf_counter()
        self.optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        forward = self._began = time.perf_counter()
        self._now = {}
        loss.backward()
        backward = time.perf_counter()
        self.optimizer.step()
        end = time.perf_counter()
        self.phases.append((forward - start, backward - forward, end - backward))
        if self._now and len(self._now) == max(self._now) + 1:  # every gradient came
            self.ready.append([self._now[i] for i in range(len(self._now))])
        return end - start


class Hierarchical(train_step.Contender):
    """The default optimizer, its steps taken with the engine's host path hierarchical."""

    def step(self, x, y):
        path = host_path()
        path.hierarchical = True
        try:
            return super().step(x, y)
        finally:
            path.hierarchical = False


def contenders(build, comm, hierarchical, load):
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import mpidp

    torch.manual_seed(0)
    base = build()
    size = comm.size

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

    def dist_opt(m, **kw):
        return mpidp.DistributedOptimizer(sgd(m), named_parameters=m.named_parameters(), **kw)

    out = []
    m = copy.deepcopy(base)
    out.append(Phased("no communication", m, sgd(m)))
    if load is not None:
        m = copy.deepcopy(base)
        out.append(Phased("no communication, link busy", m, sgd(m), load))
    m = copy.deepcopy(base)
    default = dist_opt(m)
    out.append(train_step.Contender("mpidp", m, default))
    for name, flag in (("mpidp overlap", True), ("mpidp no overlap", False)):
        m = copy.deepcopy(base)
        opt = dist_opt(m)
        opt._overlap = flag  # what MPIDP_OVERLAP=1 / 0 decide (mpidp/training/overlap.py)
        out.append(train_step.Contender(name, m, opt))
    m = copy.deepcopy(base)
    out.append(
        train_step.Contender("mpidp fp16", m, dist_opt(m, compression=mpidp.Compression.fp16))
    )
    if hierarchical:
        m = copy.deepcopy(base)
        out.append(Hierarchical("mpidp hierarchical", m, dist_opt(m)))
    m = copy.deepcopy(base)
    raw = comm.Dup()

    def per_tensor(m=m):
        for p in m.parameters():
            raw.Allreduce(MPI.IN_PLACE, p.grad.numpy())
            p.grad.div_(size)

    out.append(train_step.Contender("per-tensor MPI after backward", m, sgd(m), per_tensor))
    m = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    out.append(train_step.Contender("DDP (gloo)", m, sgd(m)))
    m = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    m.register_comm_hook(None, default_hooks.fp16_compress_hook)
    out.append(train_step.Contender("DDP fp16 hook", m, sgd(m)))
    for name, hook in (("DDP (mpidp)", None), ("DDP (mpidp) fp16 hook", "fp16")):
        # A group each: a group's `auto` times the steps of the one model whose calls it gets.
        group = dist.new_group(backend="mpidp")
        m = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), process_group=group)
        if hook:
            m.register_comm_hook(group, default_hooks.fp16_compress_hook)
        c = train_step.Contender(name, m, sgd(m))
        c.settled = group.overlap_settled
        out.append(c)
    sizes = [sum(p.numel() * p.element_size() for p in b.params) for b in default._buckets]
    # The bucket holding the first layers' gradients, the last ones that backward produces.
    first = next(p for g in default.param_groups for p in g["params"])
    last = next(s for s, b in zip(sizes, default._buckets) if any(p is first for p in b.params))
    return out, sizes, last


def bench_model(name, comm, rounds, steps, hierarchical, load=None):
    build, make_input, batch, classes = MODELS[name]
    runners, buckets, last = contenders(build, comm, hierarchical, load)
    g = torch.Generator().manual_seed(comm.rank)
    x, y = make_input(batch), torch.randint(0, classes, (batch,), generator=g)
    for c in runners:  # warm-up: allocator, caches, mpidp's response cache, DDP's buckets
        # ... and `auto` overlap's trial of both modes (mpidp/training/overlap.py), which the
        # same number of steps settles on every rank.
        settled = getattr(c, "settled", None) or getattr(
            c.optimizer, "overlap_settled", lambda: True
        )
        done = 0
        getattr(c, "begin", lambda: None)()
        while done < 2 or not settled():
            comm.Barrier()
            c.step(x, y)
            done += 1
        getattr(c, "end", lambda: None)()
        if isinstance(c, Phased):
            c.phases.clear()
            c.ready.clear()
    for r in range(rounds):
        # A new order each round, the same on every rank: a contender's time depends on the one
        # before it (the one after "no communication" ran ~5 % slower, whichever it was), and a
        # rotation keeps every contender behind the same neighbour.
        order = rounds_order(runners, r)
        for c in order:
            getattr(c, "begin", lambda: None)()
            for _ in range(steps):
                comm.Barrier()
                c.times.append(c.step(x, y))
            getattr(c, "end", lambda: None)()
    med = {c.name: statistics.median(c.times) for c in runners}
    # The slowest rank sets the pace: each contender's largest median over the ranks.
    med = {k: max(v) for k, v in zip(med, zip(*comm.allgather(list(med.values()))))}
    # Every step of every rank, in the order taken: slow steps show here, not in a median.
    samples = comm.gather({c.name: c.times for c in runners})
    params = list(build().parameters())
    # Forward, backward and update of the steps without communication: each phase's median,
    # the slowest rank's.
    phases = {}
    ready = []
    for c in runners:
        if isinstance(c, Phased):
            mine = [statistics.median(p[k] for p in c.phases) for k in range(3)]
            phases[c.name] = [max(v) for v in zip(*comm.allgather(mine))]
        if isinstance(c, Phased) and c.ready:
            # When each gradient is ready (median over the steps; the slowest rank's), with
            # its bytes as float32.
            at = [statistics.median(r[i] for r in c.ready) for i in range(len(params))]
            at = [max(v) for v in zip(*comm.allgather(at))]
            ready = [[t, p.numel() * 4] for t, p in zip(at, params)]
    return {
        "step_s": med,
        "phases_s": phases,
        "ready_s_bytes": ready,
        # The mode each mpidp contender ran in after its warm-up (True: overlapped), per rank.
        "overlap": {
            c.name: comm.allgather(c.optimizer._overlap)
            for c in runners
            if hasattr(c.optimizer, "overlap_settled")
        },
        "samples_s": {c.name: [r[c.name] for r in samples] for c in runners} if samples else {},
        "grad_bytes": sum(p.numel() * 4 for p in params),
        "bucket_bytes": buckets,
        "last_bucket_bytes": last,
        "last_tensor_bytes": params[0].numel() * 4,
    }


def transfer(nbytes, n, rate_bit, half=False):
    """Seconds each host's link needs for an allreduce of `nbytes` (fp32) over n hosts:
    2(n-1)/n of them, half as many as fp16."""
    return 2.0 * (n - 1) / n * (0.5 if half else 1.0) * nbytes * 8.0 / rate_bit


def limits(row, n, rate_bit, delay_s, half=False, last_key="last_tensor_bytes"):
    """t_comm, t_limit and t_serial (s) of one model's row over n hosts; fp16 halves the bytes;
    last_key "last_bucket_bytes" takes mpidp's bucket instead of the last gradient alone."""
    t_c = row["step_s"]["no communication"]
    t_comm = (
        transfer(row["grad_bytes"], n, rate_bit, half)
        + len(row["bucket_bytes"]) * 2 * (n - 1) * delay_s
    )
    t_last = transfer(row[last_key], n, rate_bit, half)
    return t_comm, max(t_c, t_comm - t_last) + t_last, t_c + t_comm


def floors(row, n, rate_bit, delay_s):
    """(fp32, fp16) floors of the step (link_load.floor) from the phases of the steps without
    communication, alone and under link load; None where the row has no loaded steps."""
    phases = row.get("phases_s", {})
    if "no communication, link busy" not in phases:
        return None
    fwd, bwd, upd = phases["no communication"]
    bwd_loaded = phases["no communication, link busy"][1]
    out = []
    for half in (False, True):
        t_comm = limits(row, n, rate_bit, delay_s, half)[0]
        t_last = transfer(row["last_tensor_bytes"], n, rate_bit, half)
        ready = [(at, transfer(b, n, rate_bit, half)) for at, b in row.get("ready_s_bytes", ())]
        out.append(link_load.floor(fwd, bwd, bwd_loaded, upd, t_comm, t_last, ready))
    return tuple(out)


def slow_steps(row, name):
    """'k of N slow': steps (slowest rank) above SLOW x the contender's median, from the samples."""
    per_rank = row.get("samples_s", {}).get(name)
    if not per_rank:
        return ""
    steps = [max(t) for t in zip(*per_rank)]
    bar = SLOW * statistics.median(steps)
    return f"{sum(t > bar for t in steps)} of {len(steps)} slow"


def _modes(flags):
    """'on', 'off', or 'mixed' where the ranks chose differently (a tie in their timings)."""
    return "on" if all(flags) else "off" if not any(flags) else "mixed"


def report(result, file=sys.stdout):
    n, rate, delay = result["hosts"], result["link_bit_s"], result["delay_s"]
    p = lambda *a: print(*a, file=file)  # noqa: E731
    p(
        f"train step, {result['profile']}, {result['ranks']} ranks on {result['hosts']} hosts, "
        f"link {rate / 1e9 if rate else float('nan'):.3g} Gbit/s, delay {delay * 1e6:.0f} us; "
        f"medians of {result['rounds']}x{result['steps']} steps (ms), slowest rank"
    )
    for name, row in result["models"].items():
        med = row["step_s"]
        p(
            f"\n{name}: {row['grad_bytes'] / 1e6:.1f} MB of gradients, mpidp buckets "
            f"{[round(b / 1e6, 1) for b in row['bucket_bytes']]} MB (last "
            f"{row['last_bucket_bytes'] / 1e6:.1f}), last gradient "
            f"{row['last_tensor_bytes'] / 1e6:.2f} MB"
        )
        for k, v in med.items():
            p(f"  {k:32s} {v * 1e3:9.1f}   {slow_steps(row, k)}")
        ours = med["mpidp"]
        if "overlap" in row:
            p(f"  mpidp (auto) overlapped          {_modes(row['overlap']['mpidp'])}")
        if rate:
            t_comm, t_limit, t_serial = limits(row, n, rate, delay)
            h_comm, h_limit, h_serial = limits(row, n, rate, delay, half=True)
            b_limit = limits(row, n, rate, delay, last_key="last_bucket_bytes")[1]
            p(
                f"  t_comm {t_comm * 1e3:.1f}  t_limit {t_limit * 1e3:.1f}  t_compute + t_comm "
                f"{t_serial * 1e3:.1f}  t_limit with mpidp's buckets {b_limit * 1e3:.1f}   (fp16: "
                f"t_comm {h_comm * 1e3:.1f}, t_limit {h_limit * 1e3:.1f})"
            )
            p(f"  mpidp / t_limit                  {ours / t_limit:9.3f}   (goal <= 1.10)")
            p(f"  mpidp fp16 / fp16 t_limit        {med['mpidp fp16'] / h_limit:9.3f}")
            floor = floors(row, n, rate, delay)
            if floor:
                fwd, bwd, upd = row["phases_s"]["no communication"]
                loaded = row["phases_s"]["no communication, link busy"][1]
                p(
                    f"  backward alone / link busy       {bwd * 1e3:.1f} / {loaded * 1e3:.1f} "
                    f"(forward {fwd * 1e3:.1f}, update {upd * 1e3:.1f})"
                )
                p(
                    f"  floor fp32 / fp16                {floor[0] * 1e3:.1f} / "
                    f"{floor[1] * 1e3:.1f}"
                    f"   fp16 / fp32 at the floor {floor[1] / floor[0]:.3f}"
                )
                p(
                    f"  mpidp / floor, fp16 / floor      {ours / floor[0]:9.3f} / "
                    f"{med['mpidp fp16'] / floor[1]:.3f}"
                )
        p(
            f"  mpidp fp16 / mpidp               {med['mpidp fp16'] / ours:9.3f}   (goal <= 0.60 "
            f"where network-bound)"
        )
        p(f"  DDP (gloo) / mpidp               {med['DDP (gloo)'] / ours:9.3f}   (goal > 1)")
        p(
            f"  DDP fp16 hook / mpidp fp16       {med['DDP fp16 hook'] / med['mpidp fp16']:9.3f}"
            f"   (goal > 1)"
        )
        if "DDP (mpidp)" in med:
            p(f"  DDP (mpidp) / DDP (gloo)         {med['DDP (mpidp)'] / med['DDP (gloo)']:9.3f}")
            p(
                f"  DDP (mpidp) fp16 / DDP fp16      "
                f"{med['DDP (mpidp) fp16 hook'] / med['DDP fp16 hook']:9.3f}"
            )
        best = min(med["mpidp overlap"], med["mpidp no overlap"])
        p(
            f"  mpidp (auto) / better forced     {ours / best:9.3f}   (goal <= 1.03; overlap "
            f"{med['mpidp overlap'] * 1e3:.1f}, no overlap {med['mpidp no overlap'] * 1e3:.1f})"
        )
        if "mpidp hierarchical" in med:
            p(f"  mpidp hierarchical / mpidp       {med['mpidp hierarchical'] / ours:9.3f}")
        p(f"  per-tensor MPI / mpidp           {med['per-tensor MPI after backward'] / ours:9.3f}")


def run(args):
    import torch.distributed as dist
    from mpi4py import MPI

    import mpidp

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    mpidp.init()
    hosts = len(set(comm.allgather(socket.gethostname())))
    hierarchical = mpidp.local_size() > 1 and hosts > 1
    master = setup_gloo(comm)
    rate, delay = profile_link(args.profile) if args.profile else (None, 0.0)
    if args.link_gbit:
        rate = args.link_gbit * 1e9
    if args.delay_us is not None:
        delay = args.delay_us * 1e-6
    result = {
        "profile": args.profile or "?",
        "ranks": comm.size,
        "hosts": hosts,
        "link_bit_s": rate,
        "delay_s": delay,
        "rounds": args.rounds,
        "steps": args.steps,
        "overlap_knob": os.environ.get("MPIDP_OVERLAP", "auto"),
        "master_addr": master,
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "models": {},
    }
    load = None
    if hosts > 1:
        names = comm.allgather(socket.gethostname())
        load = link_load.LinkLoad(comm, own_address()[0], names)
    for name in args.models.split(","):
        result["models"][name] = bench_model(
            name, comm, args.rounds, args.steps, hierarchical, load
        )
    if load is not None:
        load.close()
    if comm.rank == 0:
        report(result)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1)
    dist.destroy_process_group()
    mpidp.shutdown()


def per_launch(values, fmt=".1f"):
    return " / ".join(format(v, fmt) for v in values)


def summarize(paths, plot):
    runs = [json.load(open(p)) for p in paths]
    groups = {}
    for r in runs:
        groups.setdefault((r["profile"], r["hosts"], r["ranks"]), []).append(r)
    table = {}
    for (profile, hosts, ranks), rs in groups.items():
        first = rs[0]
        n, rate, delay = hosts, first["link_bit_s"], first["delay_s"]
        print(
            f"\n== {profile}, {hosts} hosts x {ranks // hosts} ranks, {len(rs)} launch(es) "
            f"({', '.join(r['commit'] + ' ' + r['date'][11:16] for r in rs)})"
        )
        for model in first["models"]:
            rows = [r["models"][model] for r in rs]
            names = list(rows[0]["step_s"])
            med = {k: statistics.median(row["step_s"][k] for row in rows) for k in names}
            ratios = {}
            for row in rows:
                s = row["step_s"]
                got = {
                    "fp16/fp32": s["mpidp fp16"] / s["mpidp"],
                    "DDP/mpidp": s["DDP (gloo)"] / s["mpidp"],
                    "DDPfp16/fp16": s["DDP fp16 hook"] / s["mpidp fp16"],
                    "auto/better": s["mpidp"] / min(s["mpidp overlap"], s["mpidp no overlap"]),
                }
                if rate:
                    got["mpidp/t_limit"] = s["mpidp"] / limits(row, n, rate, delay)[1]
                    floor = floors(row, n, rate, delay)
                    if floor:
                        got["floor fp16/fp32"] = floor[1] / floor[0]
                        got["mpidp/floor"] = s["mpidp"] / floor[0]
                        got["fp16/fp16 floor"] = s["mpidp fp16"] / floor[1]
                if "mpidp hierarchical" in s:
                    got["hier/mpidp"] = s["mpidp hierarchical"] / s["mpidp"]
                if "DDP (mpidp)" in s:
                    got["DDPmpidp/DDPgloo"] = s["DDP (mpidp)"] / s["DDP (gloo)"]
                    got["DDPmpidp/mpidp"] = s["DDP (mpidp)"] / s["mpidp"]
                    got["DDPmpidpfp16/DDPfp16"] = s["DDP (mpidp) fp16 hook"] / s["DDP fp16 hook"]
                for k, v in got.items():
                    ratios.setdefault(k, []).append(v)
            print(f"  {model} (ms, median of launches; per launch)")
            for k in names:
                print(
                    f"    {k:32s} {med[k] * 1e3:8.1f}   "
                    f"({per_launch(row['step_s'][k] * 1e3 for row in rows)})   "
                    f"{'; '.join(filter(None, (slow_steps(row, k) for row in rows)))}"
                )
            chosen = [_modes(row["overlap"]["mpidp"]) for row in rows if "overlap" in row]
            if chosen:
                print(f"    {'mpidp (auto) overlapped':32s} {' / '.join(chosen)}")
            if rate:
                row0 = dict(rows[0], step_s=med)
                t_comm, t_limit, t_serial = limits(row0, n, rate, delay)
                b_limit = limits(row0, n, rate, delay, last_key="last_bucket_bytes")[1]
                print(
                    f"    t_comm {t_comm * 1e3:.1f}  t_limit {t_limit * 1e3:.1f}  "
                    f"t_compute + t_comm {t_serial * 1e3:.1f}  t_limit with mpidp's buckets "
                    f"{b_limit * 1e3:.1f}"
                )
                table[(profile, ranks, model)] = (rate, med, t_limit, t_serial)
            for k, vs in ratios.items():
                print(f"    {k:32s} {statistics.median(vs):8.3f}   ({per_launch(vs, '.3f')})")
    if plot:
        draw(table, plot)


def draw(table, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = sorted({ranks for _, ranks, _ in table})
    names = list(dict.fromkeys(model for _, _, model in table))
    fig, grid = plt.subplots(
        len(layouts), len(names), squeeze=False, figsize=(4.8 * len(names), 4.2 * len(layouts))
    )
    for row, ranks in enumerate(layouts):
        for ax, model in zip(grid[row], names):
            pts = sorted(
                (v for (_, r, m), v in table.items() if (r, m) == (ranks, model)),
                key=lambda v: v[0],
            )
            if not pts:
                ax.set_visible(False)
                continue
            rates = [v[0] / 1e9 for v in pts]
            for i, name in enumerate(CONTENDERS):
                if name in pts[0][1]:
                    ax.plot(
                        rates,
                        [v[1][name] * 1e3 for v in pts],
                        "-o",
                        ms=3,
                        color=f"C{i}",
                        label=name,
                    )
            ax.plot(
                rates,
                [v[2] * 1e3 for v in pts],
                "k--",
                marker="_",
                ms=14,
                lw=2,
                label="t_limit (perfect overlap)",
            )
            ax.plot(
                rates,
                [v[3] * 1e3 for v in pts],
                "k:",
                marker="x",
                ms=7,
                lw=2,
                label="t_compute + t_comm (no overlap)",
            )
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("link rate, Gbit/s")
            ax.set_title(f"{model}, 2 hosts x {ranks // 2} rank(s)", fontsize=9)
            ax.grid(alpha=0.3, which="both")
        grid[row][0].set_ylabel("step, ms (slowest rank, median of launches)")
    # The legend where the most contenders are (hierarchical runs at several ranks per host).
    grid[-1][-1].legend(fontsize=6.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--profile",
        default="",
        help="the cluster's profile (its link rate and delay come from multihost_cluster.PROFILES)",
    )
    parser.add_argument(
        "--link-gbit",
        type=float,
        default=0.0,
        help="link rate, overrides the "
        "profile's (needed for a profile with no rate limit: give the measured)",
    )
    parser.add_argument("--delay-us", type=float, default=None, help="one-way delay, overrides")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--models", default="resnet18,mlp6.3M,wide12.6M")
    parser.add_argument("--json")
    parser.add_argument(
        "--summarize",
        nargs="+",
        metavar="JSON",
        help="medians over launches' --json files (no MPI)",
    )
    parser.add_argument("--plot", help="with --summarize: PNG of step time against link rate")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize, args.plot)
    else:
        run(args)


if __name__ == "__main__":
    main()
