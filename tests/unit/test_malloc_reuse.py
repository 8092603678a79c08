"""keep_freed_memory: glibc's malloc keeps freed blocks, so a step's large tensors stop
page-faulting in again; left alone where the user set malloc's thresholds."""

import ctypes
import json
import platform
import subprocess
import sys

import pytest

from mpidp.runtime import malloc_reuse

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# In a fresh process: eight rounds that each allocate, touch and free 100 MB and 60 MB (what a
# training step does with its large tensors), read through glibc's own accounting (mallinfo2):
# per round, the bytes held in mmapped blocks while both are allocated, beyond those before,
# and the heap's size once they are freed. Counting page faults instead measured the host too:
# under load (NUMA balancing, reclaim) pages that were kept faulted in again (4882 faults once).
CHURN = """
import ctypes, json, sys, torch
from mpidp.runtime import malloc_reuse
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
info = ctypes.CDLL(None).mallinfo2
info.restype = Info
torch.set_num_threads(1)  # worker threads would bring arenas of their own into the count
if sys.argv[1] == "1":
    assert malloc_reuse.keep_freed_memory()
rounds = []
for i in range(8):
    mapped = info().hblkhd
    a = torch.empty(25_000_000).fill_(1.0)
    b = torch.empty(15_000_000).fill_(2.0)
    mapped_while_held = info().hblkhd - mapped
    del a, b
    rounds.append((mapped_while_held, info().arena))
print(json.dumps(rounds))
"""
MB = 1_000_000


def _rounds(keep: str):
    out = subprocess.run(
        [sys.executable, "-c", CHURN, keep],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.split("\n")[-2])


@pytest.mark.skipif(
    not GLIBC or not hasattr(ctypes.CDLL(None), "mallinfo2"),
    reason="needs glibc's malloc (2.33 or later, for mallinfo2)",
)
def test_freed_blocks_are_reused_instead_of_mapped_again():
    left, kept = _rounds("0"), _rounds("1")
    # glibc's defaults map both blocks (160 MB) every round, and unmap them at free: each
    # round's pages are new ones, faulted in again.
    assert all(mapped >= 150 * MB for mapped, _ in left), f"defaults: {left}"
    # Kept: the blocks come from the heap, which keeps them once freed (not trimmed) and hands
    # the same memory out again: no round maps anything, and the heap stops growing.
    assert all(mapped < 1 * MB for mapped, _ in kept), f"thresholds set: {kept}"
    heaps = [heap for _, heap in kept]
    assert heaps[-1] >= 150 * MB, f"the freed blocks were given back: {kept}"
    # Without reuse each later round would add its 160 MB (1120 MB over the seven). With reuse
    # the heap may still grow by a block for a few rounds: a small allocation made after a free
    # can land in the freed range and split it (seen: 0 to 220 MB, or 320 MB over three rounds,
    # then flat). So: it stops growing, and grows by less than half of what no reuse would.
    assert heaps[-1] - heaps[-4] < 160 * MB, f"the heap kept growing: {kept}"
    assert heaps[-1] - heaps[0] < 560 * MB, f"the heap grew as without reuse: {kept}"


@pytest.mark.parametrize(
    "env", [{"MALLOC_TRIM_THRESHOLD_": "0"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"}]
)
def test_the_users_own_malloc_settings_are_left_alone(env):
    assert malloc_reuse.keep_freed_memory(env) is False


def test_other_tunables_do_not_stop_it():
    assert malloc_reuse.keep_freed_memory({"GLIBC_TUNABLES": "glibc.rtld.nns=2"}) is GLIBC
