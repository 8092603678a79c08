"""The bad-input table in one place: each bad input is refused with an error that names what was
wrong and how to fix it, at the API boundary (before any communication) or through negotiation.

One test per row of the table. Each checks the exception type on every rank, that the message
says what was wrong and how to fix it, and that nothing was left in flight: the same name works
afterwards with good input.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mpi_util import assert_all, raises_all, rank, run_all, size

import mpidp
from mpidp.config import LAUNCHER_PREFIXES

ROOT = Path(__file__).resolve().parents[2]


def _words(exc, *words):
    """Collective: every rank's message contains every one of `words`."""
    text = str(exc)
    missing = [w for w in words if w not in text]
    assert_all(not missing, f"message {text!r} lacks {missing}")


def _sum_works(name, n_tensors=1):
    """Collective: a grouped Sum of ones under `name` now completes with the right result."""
    n = size()
    outs = run_all(
        lambda: mpidp.grouped_allreduce([torch.ones(2)] * n_tensors, op=mpidp.Sum, name=name)
    )
    assert_all(all(o.tolist() == [float(n)] * 2 for o in outs), f"{[o.tolist() for o in outs]}")


def _lone_python(code, extra_env=None):
    """Run `code` in a fresh interpreter outside the launcher (a world of its own); rank 0 only.
    Returns (exit code, output). The launcher's variables are dropped so that MPI, if the code
    initialises it, starts as a singleton instead of joining this job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra_env or {})
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=90,
        stdin=subprocess.DEVNULL,
        cwd=str(ROOT),
    )
    return proc.returncode, proc.stdout + proc.stderr


# ---- row: non-contiguous tensor ----


@pytest.mark.mpi
@pytest.mark.parametrize(
    "call", ["allreduce_", "allreduce_async_", "grouped_allreduce_", "broadcast_"]
)
def test_row_noncontiguous_tensor(call):
    name = f"test_row_noncontiguous_tensor.{call}"
    t = torch.zeros(3, 2).t()
    fn = {
        "allreduce_": lambda: mpidp.allreduce_(t, name=name),
        "allreduce_async_": lambda: mpidp.allreduce_async_(t, name=name),
        "grouped_allreduce_": lambda: mpidp.grouped_allreduce_([t], name=name),
        "broadcast_": lambda: mpidp.broadcast_(t, 0, name=name),
    }[call]
    exc = raises_all(ValueError, fn)
    # What: not contiguous (with its strides); fix: .contiguous() or the out-of-place form.
    _words(exc, "contiguous", str(t.stride()), ".contiguous()", "out-of-place")
    _sum_works(name)


# ---- row: unsupported dtype ----


@pytest.mark.mpi
@pytest.mark.parametrize(
    "dtype",
    [torch.complex64, torch.uint16, torch.float8_e4m3fn],
    ids=lambda d: str(d).replace("torch.", ""),
)
@pytest.mark.parametrize(
    "call", ["allreduce", "allgather", "broadcast", "alltoall", "reducescatter"]
)
def test_row_unsupported_dtype(call, dtype):
    name = f"test_row_unsupported_dtype.{call}.{dtype}"
    t = torch.zeros(2 * size(), 2).to(dtype)
    fn = {
        "allreduce": lambda: mpidp.allreduce(t, name=name),
        "allgather": lambda: mpidp.allgather(t, name=name),
        "broadcast": lambda: mpidp.broadcast(t, 0, name=name),
        "alltoall": lambda: mpidp.alltoall(t, name=name),
        "reducescatter": lambda: mpidp.reducescatter(t, name=name),
    }[call]
    exc = raises_all(TypeError, fn)
    _words(exc, str(dtype), "not supported", "use one of", "float32", "int64")
    _sum_works(name)


# ---- row: mixed devices in a grouped op ----
# This build moves host memory only, so a meta tensor stands in for a second device: the group
# must be refused as a whole, naming the offending tensor and its device.


@pytest.mark.mpi
@pytest.mark.parametrize(
    "call",
    ["grouped_allreduce", "grouped_allreduce_async_", "grouped_allgather", "grouped_reducescatter"],
)
def test_row_mixed_devices_in_a_grouped_op(call):
    name = f"test_row_mixed_devices.{call}"
    group = [torch.ones(2 * size()), torch.ones(2 * size(), device="meta")]
    fn = {
        "grouped_allreduce": lambda: mpidp.grouped_allreduce(group, name=name),
        "grouped_allreduce_async_": lambda: mpidp.grouped_allreduce_async_(group, name=name),
        "grouped_allgather": lambda: mpidp.grouped_allgather(group, name=name),
        "grouped_reducescatter": lambda: mpidp.grouped_reducescatter(group, name=name),
    }[call]
    exc = raises_all(ValueError, fn)
    _words(exc, f"{name}.1", "meta", "host memory", ".cpu()")
    # The CPU tensor of the refused group was not enqueued: the group's names are free.
    _sum_works(name, n_tensors=2)


# ---- row: root rank out of range ----


@pytest.mark.mpi
@pytest.mark.parametrize("offset", ["size", "negative"])
@pytest.mark.parametrize("call", ["broadcast", "broadcast_", "broadcast_async", "broadcast_async_"])
def test_row_root_rank_out_of_range(call, offset):
    name = f"test_row_root_rank.{call}.{offset}"
    n = size()
    root = n if offset == "size" else -1
    exc = raises_all(ValueError, getattr(mpidp, call), torch.ones(2), root, name=name)
    _words(exc, f"root_rank {root}", "out of range", f"0..{n - 1}")
    _sum_works(name)


# ---- row: alltoall splits of the wrong type, length or sum ----


def _splits_cases(n):
    return {
        "float list": (ValueError, [0.5] * n, ["integers", "[0.5"]),  # Horovod's type
        "float tensor": (ValueError, torch.ones(n), ["integers", "float32"]),
        "string": (TypeError, "1" * n, ["list or an integer tensor", "str"]),
        "too long": (
            ValueError,
            [1] * (n + 1),
            [f"{n + 1} entries", f"{n} ranks", "one count per rank"],
        ),
        "too short": (
            ValueError,
            [1] * (n - 1),
            [f"{n - 1} entries", f"{n} ranks", "one count per rank"],
        ),
        "sum too big": (
            ValueError,
            [2 * n + 1] + [0] * (n - 1),
            [f"sum to {2 * n + 1}", f"only {2 * n} rows"],
        ),
        "negative": (ValueError, [-1] + [1] * (n - 1), [">= 0"]),
    }


@pytest.mark.mpi
@pytest.mark.parametrize("case", list(_splits_cases(1)))
@pytest.mark.parametrize("call", ["alltoall", "alltoall_async"])
def test_row_alltoall_splits(call, case):
    name = f"test_row_alltoall_splits.{call}.{case}"
    if case == "too short" and size() == 1:
        pytest.skip("one rank: a list one too short is empty (see test_row_alltoall_empty_splits)")
    exc_type, splits, words = _splits_cases(size())[case]
    exc = raises_all(
        exc_type, getattr(mpidp, call), torch.ones(2 * size(), 3), splits=splits, name=name
    )
    _words(exc, "splits", *words)
    _sum_works(name)


@pytest.mark.mpi
def test_row_alltoall_empty_splits():
    name = "test_row_alltoall_empty_splits"
    exc = raises_all(ValueError, mpidp.alltoall, torch.ones(2 * size(), 3), splits=[], name=name)
    _words(exc, "0 entries", f"{size()} ranks", "one count per rank")


# ---- row: reducescatter of a scalar ----


@pytest.mark.mpi
@pytest.mark.parametrize("call", ["reducescatter", "reducescatter_async", "grouped_reducescatter"])
def test_row_reducescatter_of_a_scalar(call):
    name = f"test_row_reducescatter_scalar.{call}"
    arg = [torch.tensor(1.0)] if call.startswith("grouped") else torch.tensor(1.0)
    exc = raises_all(ValueError, getattr(mpidp, call), arg, name=name)
    _words(exc, "cannot scatter a scalar", "at least one dimension")
    _sum_works(name)


@pytest.mark.mpi
@pytest.mark.parametrize("factor", ["prescale_factor", "postscale_factor"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_row_non_finite_scale_factor(factor, value):
    """Refused on every rank alike (a NaN on every rank was reported as a cross-rank
    mismatch, NaN being unequal to itself)."""
    name = f"test_row_non_finite_scale_factor.{factor}.{value}"
    exc = raises_all(ValueError, mpidp.allreduce, torch.ones(2), name=name, **{factor: value})
    _words(exc, "must be finite")
    _sum_works(name)


# ---- row: an op a collective does not support ----


@pytest.mark.mpi
@pytest.mark.parametrize(
    "case",
    [
        "reducescatter Min",
        "reducescatter Product",
        "allreduce Adasum of int",
        "allreduce unknown op",
        "allreduce Average of bool",
        "sparse_allreduce Max",
    ],
)
def test_row_unsupported_reduce_op(case):
    name = f"test_row_unsupported_op.{case.replace(' ', '_')}"
    n = size()
    cases = {
        "reducescatter Min": (
            ValueError,
            lambda: mpidp.reducescatter(torch.ones(n), op=mpidp.Min, name=name),
            ["Min", "not supported", "mpidp.Average or mpidp.Sum"],
        ),
        "reducescatter Product": (
            ValueError,
            lambda: mpidp.reducescatter(torch.ones(n), op=mpidp.Product, name=name),
            ["Product", "not supported", "mpidp.Average or mpidp.Sum"],
        ),
        # Adasum needs floats, and (as in Horovod) a power-of-2 number of ranks, which a
        # world of 3 lacks before anything else (tests/mpi/test_adasum.py has the rest).
        "allreduce Adasum of int": (
            TypeError,
            lambda: mpidp.allreduce(torch.ones(2, dtype=torch.int32), op=mpidp.Adasum, name=name),
            ["Adasum", "float32", "int32", "use mpidp.Sum"],
        )
        if n & (n - 1) == 0
        else (
            NotImplementedError,
            lambda: mpidp.allreduce(torch.ones(2, dtype=torch.int32), op=mpidp.Adasum, name=name),
            ["Adasum", "power-of-2", f"runs on {n}", "op=mpidp.Average"],
        ),
        "allreduce unknown op": (
            ValueError,
            lambda: mpidp.allreduce(torch.ones(2), op=99, name=name),
            ["unknown reduce op 99", "mpidp.Average, Sum"],
        ),
        "allreduce Average of bool": (
            TypeError,
            lambda: mpidp.allreduce(torch.ones(2, dtype=torch.bool), name=name),
            ["Average", "bool", "use Sum"],
        ),
        "sparse_allreduce Max": (
            ValueError,
            lambda: mpidp.sparse_allreduce_async(torch.eye(2).to_sparse(), op=mpidp.Max, name=name),
            ["Average and Sum", "Max"],
        ),
    }
    exc_type, fn, words = cases[case]
    exc = raises_all(exc_type, fn)
    _words(exc, *words)
    _sum_works(name)


# ---- row: what Horovod refuses with RuntimeError is a RuntimeError here too ----


@pytest.mark.timeout(60)
@pytest.mark.mpi
@pytest.mark.parametrize(
    "case",
    [
        "reducescatter Adasum",
        "reducescatter Max",
        "reducescatter of a scalar",
        "grouped_reducescatter of a scalar",
        "alltoall of a scalar",
        "sparse_allreduce Max",
    ],
)
def test_row_horovod_runtime_errors_are_both(case):
    """Horovod scripts catch these as RuntimeError (Horovod's tests do), mpidp's callers as
    ValueError: the one exception is both, and mpidp.ArgumentError."""
    name = f"test_row_horovod_runtime_errors.{case.replace(' ', '_')}"
    n = size()
    cases = {
        "reducescatter Adasum": lambda: mpidp.reducescatter(
            torch.ones(n), op=mpidp.Adasum, name=name
        ),
        "reducescatter Max": lambda: mpidp.reducescatter(torch.ones(n), op=mpidp.Max, name=name),
        "reducescatter of a scalar": lambda: mpidp.reducescatter(torch.tensor(1.0), name=name),
        "grouped_reducescatter of a scalar": lambda: mpidp.grouped_reducescatter(
            [torch.ones(n), torch.tensor(1.0)], name=name
        ),
        "alltoall of a scalar": lambda: mpidp.alltoall(torch.tensor(1.0), name=name),
        "sparse_allreduce Max": lambda: mpidp.sparse_allreduce_async(
            torch.eye(2).to_sparse(), op=mpidp.Max, name=name
        ),
    }
    exc = raises_all(RuntimeError, cases[case])
    assert_all(
        isinstance(exc, ValueError) and isinstance(exc, mpidp.ArgumentError),
        f"{type(exc).__mro__} is not a ValueError and mpidp.ArgumentError",
    )
    _sum_works(name)


# ---- row: use before init() and after shutdown() ----

_BEFORE_INIT = """
import torch, mpidp
for what, fn in (("allreduce", lambda: mpidp.allreduce(torch.ones(1))),
                 ("broadcast_async", lambda: mpidp.broadcast_async(torch.ones(1), 0)),
                 ("rank", mpidp.rank), ("barrier", mpidp.barrier), ("join", mpidp.join)):
    try:
        fn()
        print(what, "WORKED")
    except mpidp.NotInitializedError as e:
        print(what, "REFUSED:", e)
print("MPI initialised by the attempts:", __import__("sys").modules.get("mpi4py.MPI") is not None)
"""


@pytest.mark.mpi
def test_row_use_before_init():
    """A fresh process that never called init(): every call is refused, and MPI is not even
    initialised by the attempt (importing mpidp must not start MPI)."""
    code, out = _lone_python(_BEFORE_INIT) if rank() == 0 else (0, "")
    problems = [] if code == 0 else [f"exit {code}: {out}"]
    if rank() == 0:
        for what in ("allreduce", "broadcast_async", "rank", "barrier", "join"):
            line = next((ln for ln in out.splitlines() if ln.startswith(what + " ")), "")
            if "REFUSED:" not in line or "call mpidp.init() first" not in line:
                problems.append(f"{what}: {line or 'no line'}")
        if "MPI initialised by the attempts: False" not in out:
            problems.append(f"MPI was initialised: {out}")
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
def test_row_use_after_shutdown():
    name = "test_row_use_after_shutdown"
    handle = mpidp.allreduce_async(torch.ones(1), op=mpidp.Sum, name=name)
    mpidp.synchronize(handle)
    mpidp.shutdown()
    try:
        problems = []
        for what, fn in (
            ("allreduce", lambda: mpidp.allreduce(torch.ones(1), name=name)),
            ("allgather_async", lambda: mpidp.allgather_async(torch.ones(1))),
            ("size", mpidp.size),
            ("synchronize", lambda: mpidp.synchronize(handle)),
            ("barrier", mpidp.barrier),
        ):
            try:
                fn()
                problems.append(f"{what} worked after shutdown()")
            except mpidp.NotInitializedError as e:
                if "call mpidp.init() first" not in str(e) or "shutdown()" not in str(e):
                    problems.append(f"{what}: message does not say what to do: {e}")
            except Exception as e:  # noqa: BLE001 - any other error is a wrong answer here
                problems.append(f"{what}: {type(e).__name__}: {e}")
    finally:
        mpidp.init()
    assert_all(not problems, "; ".join(problems))
    _sum_works(name)


# ---- row: duplicate names ----


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("second", ["allreduce_async", "allgather_async", "grouped_allreduce"])
def test_row_duplicate_name_in_flight(second):
    """The last rank holds its submission back, so the first op is surely still in flight on
    the other ranks when they submit a second op under the same name."""
    name = f"test_row_duplicate_name.{second}"
    n, last = size(), rank() == size() - 1
    # A group of tensors of one dtype is one op under the group's name.
    in_flight = name
    first = None if last else mpidp.allreduce_async(torch.ones(2), op=mpidp.Sum, name=in_flight)
    problem = ""
    if not last:
        fn = {
            "allreduce_async": lambda: mpidp.allreduce_async(torch.ones(2), name=name),
            "allgather_async": lambda: mpidp.allgather_async(torch.ones(2), name=name),
            "grouped_allreduce": lambda: mpidp.grouped_allreduce([torch.ones(2)], name=name),
        }[second]
        try:
            fn()
            problem = "the second op under the same name was accepted"
        except ValueError as e:
            missing = [
                w
                for w in (
                    repr(in_flight),
                    "already in flight",
                    "synchronize it first",
                    "unique name",
                )
                if w not in str(e)
            ]
            problem = f"message {str(e)!r} lacks {missing}" if missing else ""
        except Exception as e:  # noqa: BLE001 - the wrong error type is a failure here
            problem = f"{type(e).__name__}: {e}"
    assert_all(not problem, problem)
    if last:
        first = mpidp.allreduce_async(torch.ones(2), op=mpidp.Sum, name=in_flight)
    out = run_all(mpidp.synchronize, first)
    assert_all(out.tolist() == [float(n)] * 2, f"the first op: {out.tolist()}")


# ---- row: MPI thread level too low ----

_THREAD_SINGLE = """
import mpi4py
mpi4py.rc.thread_level = "single"
import mpidp
try:
    mpidp.init()
    print("INITIALISED")
except mpidp.MpidpError as e:
    print("REFUSED:", type(e).__name__, e)
"""


@pytest.mark.mpi
def test_row_mpi_thread_level_too_low():
    """A process whose MPI runs at MPI_THREAD_SINGLE: init() refuses, naming the level it got,
    the level it needs and the setting that fixes it. (Under mpiexec with the environment
    variable: tests/integration/test_launch.py and test_doctor.py.)"""
    code, out = _lone_python(_THREAD_SINGLE) if rank() == 0 else (0, "")
    problems = []
    if rank() == 0:
        line = next((ln for ln in out.splitlines() if ln.startswith("REFUSED:")), "")
        if code != 0 or not line:
            problems.append(f"not refused (exit {code}): {out}")
        for word in ("'single'", "at least 'serialized'", "MPI4PY_RC_THREAD_LEVEL", "'multiple'"):
            if word not in line:
                problems.append(f"message lacks {word!r}: {line}")
    assert_all(not problems, "; ".join(problems))


# ---- row: a malformed MPIDP_* value ----

MALFORMED = [
    ("MPIDP_FUSION_THRESHOLD_BYTES", "-1", ">= 0"),
    ("MPIDP_LOG_LEVEL", "loud", "expected one of trace, debug"),
    ("MPIDP_HIERARCHICAL_ALLREDUCE", "maybe", "expected 1/0, true/false"),
    ("MPIDP_BACKEND", "carrier-pigeon", "expected one of auto, mpi"),
    ("MPIDP_STALL_WARNING_S", "inf", "finite number"),
    ("MPIDP_FUSION_THRESHOLD_BYTES", "lots", "expected an integer"),
    ("MPIDP_CYCLE_TIME_MS", "soon", "expected a number"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("var,value,accepted", MALFORMED)
def test_row_malformed_knob(var, value, accepted):
    """Negotiated at init(): every rank gets the same ConfigError naming the variable, its value
    and what is accepted. Here every rank sets it; tests/integration/test_launch.py sets it on
    one rank only."""
    mpidp.shutdown()
    os.environ[var] = value
    try:
        exc = raises_all(mpidp.ConfigError, mpidp.init)
    finally:
        del os.environ[var]
        mpidp.shutdown()
        mpidp.init()
    _words(exc, "rank 0:", f"{var}={value!r}", "is not valid")
    # The accepted values are named in the reason, not only in the knob's documentation.
    reason = str(exc).split("is not valid:", 1)[-1].split(". ", 1)[0]
    assert_all(
        accepted in reason, f"the reason {reason!r} does not say what is accepted ({accepted!r})"
    )
