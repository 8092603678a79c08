"""Data-path plumbing without peers: dispatch by device, the staging CPU twin, knob rules."""

import pytest
import torch

from mpidp import config as mpidp_config
from mpidp.engine import mpi, mpi_library
from mpidp.engine.backends import Dispatch, available, make_backend
from mpidp.engine.backends.cuda import StagedBackend, StreamOrdered, cuda_aware_mpi
from mpidp.engine.backends.host import uneven_counts
from mpidp.engine.backends.torchdist import _pg_op, _rows_as_bytes
from mpidp.engine.messages import OpType, ReduceOp, Request, Response
from mpidp.engine.scaling import scale_after
from mpidp.engine.tensor_queue import Entry
from mpidp.errors import ConfigError, MpidpError

pytestmark = pytest.mark.timeout(60)


def _batch(op, tensor, device="cpu", output=None, extra=None, name="t", **kw):
    req = Request(
        name, op, str(tensor.dtype).replace("torch.", ""), tuple(tensor.shape), device, **kw
    )
    output = tensor if output is None else output
    if op == OpType.ALLREDUCE:  # an allreduce carries lists of parts
        entry = Entry(req, [tensor], [output], extra)
    else:
        entry = Entry(req, tensor, output, extra)
    return [Response(name, op, req)], [entry]


class Recorder:
    """A backend that records what it was given and answers like a one-rank world would."""

    size = 1

    def __init__(self):
        self.seen = []
        self.closed = 0

    def reduce_dtype(self, dtype, device):
        return dtype

    def execute(self, batch, entries, *fusion_limits):
        self.seen.append((batch, entries))
        out = []
        for resp, entry in zip(batch, entries):
            if resp.op == OpType.ALLREDUCE:
                for src, dst in zip(entry.tensor, entry.output):
                    dst.copy_(src * 2)
                out.append(entry.output)
            elif resp.op == OpType.ALLGATHER:
                out.append(torch.cat([entry.tensor, entry.tensor]))
            elif resp.op == OpType.ALLTOALL:
                out.append((entry.tensor + 1, torch.tensor([entry.tensor.shape[0]])))
            else:
                out.append(None)
        return out

    def close(self):
        self.closed += 1


def test_dispatch_routes_by_device_kind():
    cpu, cuda = Recorder(), Recorder()
    d = Dispatch({"cpu": cpu, "cuda": cuda}, {"cpu": "mpi", "cuda": "nccl"})
    d.execute(*_batch(OpType.ALLREDUCE, torch.ones(2)))
    d.execute(*_batch(OpType.ALLREDUCE, torch.ones(2), device="cuda:1"))
    d.execute(*_batch(OpType.ALLREDUCE, torch.ones(2), device="cuda"))
    assert len(cpu.seen) == 1 and len(cuda.seen) == 2
    d.close()
    assert (cpu.closed, cuda.closed) == (1, 1)


def test_dispatch_closes_a_shared_backend_once():
    shared = Recorder()
    Dispatch({"cpu": shared, "cuda": StreamOrdered(shared)}, {}).close()
    assert shared.closed == 1
    shared = Recorder()
    Dispatch({"cpu": shared, "cuda": StagedBackend(shared)}, {}).close()
    assert shared.closed == 1


def test_dispatch_refuses_a_device_without_a_path():
    d = Dispatch({"cpu": Recorder()}, {"cpu": "mpi"})
    with pytest.raises(MpidpError, match="no data path for cuda"):
        d.execute(*_batch(OpType.ALLREDUCE, torch.ones(2), device="cuda:0"))


def test_staged_twin_runs_the_inner_backend_on_host_copies():
    inner = Recorder()
    staged = StagedBackend(inner, pin_memory=False)
    t = torch.arange(4.0)
    out = torch.zeros(4)
    batch, entries = _batch(OpType.ALLREDUCE, t, output=out)
    got = staged.execute(batch, entries)
    ((seen_batch, seen_entries),) = inner.seen
    assert seen_batch[0].request.device == "cpu"
    assert seen_entries[0].tensor[0] is not t and seen_entries[0].output[0] is not out
    assert got[0] == [out] and torch.equal(out, t * 2)
    assert torch.equal(t, torch.arange(4.0))  # input untouched


def test_staged_twin_in_place_and_new_results():
    staged = StagedBackend(Recorder(), pin_memory=False)
    t = torch.arange(3.0)
    got = staged.execute(*_batch(OpType.ALLREDUCE, t))
    assert got[0][0] is t and torch.equal(t, torch.arange(3.0) * 2)
    g = staged.execute(*_batch(OpType.ALLGATHER, torch.ones(2, 2)))[0]
    assert g.shape == (4, 2) and g.device.type == "cpu"
    rows, splits = staged.execute(*_batch(OpType.ALLTOALL, torch.zeros(3)))[0]
    assert torch.equal(rows, torch.ones(3)) and torch.equal(splits, torch.tensor([3]))
    assert staged.execute(*_batch(OpType.BARRIER, torch.empty(0))) == [None]


