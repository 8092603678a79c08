"""DistributedOptimizer follows parameters added (add_param_group) or (un)frozen between steps."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mpi_util import assert_all, gather, max_deviation, my_rows, raises_all, row_batches, run_all

import mpidp

ROWS = 3  # rows per rank


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)
    ).double()


def _batches(steps):
    return row_batches(steps, ROWS, seed=2)


def _mine(t):
    return my_rows(t, ROWS)


_deviation = max_deviation


def _step(model, opt, x, y, distributed):
    opt.zero_grad()
    if distributed:
        F.cross_entropy(model(_mine(x)), _mine(y)).backward()
        run_all(opt.step)
    else:
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _same_everywhere(model):
    mine = [p.detach().clone() for p in model.parameters()]
    every = gather(mine)
    return all(torch.equal(a, b) for other in every for a, b in zip(mine, other))


def _set_trainable(params, flag):
    for p in params:
        p.requires_grad_(flag)


@pytest.mark.mpi
@pytest.mark.parametrize("overlapping", [True, False], ids=["overlapped", "at_step"])
@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_add_param_group_reduces_the_new_parameters(named, overlapping):
    """Progressive unfreezing as fine-tuning scripts do it (Lightning's BaseFinetuning too): the
    head trains first; then the backbone is unfrozen and added as a group with its own lr.
    Every step equals one process on the whole batch (Horovod never averages such a group)."""
    model = _model()
    ref = copy.deepcopy(model)
    backbone = lambda m: list(m[0].parameters()) + list(m[2].parameters())  # noqa: E731
    for m in (model, ref):
        _set_trainable(backbone(m), False)
    opt = mpidp.DistributedOptimizer(
        torch.optim.SGD(model[4].parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters() if named else None,
    )
    opt._overlap = overlapping
    ref_opt = torch.optim.SGD(ref[4].parameters(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(_batches(5)):
        if i == 2:
            for m, o in ((model, opt), (ref, ref_opt)):
                _set_trainable(backbone(m), True)
                o.add_param_group({"params": backbone(m), "lr": 0.05})
        _step(model, opt, x, y, True)
        _step(ref, ref_opt, x, y, False)
    err = _deviation(model, ref)
    groups = [len(g["params"]) for g in opt.param_groups]
    assert_all(err < 1e-10 and groups == [2, 4], f"deviation {err}, groups {groups}")
    assert_all(_same_everywhere(model), "replicas differ")


@pytest.mark.mpi
@pytest.mark.parametrize("overlapping", [True, False], ids=["overlapped", "at_step"])
def test_freezing_and_unfreezing_between_steps_is_followed(overlapping):
    """An optimizer over the whole model, part of it frozen at wrapping: unfrozen later, its
    gradients are averaged; frozen again, it gets no gradient (not zeros, which weight decay
    would move) and stays where it is. Each phase equals one process."""
    model = _model()
    ref = copy.deepcopy(model)
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.1)  # noqa: E731
    for m in (model, ref):
        _set_trainable(m[0].parameters(), False)
    opt = mpidp.DistributedOptimizer(make(model), named_parameters=model.named_parameters())
    opt._overlap = overlapping
    ref_opt = make(ref)
    for i, (x, y) in enumerate(_batches(7)):
        if i in (2, 4):
            for m in (model, ref):
                _set_trainable(m[0].parameters(), i == 2)  # unfreeze at 2, freeze at 4
        if i == 4:
            frozen = [p.detach().clone() for p in model[0].parameters()]
        _step(model, opt, x, y, True)
        _step(ref, ref_opt, x, y, False)
    err = _deviation(model, ref)
    kept = all(torch.equal(a, b) for a, b in zip(frozen, model[0].parameters()))
    no_grad = all(p.grad is None for p in model[0].parameters())
    assert_all(
        err < 1e-10 and kept and no_grad,
        f"deviation {err}, frozen kept {kept}, no gradient {no_grad}",
    )
    assert_all(_same_everywhere(model), "replicas differ")


@pytest.mark.mpi
def test_add_param_group_refusals_and_parameters_named_by_position():
    """A group of parameters that named_parameters did not name (a module added after
    wrapping) is named by position, as Horovod names them all; adding one during a step, or a
    parameter twice (torch's own check), is refused and leaves the optimizer as it was."""
    model, ref = _model(), _model()
    opt = mpidp.DistributedOptimizer(
        torch.optim.SGD(model[4].parameters(), lr=0.1),
        named_parameters=list(model[4].named_parameters()),
    )
    ref_opt = torch.optim.SGD(ref[4].parameters(), lr=0.1)
    x, y = _batches(1)[0]
    F.cross_entropy(model(_mine(x)), _mine(y)).backward()
    raises_all(
        ValueError,
        lambda: opt.add_param_group({"params": model[2].parameters()}),
        match="between steps",
    )
    run_all(opt.step)
    raises_all(
        ValueError,
        lambda: opt.add_param_group({"params": model[4].weight}),
        match="more than one parameter group",
    )
    groups = [len(g["params"]) for g in opt.param_groups]
    assert_all(groups == [2], f"groups {groups}")
    ref_opt.zero_grad()
    F.cross_entropy(ref(x), y).backward()
    ref_opt.step()
    for m, o in ((model, opt), (ref, ref_opt)):
        o.add_param_group({"params": list(m[0].parameters()), "lr": 0.2})
    for x, y in _batches(3):
        _step(model, opt, x, y, True)
        _step(ref, ref_opt, x, y, False)
    names = sorted(opt._parameter_names.values())
    want = ["allreduce.noname.1.0", "allreduce.noname.1.1", "bias", "weight"]
    err = _deviation(model, ref)
    assert_all(err < 1e-10 and names == want, f"deviation {err}, names {names}")


@pytest.mark.mpi
def test_sharded_optimizer_refuses_layout_changes_clearly():
    model = _model()
    _set_trainable(model[0].parameters(), False)
    opt = mpidp.ShardedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    raises_all(
        ValueError,
        lambda: opt.add_param_group(
            {"params": [nn.Parameter(torch.zeros(2, dtype=torch.float64))]}
        ),
        match="before wrapping",
    )
    _set_trainable(model[0].parameters(), True)
    x, y = _batches(1)[0]

    def train():
        opt.zero_grad()
        F.cross_entropy(model(_mine(x)), _mine(y)).backward()
        opt.step()

    err = raises_all(RuntimeError, train, match="changed requires_grad after wrapping")
    assert_all("'0.weight'" in str(err), f"message {err}")
