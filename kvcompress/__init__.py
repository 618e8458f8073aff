"""kvcompress: bounded KV caches for long-context generation with Hugging Face transformers."""

from .api import compress, methods, stream
from .attention import exact_attention, relative_error, weighted_attention
from .options import CompressionOptions
from .summary import KVSummary, Normalizer

__all__ = [
    "CompressedCache",
    "CompressionOptions",
    "KVSummary",
    "Normalizer",
    "calibrate",
    "compress",
    "exact_attention",
    "generate",
    "load_model",
    "methods",
    "relative_error",
    "stream",
    "weighted_attention",
]


def __getattr__(name):
    # The model integration imports transformers; load it only when asked for.
    if name in ("CompressedCache", "calibrate", "generate", "load_model"):
        from . import integration

        return getattr(integration, name)
    raise AttributeError(f"module 'kvcompress' has no attribute {name!r}")
