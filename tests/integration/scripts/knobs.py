"""Set an environment variable on one rank only (from argv), then init(); report the outcome."""

import os
import sys

import mpidp  # the variable set below still counts: init() reads the knobs, not the import
from mpidp.config import launcher_rank

rank = launcher_rank() or 0
var, value, on_rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
if rank == on_rank:
    os.environ[var] = value

try:
    mpidp.init()
except mpidp.ConfigError as exc:
    # One short line per rank: long lines from several ranks can interleave in the launcher.
    print(f"rank {rank}: ConfigError: {str(exc)[:80]}", flush=True)
    # The launcher kills the job when the first rank exits non-zero: let every rank print first.
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
    sys.exit(3)
print(f"rank {rank}: initialised", flush=True)
mpidp.shutdown()
