"""kvcompress: bounded KV caches for long-context generation with Hugging Face transformers.

Every public name loads when first used: they import torch (the model integration transformers
too), which the command line must not pay to print its help or reject an argument.
"""

from importlib import import_module

_EXPORTS = {
    "CompressedCache": "kvcompress.integration",
    "CompressionOptions": "kvcompress.options",
    "KVSummary": "kvcompress.summary",
    "Normalizer": "kvcompress.summary",
    "calibrate": "kvcompress.integration",
    "compress": "kvcompress.api",
    "compress_context": "kvcompress.integration",
    "exact_attention": "kvcompress.attention",
    "generate": "kvcompress.integration",
    "load_cache": "kvcompress.integration",
    "load_model": "kvcompress.integration",
    "relative_error": "kvcompress.attention",
    "stream": "kvcompress.api",
    "weighted_attention": "kvcompress.attention",
}

__all__ = sorted([*_EXPORTS, "methods"])


def __getattr__(name):
    if name == "__version__":  # the installed distribution's (pyproject.toml's when installed from this tree)
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("kvcompress")
        except PackageNotFoundError:
            raise AttributeError("kvcompress has no __version__: it is imported from a source tree that is not installed "
                                 "(pip install -e . records it)") from None
    if name == "methods":  # the subpackage, which is callable: `kvc.methods()` lists the registered methods
        return import_module("kvcompress.methods")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvcompress' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
