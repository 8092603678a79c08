"""keep_freed_memory: glibc's malloc keeps freed blocks, so a step's large tensors stop
page-faulting in again; left alone where the user set malloc's thresholds."""

import platform
import subprocess
import sys

import pytest

from mpidp import malloc_reuse

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# In a fresh process: the page faults of the last of five rounds that each allocate, touch and
# free 100 MB and 60 MB (what a training step does with its large tensors).
CHURN = """
import resource, sys, torch
from mpidp import malloc_reuse
if sys.argv[1] == "1":
    assert malloc_reuse.keep_freed_memory()
for i in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = torch.empty(25_000_000).fill_(1.0)
    b = torch.empty(15_000_000).fill_(2.0)
    del a, b
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(keep: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHURN, keep], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not GLIBC, reason="needs glibc's malloc")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    left, kept = _faults("0"), _faults("1")
    # 160 MB is about 39 000 pages: glibc's defaults map and unmap both blocks every round.
    assert left > 30_000, f"{left} page faults in the last round with malloc's defaults"
    assert kept < 1_000, f"{kept} page faults in the last round with the thresholds set"


@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "0"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"}])
def test_the_users_own_malloc_settings_are_left_alone(env):
    assert malloc_reuse.keep_freed_memory(env) is False


def test_other_tunables_do_not_stop_it():
    assert malloc_reuse.keep_freed_memory({"GLIBC_TUNABLES": "glibc.rtld.nns=2"}) is GLIBC
