"""broadcast_parameters / broadcast_optimizer_state on channels_last and complex tensors."""

import pytest
import torch
import torch.nn as nn
from mpi_util import assert_all, gather, raises_all, run_all

import mpidp


def _conv(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).to(
        memory_format=torch.channels_last
    )


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
    ok = avg.is_complex() and torch.allclose(
        avg, torch.full((3,), 0.1 + 0.2j, dtype=torch.complex64)
    )
    assert_all(ok, f"exp_avg {avg.tolist()}")


def _make_local_class():
    class Local:  # defined in a function: plain pickle refuses it
        x = 7

    return Local


@pytest.mark.mpi
def test_objects_are_pickled_as_horovod_does_lambdas_and_local_classes():
    r = mpidp.rank()
    got = run_all(
        mpidp.broadcast_object,
        {"fn": lambda v: v + 1, "cls": _make_local_class()} if r == 0 else None,
        0,
    )
    every = run_all(mpidp.allgather_object, lambda: r)
    ok = (
        got["fn"](1) == 2
        and got["cls"].x == 7
        and [f() for f in every] == list(range(mpidp.size()))
    )
    assert_all(ok, f"{got}, {every}")


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("not today")


@pytest.mark.mpi
def test_an_object_one_rank_cannot_pickle_fails_every_rank_and_the_next_collective_works():
    """The error was raised on that rank alone, and its peers waited in the collective for
    good (a script catching it hung)."""
    n, last = mpidp.size(), mpidp.size() - 1
    obj = _Unpicklable() if mpidp.rank() == last else 1
    err = raises_all(mpidp.MpidpError, mpidp.allgather_object, obj, match="could not pickle")
    assert_all(f"[{last}]" in str(err) and "not today" in str(err), str(err))
    raises_all(mpidp.MpidpError, mpidp.broadcast_object, obj, last, match="not today")
    ok = run_all(mpidp.allgather_object, mpidp.rank()) == list(range(n))
    assert_all(ok, "the next collective failed")
