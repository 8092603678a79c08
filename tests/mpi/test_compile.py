"""torch.compile around code that calls mpidp: Dynamo calls the collectives, never traces them."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mpi_util import assert_all, max_deviation, my_rows, row_batches, run_all

import mpidp

ROWS = 2


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.mpi
def test_collectives_inside_a_compiled_function():
    """They crashed the engine (Dynamo traced into its MPI calls)."""

    @torch.compile(backend="eager")
    def averaged(x):
        y = mpidp.allreduce(x * 2, name="compiled.avg")
        h = mpidp.allgather_async(x, name="compiled.gather")
        return y + 1, mpidp.synchronize(h)

    r, n = mpidp.rank(), mpidp.size()
    for _ in range(3):  # a named allreduce takes the express lane from its second call on
        y, g = run_all(averaged, torch.full((3,), float(r)))
    want = (n - 1) + 1.0
    assert_all(torch.allclose(y, torch.full((3,), want)) and g.numel() == 3 * n, f"{y}, {g}")


@pytest.mark.mpi
@pytest.mark.parametrize("what", ["optimizer_step", "whole_step"])
def test_compiled_optimizer_step_and_whole_train_step(what):
    """PyTorch's recipes: compile opt.step() alone, or the whole train step; equal to one
    process either way."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    ref = copy.deepcopy(model)
    opt = mpidp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    @torch.compile(backend="eager")
    def opt_step():
        opt.step()

    @torch.compile(backend="eager")
    def train_step(x, y):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for x, y in row_batches(3, ROWS, seed=6):
        if what == "optimizer_step":
            opt.zero_grad()
            F.cross_entropy(model(my_rows(x, ROWS)), my_rows(y, ROWS)).backward()
            run_all(opt_step)
        else:
            run_all(train_step, my_rows(x, ROWS), my_rows(y, ROWS))
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    err = max_deviation(model, ref)
    assert_all(err < 1e-10, f"deviation {err}")
