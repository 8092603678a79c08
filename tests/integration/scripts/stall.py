"""The last rank submits late (argv[1] seconds) or never ('never'); report what every rank saw."""

import sys
import time

import torch

import mpidp

mpidp.init()
rank, size = mpidp.rank(), mpidp.size()
late = sys.argv[1]
x = torch.ones(2)
if rank == size - 1:
    if late == "never":
        time.sleep(8)
        sys.exit(0)
    time.sleep(float(late))
try:
    out = mpidp.allreduce(x, op=mpidp.Sum, name="stalled.tensor")
    print(f"rank {rank}: result {out.tolist()}", flush=True)
except mpidp.HorovodInternalError as exc:
    print(f"rank {rank}: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(4)
mpidp.shutdown()
