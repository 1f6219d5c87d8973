"""Gradient compression, as `horovod.torch.compression`: fp16 casts floating-point tensors to float16 for the
reduction and back to their dtype afterwards (the precision loss is real, so it is kept)."""

import torch


class Compressor:
    """Interface for compressing and decompressing a given tensor."""

    @staticmethod
    def compress(tensor):
        """Compresses a tensor and returns it with the context needed to decompress it."""

    @staticmethod
    def decompress(tensor, ctx):
        """Decompress the tensor with the given context."""


class NoneCompressor(Compressor):
    """Default no-op compression."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Compress all floating point gradients to 16-bit."""

    @staticmethod
    def compress(tensor):
        compressed = tensor
        if tensor.dtype.is_floating_point:
            compressed = tensor.type(torch.float16)
        return compressed, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        if ctx.is_floating_point:
            return tensor.type(ctx)
        return tensor


class Compression:
    """Optional gradient compression algorithm used during allreduce."""

    none = NoneCompressor
    fp16 = FP16Compressor
