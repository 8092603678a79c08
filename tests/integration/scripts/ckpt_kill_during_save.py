"""Load the checkpoint (reporting its version), then save version V while rank 0 is SIGKILLed.

Usage: ckpt_kill_during_save.py PATH V MODE VALUE. MODE none: save and exit. MODE delay: rank 0
is killed VALUE seconds after the save starts (or, if the save is done by then, while it waits).
MODE bytes: rank 0 is killed once the save's temporary file holds VALUE bytes.
"""

import glob
import os
import signal
import sys
import threading
import time

import torch

import mpidp
from mpidp import checkpoint

SIZES = [4 << 20, 2 << 20] + [1000] * 20  # float32 elements: about 24 MiB in all


def tensors(version):
    return {f"t{i}": torch.full((n,), float(version)) for i, n in enumerate(SIZES)}


def kill_after(seconds):
    time.sleep(seconds)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_when_written(path, nbytes):
    directory, base = os.path.split(os.path.abspath(path))
    pattern = os.path.join(directory, f".{base}.tmp-*")
    while True:
        for tmp in glob.glob(pattern):
            try:
                if os.path.getsize(tmp) >= nbytes:
                    os.kill(os.getpid(), signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.0005)


path, version, mode, value = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
mpidp.init()
rank = mpidp.rank()
try:
    rest = checkpoint.load(path)
    loaded = rest["tensors"]
    ok = set(loaded) == set(tensors(0)) and all(
        torch.equal(t, torch.full_like(t, float(rest["version"]))) for t in loaded.values()
    )
    print(f"rank {rank}: loaded version {rest['version']} consistent {ok}", flush=True)
except checkpoint.CheckpointNotFoundError:
    print(f"rank {rank}: no checkpoint yet", flush=True)

state = tensors(version)
if rank == 0 and mode == "delay":
    threading.Thread(target=kill_after, args=(value,), daemon=True).start()
elif rank == 0 and mode == "bytes":
    threading.Thread(target=kill_when_written, args=(path, int(value)), daemon=True).start()
start = time.monotonic()
checkpoint.save(path, tensors=state, version=version)
print(f"rank {rank}: saved version {version} in {time.monotonic() - start:.3f} s", flush=True)
if rank == 0 and mode != "none":
    print("rank 0: save finished before the kill", flush=True)
    if mode == "bytes":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)  # the timer thread kills this process
