"""Set an environment variable on one rank only (from argv), then init(); report the outcome."""

import os
import sys

rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
var, value, on_rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
if rank == on_rank:
    os.environ[var] = value

import mpidp  # noqa: E402

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
