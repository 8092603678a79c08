"""What works on this machine's GPU, in one table: `make gpu-check` (or python tests/gpu_check.py).

    python3 tests/gpu_check.py [--device cuda|cpu] [--quick] [--out report.md] [--bring-mpich]

1. Reports what is found: torch and its CUDA, the GPUs, NCCL, mpi4py and the MPI library,
   whether that MPI is CUDA-aware, mpiexec and pytest-mpi.
2. Runs the device-parametrized MPI tests (tests/mpi/devices.py) on `--device` tensors for each
   data path (MPIDP_BACKEND=mpi, gloo, nccl) at n=1 and n=2.
3. Runs examples/train.py on that device at n=2 for a few epochs.
4. Runs benchmarks/cuda_paths.py once per path (mpidp vs DDP vs no communication).
Then prints one table (and writes it to --out); exits 1 if anything failed.

With --device cuda (the default) on a machine where torch sees no GPU it says so and exits 0
after running nothing. --device cpu runs the same on host tensors: the CPU twin CI runs.
It uses the interpreter it runs under (no venv needed: a GPU machine's image brings torch), with
the checkout on PYTHONPATH. A missing pytest-mpi is installed from a wheel found in
$MPIDP_WHEELS or ./.whl (`make gpu-wheels` fills it; nothing is downloaded here). So is the
mpich wheel (into a temporary prefix, its bin/ and lib/ first on PATH and LD_LIBRARY_PATH) when
no mpiexec or no MPI library mpi4py can load is found, or with --bring-mpich.
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATRIX = [
    "test_allreduce.py",
    "test_other_collectives.py",
    "test_optimizer.py",
    "test_sync_batch_norm.py",
    "test_join_barrier.py",
    "test_process_sets.py",
    "test_checkpoint.py",
    "test_cuda_streams.py",
    "test_torch_distributed.py",
    "test_sharded.py",
]
QUICK_MATRIX = ["test_allreduce.py"]
FACTS = r"""
import json, torch, torch.distributed as dist
f = {"torch": torch.__version__, "torch CUDA": torch.version.cuda,
     "GPUs": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
             if torch.cuda.is_available() else [],
     "NCCL": (".".join(map(str, torch.cuda.nccl.version()))
              if dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()
              else ("built, no GPU" if dist.is_available() and dist.is_nccl_available()
                    else "not built")),
     "gloo": bool(dist.is_available() and dist.is_gloo_available())}
try:
    import mpi4py
    from mpi4py import MPI
    from mpidp.engine import mpi_library
    f["mpi4py"] = mpi4py.__version__
    f["MPI library"] = MPI.Get_library_version().splitlines()[0].strip()
    f["CUDA-aware MPI"] = mpi_library.cuda_aware_support()
    with open("/proc/self/maps") as maps:  # which libmpi the loader found (Linux)
        f["MPI library file"] = ", ".join(sorted({line.split()[-1] for line in maps
                                                  if "/libmpi" in line})) or "?"
except Exception as exc:
    f["mpi4py"] = f"unusable: {exc}"
try:
    import pytest_mpi  # noqa: F401
    f["pytest-mpi"] = "present"
except ImportError:
    f["pytest-mpi"] = "missing"
print(json.dumps(f))
"""


# GPU machines run commands as root, where Open MPI's mpiexec refuses to start without these
# (the image lent on 2026-11-27 had Debian's Open MPI 4.1.6 under its mpi4py); MPICH ignores them.
AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def env_with(site="", **variables):
    """This process's environment with the checkout (and `site`) first on PYTHONPATH (and, as
    root, Open MPI's consent to run as root unless the environment says otherwise)."""
    path = os.pathsep.join(p for p in (ROOT, site, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(AS_ROOT) if hasattr(os, "geteuid") and os.geteuid() == 0 else {}
    env.update(os.environ)
    env.update(PYTHONPATH=path, **{k: str(v) for k, v in variables.items()})
    return env


def run(cmd, env, timeout):
    """(rc, output, seconds) of a command run from the checkout's root."""
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
        rc, out = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        rc, out = (
            124,
            (exc.stdout or b"").decode(errors="replace")
            if isinstance(exc.stdout, bytes)
            else (exc.stdout or ""),
        )
    return rc, out, time.monotonic() - start


def facts():
    rc, out, _ = run([sys.executable, "-c", FACTS], env_with(), 120)
    if rc != 0:
        return {"error": out.strip().splitlines()[-1] if out.strip() else f"exit {rc}"}
    # The last line is the JSON (MPI libraries may print banners before it).
    found = json.loads(out.strip().splitlines()[-1])
    found["mpiexec"] = mpiexec() or "not found"
    return found


def mpiexec():
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.path.exists(beside) else shutil.which("mpiexec")


def wheel(pattern):
    """The first wheel named like `pattern` in $MPIDP_WHEELS or ./.whl (make gpu-wheels)."""
    dirs = [d for d in (os.environ.get("MPIDP_WHEELS"), os.path.join(ROOT, ".whl")) if d]
    found = sorted(w for d in dirs for w in glob.glob(os.path.join(d, pattern)))
    return found[0] if found else None


def install(whl, *where):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--ignore-installed",
            *where,
            whl,
        ],
        check=True,
    )


