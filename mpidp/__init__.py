"""mpidp: data-parallel training for PyTorch over MPI, Horovod-compatible (mpidp.torch as hvd)."""

from .ops.collectives import (allgather, allreduce, allreduce_, alltoall, broadcast, broadcast_,
                              grouped_allgather, grouped_allreduce, grouped_allreduce_,
                              grouped_reducescatter, reducescatter)
from .ops.compression import Compression
from .errors import (ArgumentError, CheckpointError, CheckpointNotFoundError, CollectiveError,
                     ConfigError, EngineShutdownError, HorovodInternalError, MismatchError,
                     MpidpError, NotInitializedError, OpTimeoutError)
from .ops.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                            broadcast_parameters, check_replicas)
from .runtime.observe import start_timeline, stats, stats_window, stop_timeline
from .training.optimizer import DistributedOptimizer
from .training import adasum_optimizer  # noqa: F401  (registers DistributedOptimizer(op=Adasum))
from .sharded.optimizer import ShardedOptimizer
from .sharded.scaler import ShardedGradScaler
from .runtime.process_sets import (ProcessSet, add_process_set, global_process_set,
                                   remove_process_set)
from .training.sync_batch_norm import SyncBatchNorm
from .ops import (Adasum, Average, Max, Min, Product, Sum, allgather_async, allreduce_async,
                  allreduce_async_, alltoall_async, broadcast_async, broadcast_async_,
                  grouped_allgather_async, grouped_allreduce_async, grouped_allreduce_async_,
                  grouped_reducescatter_async, poll, reducescatter_async,
                  synchronize)
from .ops.barrier_join import barrier, join
from .ops.sparse import sparse_allreduce_async
from .runtime.world import init, is_initialized, rank, shutdown, size
from .runtime.topology import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                               gloo_built, gloo_enabled, is_homogeneous, local_rank, local_size,
                               mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
                               rocm_built)

from . import checkpoint, elastic  # noqa: E402,F401 (submodules as attributes: mpidp.checkpoint.save)

__version__ = "0.1.0"

# Written out, not computed from dir(): a star import (mpidp.torch's) must bring the public
# names only, never mpidp's modules (runtime, log, engine); docs/api.md lists the same names
# and tests/unit/test_public_api.py holds the two together.
__all__ = [
    "Adasum", "ArgumentError", "Average", "CheckpointError", "CheckpointNotFoundError",
    "CollectiveError", "Compression", "ConfigError", "DistributedOptimizer", "EngineShutdownError",
    "HorovodInternalError", "Max", "Min", "MismatchError", "MpidpError", "NotInitializedError",
    "OpTimeoutError", "ProcessSet", "Product", "ShardedGradScaler", "ShardedOptimizer", "Sum",
    "SyncBatchNorm", "add_process_set",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "check_replicas",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built",
    "gloo_enabled", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous",
    "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "rocm_built", "shutdown", "size", "sparse_allreduce_async",
    "start_timeline", "stats", "stats_window", "stop_timeline", "synchronize",
]
