"""compression: none/fp16/bf16 casts round trip the dtype and leave integer tensors alone."""

import pytest
import torch

from mpidp.engine.messages import ReduceOp
from mpidp.ops.compression import (
    BF16Compressor,
    Compression,
    FP16Compressor,
    NoneCompressor,
    cast_wire,
)


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


@pytest.mark.parametrize("comp", [Compression.none, Compression.fp16, Compression.bf16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32])
def test_decompress_into_writes_what_decompress_returns(comp, dtype):
    t = (torch.linspace(-3, 3, 37) * 7).to(dtype)
    wire, ctx = comp.compress(t)
    out = torch.full_like(t, 99)
    comp.decompress_into(wire, ctx, out)
    assert out.dtype == dtype and torch.equal(out, comp.decompress(wire, ctx))


def test_gradients_come_back_through_decompress_where_a_compressor_has_no_decompress_into():
    """Horovod-style compressors (compress/decompress only) and mpidp's own put the same
    values into .grad, a complex gradient included."""
    from types import SimpleNamespace

    from mpidp.training import gradients

    class Plain:  # what a Horovod user's own compressor defines
        compress = staticmethod(FP16Compressor.compress)
        decompress = staticmethod(FP16Compressor.decompress)

    got = []
    for comp in (Plain, Compression.fp16):
        ps = [
            torch.nn.Parameter(torch.zeros(5)),
            torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64)),
        ]
        wires, ctxs = [], []
        for p, v in zip(ps, (torch.linspace(-2, 2, 5), torch.linspace(1, 6, 6).view(3, 2))):
            p.grad = torch.full_like(p, 7)
            wire, ctx = comp.compress(v)
            wires.append(wire)
            ctxs.append(ctx)
        bucket = SimpleNamespace(handle=None, dense=ps, wires=wires, ctxs=ctxs, sparse=[])
        gradients.collect(bucket, comp, SimpleNamespace(restore=lambda p: None))
        got.append([p.grad.clone() for p in ps])
    want = [torch.linspace(-2, 2, 5), torch.view_as_complex(torch.linspace(1, 6, 6).view(3, 2))]
    for grads in got:
        assert all(torch.equal(g, w) for g, w in zip(grads, want)), grads


class _OwnCompress(FP16Compressor):
    @classmethod
    def compress(cls, tensor):
        return tensor.to(torch.bfloat16), tensor.dtype


class _OwnDecompress(FP16Compressor):
    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx) * 2


class _Named(FP16Compressor):
    """A subclass that only renames: the same casts."""


@pytest.mark.parametrize(
    "comp, dtype, want",
    [
        (Compression.fp16, torch.float32, torch.float16),
        (Compression.fp16, torch.float64, torch.float16),
        (Compression.bf16, torch.float32, torch.bfloat16),
        (Compression.bf16, torch.float16, torch.bfloat16),
        (Compression.fp16, torch.float16, None),  # already the wire's dtype
        (Compression.fp16, torch.int32, None),  # compress leaves integers alone
        (Compression.none, torch.float32, None),
        (_Named, torch.float32, torch.float16),
        (_OwnCompress, torch.float32, None),  # its own compress must run
        (_OwnDecompress, torch.float32, None),  # its own decompress must run
    ],
)
def test_the_data_path_casts_only_what_the_built_in_casts_would(comp, dtype, want):
    """wire_dtype names the dtype compress() would cast to, for a compressor whose compress and
    decompress are the built-in casts; None where the compressor's own must run."""
    assert comp.wire_dtype(torch.zeros(3, dtype=dtype)) is want


class _Horovods:  # a compressor written for Horovod: compress and decompress, no wire_dtype
    compress = staticmethod(Compression.fp16.compress)
    decompress = staticmethod(Compression.fp16.decompress)


def test_a_list_is_cast_in_the_data_path_only_when_all_of_it_can_be():
    """cast_wire: one dense floating dtype, a reduction of values, a compressor that says so."""
    f32 = [torch.zeros(3), torch.zeros(2, 2)]
    assert cast_wire(Compression.fp16, f32, ReduceOp.SUM) is torch.float16
    assert cast_wire(Compression.bf16, f32, ReduceOp.AVERAGE) is torch.bfloat16
    assert cast_wire(Compression.fp16, f32, ReduceOp.ADASUM) is None
    assert cast_wire(Compression.fp16, f32 + [torch.zeros(2).double()], ReduceOp.SUM) is None
    assert cast_wire(Compression.fp16, [torch.zeros(2).to_sparse()], ReduceOp.SUM) is None
    assert cast_wire(Compression.fp16, [], ReduceOp.SUM) is None
    assert cast_wire(_Horovods, f32, ReduceOp.SUM) is None
    assert cast_wire(Compression.none, f32, ReduceOp.SUM) is None
