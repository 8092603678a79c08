"""Shared pytest set-up for every mpidp test suite (tests/unit, tests/mpi, tests/integration).

Kept minimal on purpose. Does NOT import ``mpi4py.MPI``: that initialises MPI, which is the
package's (and pytest-mpi's) job, not conftest's (``mpidp.config`` does not import it).

Per-rank ``--basetemp``: when several ranks of one ``mpiexec -n N python -m pytest ...`` launch
share pytest's default temp root, its numbered-dir rotation races between them (seen at -n 4).
So under an MPI launcher, and only when no ``--basetemp`` was given, each rank gets

    <tmp>/pytest-mpidp-<uid>/<launch id>/rank<N>

where <launch id> identifies the launch (PMIx namespace, Slurm job.step, else the parent pid,
which under hydra is the per-launch ``hydra_pmi_proxy``). A plain ``pytest`` run is untouched.

Once collected, everything imported so far (torch, sympy, pytest, the test modules: about a
million objects) is moved out of the cycle collector's sight with ``gc.freeze()``. A full
collection then looks only at what the tests made: mpidp collects before it prefixes a
DistributedOptimizer's names (training/buckets.py, claim), which happens in most tests that
build an optimizer after an earlier test's optimizer, left in a reference cycle, and each such
collection of the whole heap took 0.2-0.5 s (a sixth of a rank's time in the mpi stage).
"""

import gc
import os
import re
import shutil
import tempfile
import time

import pytest

# Also covers srun without an MPI plugin (SLURM_PROCID inside a step), where every task runs as
# its own world of size 1 but still shares /tmp.
from mpidp.config import launcher_rank

# Launch directories untouched for this long are removed by later launches.
_STALE_LAUNCH_DIR_S = 6 * 3600


def _launch_id():
    if os.environ.get("PMIX_NAMESPACE"):
        raw = os.environ["PMIX_NAMESPACE"]
    elif os.environ.get("OMPI_MCA_ess_base_jobid"):
        raw = "ompi" + os.environ["OMPI_MCA_ess_base_jobid"]
    elif os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_STEP_ID"):
        raw = "slurm{}.{}".format(os.environ["SLURM_JOB_ID"], os.environ["SLURM_STEP_ID"])
    else:
        raw = "ppid{}".format(os.getppid())
    return re.sub(r"[^A-Za-z0-9._-]", "_", raw)


def _prune_stale(root, keep):
    now = time.time()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        if entry.name == keep:
            continue
        try:
            if (
                entry.is_dir(follow_symlinks=False)
                and now - entry.stat().st_mtime > _STALE_LAUNCH_DIR_S
            ):
                shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            pass


@pytest.hookimpl(tryfirst=True)  # before pytest's tmpdir plugin reads config.option.basetemp
def pytest_configure(config):
    rank = launcher_rank()
    if rank is None or config.option.basetemp:
        return
    root = os.path.join(tempfile.gettempdir(), "pytest-mpidp-{}".format(os.getuid()))
    os.makedirs(root, mode=0o700, exist_ok=True)
    if os.stat(root).st_uid != os.getuid():
        # Someone else owns the shared root: fall back to a private dir of our own.
        root = tempfile.mkdtemp(prefix="pytest-mpidp-{}-".format(os.getuid()))
    launch = _launch_id()
    launch_dir = os.path.join(root, launch)
    os.makedirs(launch_dir, exist_ok=True)  # pytest creates rank<N> itself, but not parents
    _prune_stale(root, keep=launch)
    config.option.basetemp = os.path.join(launch_dir, "rank{}".format(rank))


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()