def bring_pytest_mpi(tmp):
    """A PYTHONPATH entry holding pytest-mpi from a local wheel, or None if none is found."""
    whl = wheel("pytest_mpi-*.whl")
    if whl is None:
        return None
    target = os.path.join(tmp, "site")
    install(whl, "--target", target)
    return target


def bring_mpich(tmp):
    """Install the mpich wheel into a prefix under `tmp` (--prefix: --target would drop its
    lib/), put its bin/ and lib/ first on PATH and LD_LIBRARY_PATH and name its libmpi in
    MPI4PY_LIBMPI, for every command run from here on. Returns its mpiexec, or None when no
    wheel is found."""
    whl = wheel("mpich-*.whl")
    if whl is None:
        return None
    prefix = os.path.join(tmp, "mpich")
    install(whl, "--prefix", prefix)
    for var, sub in (("PATH", "bin"), ("LD_LIBRARY_PATH", "lib")):
        os.environ[var] = os.pathsep.join(
            p for p in (os.path.join(prefix, sub), os.environ.get(var, "")) if p
        )
    # mpi4py's own wheels look in their interpreter's prefix first; this names the library.
    os.environ["MPI4PY_LIBMPI"] = os.path.join(prefix, "lib", "libmpi.so.12")
    return os.path.join(prefix, "bin", "mpiexec")


