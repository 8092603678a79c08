"""The ops wing: collectives on tensors; this face holds what the layers above call (`ops.X`)."""

from .allreduce_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allreduce_async,
    allreduce_async_,
    bucket_allreduce_async_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from .gather_ops import (
    allgather_async,
    allgather_into_async,
    alltoall_async,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_reducescatter_async,
    reducescatter_async,
    reducescatter_into_async,
)
from .submission import blocking, first_result, new_entry, only_result, set_blocking, submit
from .waits import poll, synchronize

__all__ = [
    "Adasum",
    "Average",
    "Max",
    "Min",
    "Product",
    "Sum",
    "allgather_async",
    "allgather_into_async",
    "allreduce_async",
    "allreduce_async_",
    "alltoall_async",
    "blocking",
    "broadcast_async",
    "broadcast_async_",
    "bucket_allreduce_async_",
    "first_result",
    "grouped_allgather_async",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter_async",
    "new_entry",
    "only_result",
    "poll",
    "reducescatter_async",
    "reducescatter_into_async",
    "set_blocking",
    "submit",
    "synchronize",
]
