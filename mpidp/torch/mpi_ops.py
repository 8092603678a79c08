"""Horovod's `horovod.torch.mpi_ops`: collectives, handles, basics (mpidp/collectives.py, ops.py, ...)."""

from mpidp.collectives import (allgather, allreduce, allreduce_, alltoall,  # noqa: F401
                               broadcast, broadcast_, grouped_allgather, grouped_allreduce,
                               grouped_allreduce_, grouped_reducescatter, reducescatter)
from mpidp.ops import (Adasum, Average, Max, Min, Product, Sum, allgather_async,  # noqa: F401
                       allreduce_async, allreduce_async_, alltoall_async, barrier,
                       broadcast_async, broadcast_async_, grouped_allgather_async,
                       grouped_allreduce_async, grouped_allreduce_async_,
                       grouped_reducescatter_async, join, poll, reducescatter_async,
                       sparse_allreduce_async, synchronize)
from mpidp.process_sets import (ProcessSet, add_process_set,  # noqa: F401
                                global_process_set, remove_process_set)
from mpidp.runtime import init, is_initialized, rank, shutdown, size  # noqa: F401
from mpidp.topology import (ccl_built, cross_rank, cross_size, cuda_built,  # noqa: F401
                            ddl_built, gloo_built, gloo_enabled, is_homogeneous, local_rank,
                            local_size, mpi_built, mpi_enabled, mpi_threads_supported,
                            nccl_built, rocm_built)
