"""The combine step of 16-bit float reductions: float32 arithmetic, rounded once to 16 bits."""

import pytest
import torch

from mpidp.engine import half
from mpidp.engine.dtypes import HALF
from mpidp.engine.messages import ReduceOp

REFERENCE = {
    ReduceOp.SUM: torch.add,
    ReduceOp.AVERAGE: torch.add,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.PRODUCT: torch.mul,
}


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("op", list(REFERENCE), ids=lambda o: o.name)
def test_combine_is_float32_arithmetic_rounded_to_the_dtype(dtype, op):
    torch.manual_seed(int(op))
    a = (torch.randn(1001) * 100).to(dtype)
    b = (torch.randn(1001) * 100).to(dtype)
    want = REFERENCE[op](a.float(), b.float()).to(dtype)
    inbuf, inout = (
        bytearray(a.view(torch.int16).numpy().tobytes()),
        bytearray(b.view(torch.int16).numpy().tobytes()),
    )
    half.combiner(dtype, op)(inbuf, inout)
    got = torch.frombuffer(inout, dtype=dtype)
    assert torch.equal(got, want), (got - want).abs().max()
    assert torch.equal(torch.frombuffer(inbuf, dtype=dtype), a), "the input buffer was written"


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_combine_of_nothing_is_a_no_op(dtype):
    half.combiner(dtype, ReduceOp.SUM)(bytearray(), bytearray())