def closing_counts(out):
    """passed/failed/skipped/errors summed over the ranks' pytest closing lines."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    for line in out.splitlines():
        if re.search(r" in [0-9.]+s", line) and re.search(
            r"\d+ (passed|failed|skipped|error)", line
        ):
            for num, what in re.findall(r"(\d+) (passed|failed|skipped|errors?)", line):
                counts["errors" if what.startswith("error") else what] += int(num)
    return counts


def matrix(device, paths, files, site, launcher):
    rows = []
    for path, n in paths:
        cmd = [
            launcher,
            "-n",
            str(n),
            sys.executable,
            "-m",
            "pytest",
            "--with-mpi",
            "-q",
            "-p",
            "no:cacheprovider",
            "--timeout=300",
            "--timeout-method=thread",
            "-k",
            device,
        ] + [os.path.join("tests", "mpi", f) for f in files]
        rc, out, secs = run(cmd, env_with(site, MPIDP_BACKEND=path, OMP_NUM_THREADS=1), 1800)
        c = closing_counts(out)
        ok = rc == 0 and c["failed"] == 0 and c["errors"] == 0
        rows.append(
            {
                "what": f"tests on {device}, MPIDP_BACKEND={path}",
                "n": n,
                "ok": ok,
                "detail": f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} "
                f"skipped (summed over ranks), exit {rc}",
                "s": secs,
                "tail": "" if ok else out[-3000:],
            }
        )
    return rows


def example(device, launcher, tmp, epochs):
    cmd = [
        launcher,
        "-n",
        "2",
        sys.executable,
        "examples/train.py",
        "--device",
        device,
        "--epochs",
        str(epochs),
        "--checkpoint",
        os.path.join(tmp, "train.pt"),
    ]
    data = wheel("digits.npz")  # GPU images have no scikit-learn (make gpu-wheels)
    if data is not None:
        cmd += ["--data", data]
    rc, out, secs = run(cmd, env_with(MPIDP_BACKEND="mpi"), 900)
    acc = re.findall(r"final test accuracy: ([0-9.]+)", out)
    ok = rc == 0 and bool(acc) and float(acc[-1]) > 0.5
    return {
        "what": f"examples/train.py --device {device}, {epochs} epochs",
        "n": 2,
        "ok": ok,
        "detail": f"final test accuracy {acc[-1] if acc else '?'}, exit {rc}"
        f"{f', digits from {data}' if data else ''}",
        "s": secs,
        "tail": "" if ok else out[-3000:],
    }


def benchmark(device, paths, launcher, tmp, rounds, steps):
    rows = []
    for path, n in paths:
        out_json = os.path.join(tmp, f"bench_{path}_{n}.json")
        cmd = [
            launcher,
            "-n",
            str(n),
            sys.executable,
            "benchmarks/cuda_paths.py",
            "--device",
            device,
            "--rounds",
            str(rounds),
            "--steps",
            str(steps),
            "--json",
            out_json,
        ]
        rc, out, secs = run(cmd, env_with(MPIDP_BACKEND=path), 900)
        if rc != 0 or not os.path.exists(out_json):
            rows.append(
                {
                    "what": f"cuda_paths.py MPIDP_BACKEND={path}",
                    "n": n,
                    "ok": False,
                    "detail": f"exit {rc}",
                    "s": secs,
                    "tail": out[-3000:],
                }
            )
            continue
        with open(out_json) as fh:
            r = json.load(fh)
        ms = r["ms"]
        mine = next(v for k, v in ms.items() if k.startswith("mpidp"))
        ddp = next(v for k, v in ms.items() if k.startswith("DDP"))
        rows.append(
            {
                "what": f"step, mpidp over {r['path']} vs DDP ({r['ddp']})",
                "n": n,
                "ok": True,
                "s": secs,
                "tail": "",
                "detail": f"no comm {ms['no communication']:.2f} ms, mpidp {mine:.2f} ms, "
                f"DDP {ddp:.2f} ms (mpidp/DDP {mine / ddp:.3f}); gradient set "
                f"allreduce {ms['allreduce of the gradient set']:.2f} ms (staged floor "
                f"{ms['staged floor of that allreduce']:.2f} ms)",
            }
        )
    return rows


def table(found, rows):
    lines = ["| what | n | result | detail | s |", "|---|---|---|---|---|"]
    for key, value in found.items():
        lines.append(f"| found: {key} | | | {value} | |")
    for r in rows:
        lines.append(
            f"| {r['what']} | {r['n']} | {'ok' if r['ok'] else 'FAILED'} | "
            f"{r['detail']} | {r['s']:.0f} |"
        )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="one test file, short runs")
    ap.add_argument("--out", help="also write the table here")
    ap.add_argument(
        "--bring-mpich",
        action="store_true",
        help="use the mpich wheel from $MPIDP_WHEELS or ./.whl (make gpu-wheels), "
        "installed into a temporary prefix, instead of an MPI found here; done "
        "anyway when no mpiexec or no MPI library mpi4py can load is found",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mpidp-gpu-check-") as tmp:
        return check(args, tmp)


def stop(found, message, rc):
    """Print what was found, then why nothing (more) runs; returns the exit code."""
    for key, value in found.items():
        print(f"  {key}: {value}")
    print(message)
    return rc


def check(args, tmp):
    found = facts()
    print(f"gpu-check with {sys.executable}")
    if "error" in found:
        print(f"torch or mpidp cannot be imported by {sys.executable}: {found['error']}")
        return 1
    gpus = len(found["GPUs"])
    if args.device == "cuda" and not gpus:
        return stop(
            found,
            "no GPU here (torch.cuda.is_available() is false): nothing to run; "
            "`--device cpu` runs the same checks on host tensors",
            0,
        )
    launcher = mpiexec()
    if args.bring_mpich or launcher is None or found["mpi4py"].startswith("unusable"):
        launcher = bring_mpich(tmp)
        if launcher is None:
            return stop(
                found,
                "no usable MPI here (mpiexec, or mpi4py's MPI library) and no "
                "mpich wheel in $MPIDP_WHEELS or ./.whl: bring one (make "
                "gpu-wheels) and run again",
                1,
            )
        found = facts()
        found["mpiexec"] = f"{launcher} (the mpich wheel, brought)"
    if "error" in found or found["mpi4py"].startswith("unusable"):
        return stop(
            found, f"mpi4py cannot use the MPI library: {found.get('error', found['mpi4py'])}", 1
        )
    for key, value in found.items():
        print(f"  {key}: {value}")
    site = ""
    if found["pytest-mpi"] == "missing":
        site = bring_pytest_mpi(tmp)
        if site is None:
            print(
                "pytest-mpi is missing and no wheel of it was found in $MPIDP_WHEELS or "
                "./.whl: bring one (make gpu-wheels) and run again"
            )
            return 1
    paths = [("mpi", 1), ("mpi", 2), ("gloo", 2)]
    if args.device == "cuda" and found["NCCL"][:1].isdigit():
        paths += [("nccl", 1), ("nccl", 2)]
    files = QUICK_MATRIX if args.quick else MATRIX
    rows = matrix(args.device, paths, files, site, launcher)
    rows.append(example(args.device, launcher, tmp, 3 if args.quick else 5))
    bench_paths = [(p, n) for p, n in paths if n == 2]
    if args.device == "cuda" and gpus < 2 and ("nccl", 2) in bench_paths:
        bench_paths[bench_paths.index(("nccl", 2))] = ("nccl", 1)  # one GPU: one rank
    rows += benchmark(
        args.device, bench_paths, launcher, tmp, 1 if args.quick else 5, 2 if args.quick else 5
    )
    report = table(found, rows)
    print(report)
    for r in rows:
        if r["tail"]:
            print(f"\n---- {r['what']} (n={r['n']}): end of its output ----\n{r['tail']}")
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(report + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
