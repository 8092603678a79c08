"""Chaos trials: a training job with one fault on a random rank at a random step must end in time,
leave no process, name the rank and host, and resume to the uninterrupted run's parameters.

    python -m tests.integration.chaos --trials 100 [--np 3 4] [--seed 1]   (`make chaos`)

Each trial runs tests/integration/scripts/chaos_train.py (a checkpoint after every step) with one
fault, then runs it again to resume from the last checkpoint and compares the final parameters
with an uninterrupted run's, bitwise. The faults: kill (SIGKILL), term (SIGTERM), raise (an
exception in the training loop), datapath (an exception inside the engine's data path), stall (a
rank that stops calling, past MPIDP_STALL_SHUTDOWN_S), disk (the checkpoint's file system fills
up: a 1 MiB tmpfs), corrupt (the checkpoint file damaged before a resume: the resume must fail
naming the file; the run after it starts over). Prints one row per fault.

    python -m tests.integration.chaos --hosts 2 --trials 100    (`make chaos-hosts`)

runs the same trials across the hosts of a test cluster (tests/integration/multihost_cluster.py,
hydra's ssh launcher, ranks placed host by host): the failing rank's line must name its host.
"""

import argparse
import os
import random
import re
import socket
import subprocess
import tempfile
import time
from collections import defaultdict

from .launch import SCRIPTS, run

SCRIPT = SCRIPTS / "chaos_train.py"
FAULTS = ("kill", "term", "raise", "datapath", "stall", "disk", "corrupt")
STEPS = 8
BOUND_S = 10.0  # from the fault to the job's end
STALL_S = 3.0  # MPIDP_STALL_SHUTDOWN_S for the trials: a stall ends the job past this
ENV = {
    "MPIDP_STALL_WARNING_S": "1.5",
    "MPIDP_STALL_SHUTDOWN_S": str(STALL_S),
    "OMP_NUM_THREADS": "1",
}
TIMEOUT_S = 120


def _orphans(tag: str, grace_s: float = 3.0) -> list:
    """The job's processes still there `grace_s` after mpiexec returned: hydra sends the kill
    and exits, and a rank of 600 MB may take a moment to be torn down (seen once in 4 stalls)."""
    deadline = time.monotonic() + grace_s
    while True:
        out = subprocess.run(["pgrep", "-af", tag], capture_output=True, text=True)
        left = [line for line in out.stdout.splitlines() if "pgrep" not in line]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


