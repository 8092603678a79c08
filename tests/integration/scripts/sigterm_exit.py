"""Rank 1 gets SIGTERM (as from scancel) while its main thread runs blocking allreduces, and its
handler raises SystemExit(0): rank 1 must end cleanly and the others' ops fail naming it."""

import os
import signal
import threading

import torch

import mpidp


def on_term(signum, frame):
    raise SystemExit(0)


signal.signal(signal.SIGTERM, on_term)
mpidp.init()
rank = mpidp.rank()
if rank == 1:  # from another thread, so it lands at any point of the main thread's calls
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
try:
    for i in range(1_000_000):
        mpidp.allreduce(torch.ones(1000), name=f"t{i % 7}")
except mpidp.EngineShutdownError as exc:
    print(f"rank {rank}: EngineShutdownError: {exc}", flush=True)
