"""allgather and reducescatter into a caller's output tensor (ops.*_into_async, the sharded
optimizer's path): results, the in-place allgather, process sets, refused outputs."""

import pytest
import torch
from mpi_util import assert_all, raises_all, rank, size, tensor_diff

import mpidp
from mpidp import ops


def _block(r: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(6, dtype=torch.float64).reshape(3, 2) + 10 * r).to(dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.float16])
def test_allgather_into_in_place_and_apart(dtype):
    expect = torch.cat([_block(r, dtype) for r in range(size())])
    home = torch.zeros(3 * size(), 2, dtype=dtype)
    mine = home[3 * rank() : 3 * rank() + 3]
    mine.copy_(_block(rank(), dtype))
    got = ops.synchronize(ops.allgather_into_async(mine, home, name="into.inplace"))
    apart = torch.full((3 * size(), 2), -1, dtype=dtype)
    got2 = ops.synchronize(ops.allgather_into_async(_block(rank(), dtype), apart))
    assert_all(
        got is home and got2 is apart, "synchronize() should return the given output tensors"
    )
    problems = [d for d in (tensor_diff(home, expect), tensor_diff(apart, expect)) if d]
    assert_all(not problems, "; ".join(problems))


@pytest.mark.mpi
@pytest.mark.parametrize("op", [mpidp.Average, mpidp.Sum], ids=["average", "sum"])
def test_reducescatter_into_equals_reducescatter(op):
    rows = 2 * size() + 1  # uneven: the first rows % size ranks get one row more
    t = torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) * (rank() + 1)
    mine = rows // size() + (rank() < rows % size())
    out = torch.full((mine, 2), 7.0, dtype=torch.float64)
    got = ops.synchronize(ops.reducescatter_into_async(t, out, name="into.rs", op=op))
    fresh = ops.synchronize(ops.reducescatter_async(t, op=op))
    diff = tensor_diff(out, fresh)
    assert_all(got is out and not diff, f"into the output: {diff}")


@pytest.mark.mpi
def test_into_a_process_set():
    if size() < 3:
        pytest.skip("needs a set that is not the whole world: three ranks")
    members = list(range(1, size()))
    ps = mpidp.add_process_set(members)
    try:
        ok = True
        if rank() in members:
            at = members.index(rank())
            home = torch.zeros(3 * len(members), 2)
            home[3 * at : 3 * at + 3] = _block(rank())
            ops.synchronize(
                ops.allgather_into_async(home[3 * at : 3 * at + 3], home, process_set=ps)
            )
            ok = torch.equal(home, torch.cat([_block(r) for r in members]))
        assert_all(ok, f"allgather into an output over the set {members}")
    finally:
        mpidp.remove_process_set(ps)


@pytest.mark.mpi
def test_bad_outputs_are_refused_on_the_rank_that_gives_them():
    t = _block(rank())
    raises_all(
        ValueError, ops.allgather_into_async, t, torch.zeros(3 * size() + 1, 2), match="shape"
    )
    raises_all(
        ValueError,
        ops.allgather_into_async,
        t,
        torch.zeros(3 * size(), 2, dtype=torch.float64),
        match="float32",
    )
    raises_all(TypeError, ops.allgather_into_async, t, [0.0] * 6, match="torch.Tensor")
    if size() > 1:
        out = torch.zeros(3 * size(), 2)
        start = 6 * rank() + (1 if rank() == 0 else -1)  # half a row off this rank's block
        shifted = out.view(-1)[start : start + 6].view(3, 2)
        raises_all(ValueError, ops.allgather_into_async, shifted, out, match="overlaps")
        wrong_block = out[3 * ((rank() + 1) % size()) :][:3]
        raises_all(ValueError, ops.allgather_into_async, wrong_block, out, match="overlaps")
    rows = 2 * size()
    src = torch.zeros(rows, 2)
    raises_all(ValueError, ops.reducescatter_into_async, src, src[:2], match="overlaps")
    raises_all(ValueError, ops.reducescatter_into_async, src, torch.zeros(3, 2), match="shape")
    # Nothing was left in flight: a collective afterwards works on every rank.
    total = ops.synchronize(ops.allreduce_async(torch.ones(1), op=mpidp.Sum))
    assert_all(total.item() == size(), f"{total}")
