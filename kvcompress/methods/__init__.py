"""One module per method; each registers itself by name. Importing this package imports them all.

The package is callable: `kvc.methods()` (this package, `kvcompress.methods`) lists the registered methods' names, and
its modules import by their full names (`import kvcompress.methods.budget`).
"""

import importlib
import pkgutil
import sys
from types import ModuleType

from .base import Method, ScoreMethod, StreamState, keep_top
from .registry import get_method_class, method_names, register
from .tokens import Tokens, attention_mass

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_") and _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")



class _MethodsPackage(ModuleType):
    """This package's module type: calling it lists the registered methods."""

    def __call__(self) -> list[str]:
        """Names of all registered methods."""
        return method_names()


sys.modules[__name__].__class__ = _MethodsPackage

__all__ = ["Method", "attention_mass", "ScoreMethod", "StreamState", "Tokens", "get_method_class", "keep_top", "method_names", "register"]