class Place:
    """Where a trial's jobs run: this host, or the hosts of a started MultiHostCluster (ranks
    placed host by host, the first hosts taking one more where n does not divide)."""

    def __init__(self, cluster=None):
        self.cluster = cluster

    def _per_host(self, n):
        hosts = [h.name for h in self.cluster.hosts]
        return [(h, n // len(hosts) + (i < n % len(hosts))) for i, h in enumerate(hosts)]

    def host(self, n: int, rank: int) -> str:
        """The host name rank `rank` of an n-rank job runs on."""
        if self.cluster is None:
            return socket.gethostname()
        first = 0
        for name, count in self._per_host(n):
            if rank < first + count:
                return name
            first += count
        raise ValueError(f"rank {rank} is not in a job of {n}")

    def tempdir(self):
        """A temporary directory every rank sees, mounts made in it included."""
        shared = None if self.cluster is None else self.cluster.shared_dir
        return tempfile.TemporaryDirectory(dir=shared)

    def job(self, n, checkpoint, tag, *args):
        """chaos_train.py on n ranks; (its Result, the time it ended)."""
        env, mpi_args = ENV, ()
        if self.cluster is not None:
            env = self.cluster.env(**ENV)
            mpi_args = ("-hosts", ",".join(f"{h}:{c}" for h, c in self._per_host(n) if c))
        res = run(
            n,
            SCRIPT,
            "--checkpoint",
            checkpoint,
            "--steps",
            STEPS,
            "--tag",
            tag,
            *args,
            env=env,
            timeout=TIMEOUT_S,
            mpi_args=mpi_args,
        )
        return res, time.time()


THIS_HOST = Place()


def _final(res) -> str:
    found = re.findall(r"^final (\[.*\])$", res.stdout, re.M)
    return found[-1] if found else ""


def _names(output: str, rank: int, host: str) -> bool:
    """One line names the failing rank and its host."""
    pattern = re.compile(rf"\brank\D{{0,3}}{rank}\b", re.I)
    return any(pattern.search(line) and host in line for line in output.splitlines())


def reference(n: int, place: Place = THIS_HOST) -> str:
    """The final parameters of an uninterrupted run at n ranks."""
    with place.tempdir() as d:
        res, _ = place.job(n, os.path.join(d, "ckpt.pt"), f"chaos-ref-{os.getpid()}")
        if res.returncode != 0 or not _final(res):
            raise RuntimeError(f"the uninterrupted run failed:\n{res.output}")
        return _final(res)


def _mount_tmpfs(path: str, size: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], check=True)


def trial(n: int, fault: str, rank: int, step: int, want: str, place: Place = THIS_HOST) -> dict:
    """One fault, then the resume; returns what was checked (each True when it held)."""
    tag = f"chaos-{os.getpid()}-{fault}-{rank}-{step}-{random.randrange(1 << 30)}"
    with place.tempdir() as d:
        ckdir = os.path.join(d, "ck")
        os.mkdir(ckdir)
        if fault == "disk":
            _mount_tmpfs(ckdir, "1m")
        checkpoint = os.path.join(ckdir, "ckpt.pt")
        try:
            if fault == "corrupt":
                # A clean run that stops at `step` (its fault ends it there), then a damaged file.
                place.job(
                    n,
                    checkpoint,
                    tag,
                    "--fault",
                    "kill",
                    "--fault-rank",
                    rank,
                    "--fault-step",
                    step,
                )
                with open(checkpoint, "r+b") as f:
                    f.seek(os.path.getsize(checkpoint) // 2)
                    f.write(b"\xde\xad\xbe\xef" * 64)
                res, ended = place.job(n, checkpoint, tag)
                stamps = re.findall(r"^chaos: loading .* at ([0-9.]+)$", res.stdout, re.M)
                fault_at = min(map(float, stamps)) if stamps else float("nan")
                bound = BOUND_S
                named = "ckpt.pt" in res.stderr and "CheckpointError" in res.stderr
            else:
                res, ended = place.job(
                    n, checkpoint, tag, "--fault", fault, "--fault-rank", rank, "--fault-step", step
                )
                stamp = re.search(r"^chaos: .* at ([0-9.]+)$", res.stdout, re.M)
                fault_at = float(stamp.group(1)) if stamp else float("nan")
                bound = BOUND_S + (STALL_S if fault == "stall" else 0.0)
                # The disk fills on `rank`, but the save that finds it full is rank 0's.
                failing = 0 if fault == "disk" else rank
                named = _names(res.output, failing, place.host(n, failing))
            orphans = _orphans(tag)
            if fault == "disk":
                os.unlink(os.path.join(ckdir, "filler"))
            if fault == "corrupt":
                os.unlink(checkpoint)  # nothing good to resume from: start over
            again, _ = place.job(n, checkpoint, tag)
        finally:
            if fault == "disk":
                subprocess.run(["umount", ckdir], check=False)
    return {
        "ended non-zero": res.returncode != 0,
        "in time": ended - fault_at <= bound,
        "no orphans": not orphans,
        "named": named,
        "resumed bitwise": again.returncode == 0 and _final(again) == want,
        "_output": res.output + again.output + "".join(f"\norphan: {o}" for o in orphans),
        "_seconds": ended - fault_at,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=len(FAULTS), help="in all, faults in turn")
    parser.add_argument("--np", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    parser.add_argument(
        "--hosts", type=int, default=1, help="above 1: across that many hosts of a test cluster"
    )
    args = parser.parse_args(argv)
    if args.hosts <= 1:
        return _trials(args, THIS_HOST)
    from .multihost_cluster import MultiHostCluster  # root only; one-host trials need none of it

    cluster = MultiHostCluster(n_hosts=args.hosts)
    cluster.start()
    try:
        return _trials(args, Place(cluster))
    finally:
        cluster.stop()


def _trials(args, place: Place) -> int:
    rng = random.Random(args.seed)
    refs = {n: reference(n, place) for n in args.np}
    table = defaultdict(lambda: defaultdict(int))
    for i in range(args.trials):
        fault, n = args.faults[i % len(args.faults)], rng.choice(args.np)
        rank, step = rng.randrange(n), rng.randrange(1, STEPS - 1)
        got = trial(n, fault, rank, step, refs[n], place)
        row = table[fault]
        row["trials"] += 1
        for key, ok in got.items():
            if not key.startswith("_"):
                row[key] += bool(ok)
        bad = [k for k, ok in got.items() if not k.startswith("_") and not ok]
        verdict = "ok" if not bad else "FAILED " + ", ".join(bad)
        print(
            f"trial {i + 1}: {fault} on rank {rank} of {n} ({place.host(n, rank)}) at step "
            f"{step}: ended {got['_seconds']:.1f} s after it; {verdict}",
            flush=True,
        )
        if bad:
            print(got["_output"][-3000:], flush=True)
    keys = ["trials", "ended non-zero", "in time", "no orphans", "named", "resumed bitwise"]
    print("\n| fault | " + " | ".join(keys) + " |")
    print("|" + " --- |" * (len(keys) + 1))
    failed = False
    for fault, row in table.items():
        print(f"| {fault} | " + " | ".join(str(row[k]) for k in keys) + " |")
        failed |= any(row[k] != row["trials"] for k in keys)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
