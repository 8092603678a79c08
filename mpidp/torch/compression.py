"""Horovod's `horovod.torch.compression`: gradient compressors (code in mpidp/compression.py)."""

from mpidp.compression import (BF16Compressor, Compression, Compressor,  # noqa: F401
                               FP16Compressor, NoneCompressor)
