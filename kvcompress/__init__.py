"""kvcompress: bounded KV caches for long-context generation with Hugging Face transformers.

Every public name loads when first used: they import torch (the model integration transformers
too), which the command line must not pay to print its help or reject an argument.
"""

import sys
from importlib import import_module
from types import ModuleType

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
    "methods": "kvcompress.api",
    "relative_error": "kvcompress.attention",
    "stream": "kvcompress.api",
    "weighted_attention": "kvcompress.attention",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvcompress' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


class _Package(ModuleType):
    """This package's module type: `kvc.methods` stays the function `methods()`.

    Importing the subpackage `kvcompress.methods` sets the package attribute of that name to the
    subpackage; that one assignment is dropped (the subpackage stays importable by its full name).
    """

    def __setattr__(self, name, value):
        if name == "methods" and isinstance(value, ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