def test_staged_twin_keeps_joined_entries_empty():
    inner = Recorder()
    staged = StagedBackend(inner, pin_memory=False)
    batch, entries = _batch(OpType.BARRIER, torch.empty(0))
    staged.execute(batch, [None])
    assert inner.seen[0][1] == [None]


def test_stream_ordered_is_transparent_on_cpu():
    inner = Recorder()
    t = torch.ones(2)
    assert StreamOrdered(inner).execute(*_batch(OpType.ALLREDUCE, t))[0][0] is t
    assert torch.equal(t, torch.full((2,), 2.0))


def test_cuda_aware_knob():
    assert cuda_aware_mpi("1") is True
    assert cuda_aware_mpi("0") is False
    assert cuda_aware_mpi("auto") is bool(mpi_library.cuda_aware_support())


def test_available_reports_this_torch():
    facts = available()
    assert facts["gloo"] == torch.distributed.is_gloo_available()
    assert facts["nccl"] == torch.distributed.is_nccl_available()
    assert facts["cuda_available"] == torch.cuda.is_available()
    assert facts["cuda_aware_mpi"] in (True, False, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_nccl_without_a_gpu_is_a_config_error():
    with pytest.raises(ConfigError, match="MPIDP_BACKEND=nccl needs"):
        make_backend(None, mpidp_config.load(backend="nccl"))


def test_simulated_node_larger_than_the_world_is_a_config_error():
    from mpi4py import MPI

    with pytest.raises(ConfigError, match="MPIDP_SIMULATED_LOCAL_SIZE"):
        mpi.Comms(MPI.COMM_SELF, simulated_local_size=MPI.COMM_WORLD.Get_size() + 1)


def test_mpi_library_facts():
    assert mpi.library_version()
    assert mpi.thread_level_name() in ("single", "funneled", "serialized", "multiple")


def test_uneven_counts():
    assert uneven_counts(7, 3) == [3, 2, 2]
    assert uneven_counts(2, 4) == [1, 1, 0, 0]
    assert uneven_counts(0, 2) == [0, 0]


def test_scale_after_matches_the_documented_rules():
    ints = torch.tensor([7, -7, -3])
    scale_after(ints, Request("i", OpType.ALLREDUCE, reduce_op=ReduceOp.AVERAGE), 2)
    assert torch.equal(ints, torch.tensor([3, -3, -1]))  # truncated toward zero, as Horovod
    ints = torch.tensor([7, -7], dtype=torch.int32)  # postscale 3 / 2 ranks: 10.5 -> 10
    scale_after(ints, Request("i", OpType.ALLREDUCE, reduce_op=ReduceOp.AVERAGE, postscale=3.0), 2)
    assert torch.equal(ints, torch.tensor([10, -10], dtype=torch.int32))
    ints = torch.tensor([5], dtype=torch.uint8)
    scale_after(ints, Request("i", OpType.ALLREDUCE, reduce_op=ReduceOp.SUM, postscale=0.5), 4)
    assert ints.item() == 2
    floats = torch.tensor([6.0])
    scale_after(
        floats, Request("f", OpType.ALLREDUCE, reduce_op=ReduceOp.AVERAGE, postscale=2.0), 3
    )
    assert floats.item() == 4.0


def test_process_group_op_mapping():
    dist = torch.distributed
    assert _pg_op(ReduceOp.AVERAGE, False) == dist.ReduceOp.SUM
    assert _pg_op(ReduceOp.PRODUCT, False) == dist.ReduceOp.PRODUCT
    for op in (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MAX):
        assert _pg_op(op, True) == dist.ReduceOp.MAX  # logical or
    for op in (ReduceOp.MIN, ReduceOp.PRODUCT):
        assert _pg_op(op, True) == dist.ReduceOp.MIN  # logical and


def test_rows_as_bytes_shares_memory():
    t = torch.arange(6, dtype=torch.int16).reshape(3, 2)
    b = _rows_as_bytes(t, 3)
    assert b.shape == (3, 4) and b.dtype == torch.uint8 and b.data_ptr() == t.data_ptr()
    assert _rows_as_bytes(torch.empty(2, 0), 2).shape == (2, 0)


def test_local_device_is_this_ranks_tensor_device():
    from mpidp.engine.backends.parts import local_device

    batch, entries = _batch(OpType.ALLREDUCE, torch.ones(1), device="cuda:3")
    assert local_device(batch, entries) == torch.device("cpu")  # the tensor's, not the name's
    assert local_device(*_batch(OpType.ALLREDUCE, torch.ones(1))[:1], [None]) == torch.device("cpu")
