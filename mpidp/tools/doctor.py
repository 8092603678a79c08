"""`python -m mpidp doctor`: check MPI, torch and the knobs, smoke-test the collectives, report."""

import importlib.metadata
import os
import platform
import sys
import time
from typing import List, Optional

from .. import config as _config
from ..errors import ConfigError, MpidpError
from ..runtime import unknown_vars

_OK, _INFO, _WARN, _FAIL = "ok", "info", "warn", "FAIL"


class Report:
    """The checks of one rank: (status, topic, detail) lines; a FAIL line is a problem."""

    def __init__(self):
        self.lines: List[tuple] = []
        self.nccl = self.gloo = False

    def add(self, status: str, topic: str, detail: str) -> None:
        self.lines.append((status, topic, detail))

    def problems(self) -> List[str]:
        return [f"{topic}: {detail}" for status, topic, detail in self.lines if status == _FAIL]

    def text(self) -> str:
        return "\n".join(f"[{status:>4}] {topic}: {detail}" for status, topic, detail in self.lines)


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _check_torch(report: Report) -> None:
    import torch
    import torch.distributed as dist

    report.add(_OK, "torch", f"{torch.__version__} (numpy {_dist_version('numpy')})")
    cuda = torch.cuda.is_available()
    build = f"torch built for CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only torch"
    report.add(
        _INFO,
        "CUDA",
        f"available, {torch.cuda.device_count()} device(s), {build}"
        if cuda
        else f"not available ({build})",
    )
    has_dist = dist.is_available()
    nccl = has_dist and cuda and dist.is_nccl_available()
    gloo = has_dist and dist.is_gloo_available()
    report.add(
        _INFO,
        "NCCL",
        "available" if nccl else "not available (needs CUDA and a torch built with NCCL)",
    )
    report.add(_INFO, "gloo", "available" if gloo else "not available in this torch build")
    report.nccl, report.gloo = nccl, gloo


def _check_knobs(report: Report) -> Optional[_config.Config]:
    try:
        cfg = _config.load()
    except ConfigError as exc:
        report.add(_FAIL, "knobs", f"{exc}")
        return None
    for var, what in unknown_vars.unknown_variables():
        report.add(_WARN, "unknown variable", f"{var}={os.environ[var]!r} is {what}")
    set_knobs = [k for k in _config.KNOBS if k.field in cfg.explicit]
    if not set_knobs:
        report.add(_OK, "knobs", "none set; every knob has its default")
    for knob in set_knobs:
        var = next((v for v in (knob.env, knob.horovod) if v and v in os.environ), knob.env)
        report.add(
            _OK,
            "knob set",
            f"{var}={os.environ.get(var, '')!r} -> {knob.field} = "
            f"{getattr(cfg, knob.field)!r} (default {knob.default!r})",
        )
    if cfg.backend == "nccl" and not report.nccl:
        report.add(
            _FAIL,
            "knobs",
            "MPIDP_BACKEND=nccl, but NCCL is not available here; set MPIDP_BACKEND=auto or mpi",
        )
    if cfg.backend == "gloo" and not report.gloo:
        report.add(
            _FAIL,
            "knobs",
            "MPIDP_BACKEND=gloo, but this torch has no gloo; set MPIDP_BACKEND=auto or mpi",
        )
    return cfg


def _check_mpi(report: Report, cfg) -> bool:
    """MPI library, thread level and CUDA awareness; True if init() may be attempted."""
    report.add(_OK, "mpi4py", _dist_version("mpi4py"))
    try:
        from ..engine import mpi, mpi_library
    except Exception as exc:  # noqa: BLE001 - any failure to load MPI is the finding itself
        report.add(
            _FAIL,
            "MPI",
            f"cannot load the MPI library: {type(exc).__name__}: {exc}. "
            f"Install one (pip install 'mpidp[mpich]') or build mpi4py "
            f"against your cluster's MPI",
        )
        return False
    version = " ".join(mpi.library_version().splitlines()[0].split())
    report.add(_OK, "MPI library", version)
    level = mpi.thread_level_name()
    if level in ("single", "funneled"):
        report.add(
            _FAIL,
            "MPI thread level",
            f"{level!r} is too low: mpidp's engine thread needs at least 'serialized'. "
            f"Unset MPI4PY_RC_THREAD_LEVEL or set it to 'multiple'",
        )
        return False
    report.add(
        _OK,
        "MPI thread level",
        level
        + (
            ""
            if level == "multiple"
            else " (enough for mpidp; 'multiple' lets the application call MPI beside it)"
        ),
    )
    aware = mpi_library.cuda_aware_support()
    report.add(
        _INFO,
        "CUDA-aware MPI",
        {True: "yes", False: "no", None: "unknown (the library does not say)"}[aware],
    )
    if cfg is not None and cfg.cuda_aware_mpi == "1" and aware is False:
        report.add(
            _FAIL,
            "CUDA-aware MPI",
            "MPIDP_CUDA_AWARE_MPI=1 forces device buffers, but "
            "this MPI library reports no CUDA support; set it "
            "to auto or 0",
        )
    return True


