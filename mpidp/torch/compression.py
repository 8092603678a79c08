"""Horovod's `horovod.torch.compression`: gradient compressors (code in ops/compression.py)."""

from ..ops.compression import (
    BF16Compressor,
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
)

__all__ = [
    "BF16Compressor",
    "Compression",
    "Compressor",
    "FP16Compressor",
    "NoneCompressor",
]
