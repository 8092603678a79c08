"""The private and experimental torch APIs that mpidp.distributed relies on, pinned."""

import inspect

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def test_register_backend_takes_extended_api_and_devices():
    params = inspect.signature(dist.Backend.register_backend).parameters
    assert {"name", "func", "extended_api", "devices"} <= set(params)


def test_the_mpi_path_creates_groups_through_process_group_mpi_create():
    source = inspect.getsource(c10d._new_process_group_helper)
    assert "ProcessGroupMPI.create(global_ranks_in_group)" in source
    assert "issubclass(type(backend_class), ProcessGroup)" in source
    assert hasattr(c10d, "_MPI_AVAILABLE")
    assert "return _MPI_AVAILABLE" in inspect.getsource(c10d.is_mpi_available)


def test_the_mpi_path_makes_the_world_store_by_calling_store_from_the_module():
    """init_process_group's MPI branch calls the module's `Store` with no argument for the
    world's store, which groups made beside it then use (mpidp.distributed.store replaces it);
    the module uses the name nowhere else but in annotations."""
    source = inspect.getsource(c10d.init_process_group)
    assert "Store(),  # Placeholder" in source
    calls = [line for line in inspect.getsource(c10d).splitlines() if " Store()" in line]
    assert len(calls) == 1, calls


def test_process_group_and_work_subclass_in_python():
    class Group(dist.ProcessGroup):
        def getBackendName(self):
            return "x"

    class Done(dist.Work):
        def wait(self, timeout=None):
            return True

    group = Group(0, 1)
    assert group.rank() == 0 and group.size() == 1
    assert Done().wait()
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist._make_nccl_premul_sum(0.5)
    assert hasattr(opts, "asyncOp") and opts.reduceOp.op == dist.ReduceOp.PREMUL_SUM
    assert opts.reduceOp.factor == 0.5
    assert isinstance(torch.futures.Future(), torch.futures.Future)


def test_import_registers_mpidp_and_mpi_resolves_to_it():
    import mpidp.distributed

    assert "mpidp" in dist.Backend.backend_list
    if not mpidp.distributed.torch_has_mpi():
        assert dist.Backend("mpidp") == dist.Backend.MPI and dist.is_mpi_available()
        assert c10d.ProcessGroupMPI.create is not None


def test_post_accumulate_grad_hooks_are_an_ordered_table_of_handle_ids():
    """DistributedOptimizer reads it to find hooks registered after its own (training/optimizer)."""
    p = torch.nn.Parameter(torch.ones(1))
    first = p.register_post_accumulate_grad_hook(lambda t: None)
    second = p.register_post_accumulate_grad_hook(lambda t: None)
    assert list(p._post_accumulate_grad_hooks) == [first.id, second.id]
