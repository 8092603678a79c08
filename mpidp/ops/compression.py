"""Gradient compression: cast floating tensors to 16 bits for the wire and back afterwards."""

from typing import Optional

import torch

from ..engine.messages import ReduceOp


class Compressor:
    """Interface: `compress(t) -> (t', ctx)` before the collective, `decompress(t', ctx)` after."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor

    @classmethod
    def decompress_into(cls, tensor, ctx, out) -> None:
        """`out` <- decompress(tensor, ctx): where a reduced gradient goes back into `.grad`.
        A compressor without this method gets the same through decompress() and a copy."""
        out.copy_(cls.decompress(tensor, ctx))

    @classmethod
    def wire_dtype(cls, tensor) -> Optional[torch.dtype]:
        """The dtype the data path may cast `tensor` to on its way and back, in place of
        compress() and decompress() (ops.cast_allreduce_async_, which casts piece by piece
        while the other pieces travel); None where those two must run."""
        return None


class NoneCompressor(Compressor):
    """Sends tensors as they are."""


class _CastCompressor(Compressor):
    wire = torch.float16

    @classmethod
    def compress(cls, tensor):
        if tensor.is_floating_point() and tensor.dtype != cls.wire:
            return tensor.to(cls.wire), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)

    @classmethod
    def decompress_into(cls, tensor, ctx, out) -> None:
        # copy_ casts on the way: one pass over the gradient, where to() and a copy take two
        # and a temporary (ResNet-18's gradients: 3.6 against 7.2 ms).
        out.copy_(tensor)

    @classmethod
    def wire_dtype(cls, tensor) -> Optional[torch.dtype]:
        # The same cast as compress(), unless a subclass made compress or decompress its own.
        for name in ("compress", "decompress"):
            if next(k for k in cls.__mro__ if name in vars(k)) is not _CastCompressor:
                return None
        if tensor.is_floating_point() and tensor.dtype != cls.wire:
            return cls.wire
        return None


class FP16Compressor(_CastCompressor):
    """Floating tensors travel as float16 (half the bytes; range up to 65504)."""

    wire = torch.float16


class BF16Compressor(_CastCompressor):
    """Floating tensors travel as bfloat16 (float32's range, 8 bits of mantissa)."""

    wire = torch.bfloat16


class Compression:
    """Horovod's names: `Compression.none`, `Compression.fp16`, and mpidp's `Compression.bf16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def cast_wire(compression, tensors, op) -> Optional[torch.dtype]:
    """The dtype the data path may cast `tensors` to for the wire in place of `compression`'s
    compress and decompress (Compressor.wire_dtype): where it names one for all of them, dense
    and of one dtype, and `op` reduces values (not Adasum, which runs on the tensors' own
    values); else None. The caller makes them contiguous, or does not ask."""
    ask = getattr(compression, "wire_dtype", None)  # Horovod's compressors lack it
    if ask is None or op == ReduceOp.ADASUM or not tensors:
        return None
    first = tensors[0]
    if not isinstance(first, torch.Tensor) or first.layout is not torch.strided:
        return None
    wire = ask(first)
    if wire is None or not all(_dense_as(t, first.dtype) for t in tensors):
        return None
    return wire


def _dense_as(t, dtype) -> bool:
    return isinstance(t, torch.Tensor) and t.layout is torch.strided and t.dtype is dtype