def _launcher_size() -> Optional[tuple]:
    for var in _config.LAUNCHER_SIZE_VARIABLES:
        value = os.environ.get(var, "")
        if value.isdigit():
            return var, int(value)
    return None


def _smoke_test(report: Report, timeout: float) -> None:
    """Collective: an allreduce, an allgather and a broadcast with known results."""
    import torch

    import mpidp

    r, n = mpidp.rank(), mpidp.size()
    start = time.perf_counter()
    checks = (
        (
            "allreduce",
            lambda: mpidp.allreduce_async(
                torch.full((4,), float(r + 1)), op=mpidp.Sum, name="mpidp.doctor.allreduce"
            ),
            lambda out: out.tolist() == [n * (n + 1) / 2] * 4,
        ),
        # Rank k sends k + 1 rows, so the gather also checks uneven first dimensions.
        (
            "allgather",
            lambda: mpidp.allgather_async(
                torch.full((r + 1, 2), r, dtype=torch.int64), name="mpidp.doctor.allgather"
            ),
            lambda out: out[:, 0].tolist() == [k for k in range(n) for _ in range(k + 1)],
        ),
        (
            "broadcast",
            lambda: mpidp.broadcast_async(
                torch.tensor([r, 7 * r]), n - 1, name="mpidp.doctor.broadcast"
            ),
            lambda out: out.tolist() == [n - 1, 7 * (n - 1)],
        ),
    )
    failed = []
    for what, submit, good in checks:
        try:
            out = mpidp.synchronize(submit(), timeout=timeout)
            if not good(out):
                failed.append(f"{what} gave a wrong result on rank {r}: {out.tolist()}")
        except Exception as exc:  # noqa: BLE001 - reported, never raised
            failed.append(f"{what} failed on rank {r}: {type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - start
    # Every rank's verdict, so rank 0 reports a failure seen elsewhere.
    try:
        views = mpidp.synchronize(
            mpidp.allgather_async(torch.tensor([len(failed)]), name="mpidp.doctor.verdict"),
            timeout=timeout,
        ).tolist()
    except Exception as exc:  # noqa: BLE001
        views = None
        failed.append(f"verdict exchange failed on rank {r}: {type(exc).__name__}: {exc}")
    for problem in failed:
        report.add(_FAIL, "smoke test", problem)
    bad = [k for k, count in enumerate(views or []) if count and k != r]
    if bad:
        report.add(_FAIL, "smoke test", f"failed on rank(s) {bad} (see their output)")
    if not failed and not bad:
        report.add(
            _OK,
            "smoke test",
            f"allreduce, allgather and broadcast correct on {n} ranks ({seconds * 1e3:.1f} ms)",
        )


def _check_world(report: Report, cfg, mpi_ok: bool, timeout: float) -> Optional[int]:
    """init(), world facts, the smoke test, shutdown(); returns this rank (None if no init)."""
    import mpidp

    if not mpi_ok:
        return None
    try:
        mpidp.init()
    except (ConfigError, MpidpError) as exc:
        # A bad knob on this rank is a problem already; init() adds which ranks hold one.
        status = _INFO if cfg is None and isinstance(exc, ConfigError) else _FAIL
        report.add(status, "init()", f"{type(exc).__name__}: {exc}")
        return None
    try:
        r, n = mpidp.rank(), mpidp.size()
        report.add(
            _OK,
            "world",
            f"{n} rank(s), {mpidp.local_size()} on this host, {mpidp.cross_size()} host(s)",
        )
        announced = _launcher_size()
        if n == 1 and announced and announced[1] > 1:
            report.add(
                _FAIL,
                "world",
                f"size 1, but {announced[0]}={announced[1]}: each process "
                f"runs alone (under Slurm use srun --mpi=pmi2)",
            )
        elif n == 1:
            report.add(
                _INFO,
                "smoke test",
                "skipped: one rank (run under mpiexec -n 2 to test the collectives)",
            )
        if n > 1:
            _smoke_test(report, timeout)
        return r
    finally:
        mpidp.shutdown()


def run(timeout: float = 60.0, out=None) -> int:
    """Check this rank's set-up and, under a launcher, the collectives; rank 0 prints the report.

    Synchronization: init() and the smoke test are collective, so every rank of the job must run
    the doctor. Returns the exit code: 0 only when every check passed.
    """
    out = sys.stdout if out is None else out
    import mpidp

    report = Report()
    report.add(
        _OK,
        "mpidp",
        f"{mpidp.__version__} on Python {platform.python_version()} ({sys.executable})",
    )
    _check_torch(report)
    cfg = _check_knobs(report)
    mpi_ok = _check_mpi(report, cfg)
    rank = _check_world(report, cfg, mpi_ok, timeout)
    if rank is None:  # no init(): the launcher's word picks the printing rank
        rank = _config.launcher_rank() or 0
    problems = report.problems()
    if rank == 0:
        print("mpidp doctor (rank 0's view)", file=out)
        print(report.text(), file=out)
        if problems:
            print(f"{len(problems)} problem(s) found: see the FAIL lines above", file=out)
        else:
            print("all checks passed", file=out)
        out.flush()
    return 1 if problems else 0
