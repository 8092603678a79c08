"""broadcast_parameters / broadcast_optimizer_state on channels_last and complex tensors."""

import pytest
import torch
import torch.nn as nn

import mpidp
from mpi_util import assert_all, gather, run_all


def _conv(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).to(
        memory_format=torch.channels_last)


@pytest.mark.mpi
def test_broadcast_parameters_of_a_channels_last_model():
    model = _conv(mpidp.rank())
    run_all(mpidp.broadcast_parameters, model.state_dict(), root_rank=0)
    want = _conv(0).state_dict()
    same = all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    still = model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert_all(same and still, f"rank 0's values {same}, still channels_last {still}")


@pytest.mark.mpi
def test_broadcast_optimizer_state_channels_last_on_the_root_only():
    """As when resuming: only the root has state, and its momentum is channels_last (the root
    alone refused it, and its peers waited for good)."""
    model = _conv(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if mpidp.rank() == 0:
        model(torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)).sum().backward()
        opt.step()
    run_all(mpidp.broadcast_optimizer_state, opt, root_rank=0)
    buf = opt.state[model[0].weight]["momentum_buffer"]
    sums = gather(float(buf.double().sum()))
    assert_all(all(s == sums[0] for s in sums), f"momentum sums {sums}")


@pytest.mark.mpi
def test_broadcast_optimizer_state_with_complex_state():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    opt = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.full((3,), 1.0 + 2.0j, dtype=torch.complex64) * (mpidp.rank() + 1)
    opt.step()
    run_all(mpidp.broadcast_optimizer_state, opt, root_rank=0)
    avg = opt.state[p]["exp_avg"]
    ok = avg.is_complex() and torch.allclose(avg, torch.full((3,), 0.1 + 0.2j,
                                                             dtype=torch.complex64))
    assert_all(ok, f"exp_avg {avg.tolist()}")
