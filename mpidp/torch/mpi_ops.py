"""Horovod's `horovod.torch.mpi_ops`: collectives, handles, basics (ops/, runtime/)."""

from ..ops.collectives import (allgather, allreduce, allreduce_, alltoall, broadcast, broadcast_,
                               grouped_allgather, grouped_allreduce, grouped_allreduce_,
                               grouped_reducescatter, reducescatter)
from ..ops.barrier_join import barrier, join
from mpidp.ops import (Adasum, Average, Max, Min, Product, Sum, allgather_async,
                       allreduce_async, allreduce_async_, alltoall_async,
                       broadcast_async, broadcast_async_, grouped_allgather_async,
                       grouped_allreduce_async, grouped_allreduce_async_,
                       grouped_reducescatter_async, poll, reducescatter_async,
                       synchronize)
from ..ops.sparse import sparse_allreduce_async
from ..runtime.process_sets import (ProcessSet, add_process_set, global_process_set,
                                    remove_process_set)
from ..runtime.world import init, is_initialized, rank, shutdown, size
from ..runtime.topology import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                                gloo_built, gloo_enabled, is_homogeneous, local_rank, local_size,
                                mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
                                rocm_built)

__all__ = [
    "Adasum", "add_process_set", "allgather", "allgather_async", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "Average", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built", "gloo_enabled",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join", "local_rank",
    "local_size", "Max", "Min", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
    "poll", "ProcessSet", "Product", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "rocm_built", "shutdown", "size", "sparse_allreduce_async", "Sum",
    "synchronize",
]
