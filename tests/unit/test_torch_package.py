"""`mpidp.torch` answers the submodule imports Horovod scripts make, with mpidp's own objects."""

import importlib

import pytest

import mpidp
import mpidp.torch as hvd

# Where the code of each Horovod-named submodule lives (mpi_ops: mpidp itself).
HOMES = {
    "compression": "mpidp.ops.compression",
    "elastic": "mpidp.state.elastic",
    "functions": "mpidp.ops.functions",
    "optimizer": "mpidp.training.optimizer",
    "sync_batch_norm": "mpidp.training.sync_batch_norm",
    "mpi_ops": "mpidp",
}

# (Horovod's submodule, names scripts import from it)
SUBMODULES = [
    ("compression", ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"]),
    ("elastic", ["run", "State", "ObjectState", "TorchState", "ElasticSampler"]),
    (
        "functions",
        [
            "broadcast_parameters",
            "broadcast_optimizer_state",
            "broadcast_object",
            "allgather_object",
        ],
    ),
    ("optimizer", ["DistributedOptimizer"]),
    ("sync_batch_norm", ["SyncBatchNorm"]),
    (
        "mpi_ops",
        [
            "allreduce",
            "allreduce_async",
            "allreduce_",
            "allreduce_async_",
            "grouped_allreduce",
            "allgather",
            "broadcast",
            "broadcast_",
            "alltoall",
            "reducescatter",
            "synchronize",
            "poll",
            "join",
            "barrier",
            "init",
            "shutdown",
            "size",
            "rank",
            "local_size",
            "local_rank",
            "cross_size",
            "cross_rank",
            "is_initialized",
            "Average",
            "Sum",
            "Min",
            "Max",
            "Product",
            "Adasum",
            "ProcessSet",
            "global_process_set",
            "add_process_set",
            "remove_process_set",
            "mpi_threads_supported",
            "mpi_enabled",
            "mpi_built",
            "gloo_enabled",
            "nccl_built",
        ],
    ),
]


@pytest.mark.parametrize("sub,names", SUBMODULES, ids=[s for s, _ in SUBMODULES])
def test_submodule_imports_resolve_to_mpidp_objects(sub, names):
    module = importlib.import_module(f"mpidp.torch.{sub}")
    assert getattr(hvd, sub) is module  # `hvd.compression.X` and `from ... import X` agree
    home = importlib.import_module(HOMES[sub])
    for name in names:
        assert getattr(module, name) is getattr(home, name), f"mpidp.torch.{sub}.{name}"


def test_elastic_submodule_re_exports_the_one_implementation():
    from mpidp.torch.elastic import TorchState

    assert TorchState is mpidp.elastic.TorchState


def test_top_level_names_unchanged():
    assert hvd.__all__ == mpidp.__all__
    for name in ("DistributedOptimizer", "allreduce", "init", "Compression", "SyncBatchNorm"):
        assert getattr(hvd, name) is getattr(mpidp, name)
