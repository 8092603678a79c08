"""Code rules checked in every test run: ruff, mypy, module docstrings and sizes, *_built()."""

import ast
import hashlib
import pathlib
import subprocess
import sys
import tempfile
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = sorted((ROOT / "mpidp").rglob("*.py"))
# One concept per module, never split for size: about 400 lines reads in one sitting (a warning
# past it), and a module past 500 holds more than one concept.
SOFT_LINES, MAX_LINES = 400, 500


def test_ruff_format_is_clean():
    """Every file as `ruff format` lays it out (`ruff format .` mends it)."""
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", str(ROOT)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, f"ruff format would change:\n{out.stdout}{out.stderr}"


def test_ruff_lint_is_clean():
    """The rule set is in pyproject.toml ([tool.ruff]); `ruff check --fix` mends some."""
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, f"ruff check found problems:\n{out.stdout}{out.stderr}"


_MYPY: list = []  # the mypy run, once started


def start_mypy() -> subprocess.Popen:
    """mypy over mpidp/ in the background, started once. tests/unit/conftest.py starts it as
    soon as the session is collected and runs test_mypy_is_clean last, so that a cold run (20-30 s
    of CPU, in a fresh clone) takes the second core while the other unit tests run on the first."""
    if not _MYPY:
        key = hashlib.sha1(str(ROOT).encode()).hexdigest()[:12]
        cache = pathlib.Path(tempfile.gettempdir()) / f"mpidp-mypy-cache-{key}"
        _MYPY.append(
            subprocess.Popen(
                [sys.executable, "-m", "mypy", "--cache-dir", str(cache)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
                cwd=ROOT,
            )
        )
    return _MYPY[0]


def test_mypy_is_clean():
    """mypy over mpidp/ with the settings in pyproject.toml ([tool.mypy]). Its cache, one per
    checkout in the system's temp dir, brings a second run from about 20 s of CPU to 1 s."""
    proc = start_mypy()
    try:
        stdout, stderr = proc.communicate(timeout=280)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, f"mypy found problems:\n{stdout}{stderr}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_has_a_one_line_docstring(path):
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path)), clean=False)
    assert doc and doc.strip(), f"{path.relative_to(ROOT)} has no module docstring"
    lines = doc.split("\n")
    assert lines[0].strip(), f"{path.relative_to(ROOT)}: the docstring's first line is empty"
    assert len(lines) == 1 or not lines[1].strip(), (
        f"{path.relative_to(ROOT)}: the summary must fit on the first line (then a blank line)"
    )


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_at_most_500_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT)} has {n} lines (at most {MAX_LINES})"
    if n > SOFT_LINES:
        warnings.warn(f"{path.relative_to(ROOT)} has {n} lines (about {SOFT_LINES} is the aim)")


def _python(code: str) -> str:
    """What a fresh interpreter running `code` printed (it must exit 0)."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_built_queries_do_not_start_mpi():
    """`*_built()` may be asked before init(); importing mpi4py.MPI would initialise MPI."""
    code = (
        "import sys, mpidp\n"
        "names = [n for n in mpidp.__all__ if n.endswith('_built')]\n"
        "assert len(names) >= 6, names\n"
        "for n in names:\n"
        "    getattr(mpidp, n)()\n"
        "print('mpi4py.MPI' in sys.modules)\n"
    )
    assert _python(code) == "False", "a *_built() query imported mpi4py.MPI"


def test_importing_the_torch_distributed_backend_does_not_start_mpi():
    """Scripts import mpidp.distributed before init_process_group; MPI must start in
    mpidp.init(), which may first choose MPICH's netmod under srun (runtime/slurm_pmi.py)."""
    code = "import sys, mpidp.distributed\nprint('mpi4py.MPI' in sys.modules)\n"
    assert _python(code) == "False", "import mpidp.distributed imported mpi4py.MPI"


def test_import_and_eager_calls_do_not_import_dynamo():
    """torch.compile's Dynamo costs 1.2 s of CPU to import, in every rank of every job: mpidp
    leaves it out until something else (torch.compile) brings it in."""
    code = (
        "import sys, torch, mpidp\n"
        "mpidp.init()\n"
        "mpidp.allreduce(torch.ones(2), name='x')\n"
        "mpidp.shutdown()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    assert _python(code) == "False", "importing or calling mpidp imported torch._dynamo"
