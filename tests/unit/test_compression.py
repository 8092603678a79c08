"""compression: none/fp16/bf16 casts round trip the dtype and leave integer tensors alone."""

import pytest
import torch

from mpidp.ops.compression import BF16Compressor, Compression, FP16Compressor, NoneCompressor


def test_horovod_names():
    assert Compression.none is NoneCompressor
    assert Compression.fp16 is FP16Compressor
    assert Compression.bf16 is BF16Compressor


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.float16])
def test_none_is_identity(dtype):
    t = torch.arange(6).to(dtype)
    c, ctx = Compression.none.compress(t)
    assert c is t and ctx is None
    assert Compression.none.decompress(c, ctx) is t


@pytest.mark.parametrize(
    "comp, wire", [(Compression.fp16, torch.float16), (Compression.bf16, torch.bfloat16)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cast_round_trip_restores_dtype(comp, wire, dtype):
    t = torch.tensor([0.5, -2.0, 3.0, 100.0], dtype=dtype)
    c, ctx = comp.compress(t)
    assert c.dtype == wire
    assert ctx == dtype
    back = comp.decompress(c, ctx)
    assert back.dtype == dtype
    assert back.shape == t.shape
    assert torch.equal(back, t)  # these values are exact in both 16-bit formats


@pytest.mark.parametrize("comp", [Compression.fp16, Compression.bf16])
def test_round_trip_is_approximately_equal(comp):
    t = torch.linspace(-3, 3, 101, dtype=torch.float32)
    back = comp.decompress(*comp.compress(t))
    assert back.dtype == torch.float32
    assert torch.allclose(back, t, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("comp", [Compression.fp16, Compression.bf16])
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool])
def test_integer_tensors_untouched(comp, dtype):
    t = torch.ones(4, dtype=dtype)
    c, ctx = comp.compress(t)
    assert c is t and ctx is None
    assert comp.decompress(c, ctx) is t


@pytest.mark.parametrize(
    "comp, wire", [(Compression.fp16, torch.float16), (Compression.bf16, torch.bfloat16)]
)
def test_tensor_already_in_wire_dtype_untouched(comp, wire):
    t = torch.ones(4, dtype=wire)
    c, ctx = comp.compress(t)
    assert c is t and ctx is None
    assert comp.decompress(c, ctx) is t
