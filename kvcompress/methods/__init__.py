"""One module per method; each registers itself by name. Importing this package imports them all."""

import importlib
import pkgutil

from .base import Method, ScoreMethod, StreamState, keep_top
from .registry import get_method_class, method_names, register
from .tokens import Tokens, attention_mass

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_") and _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Method", "attention_mass", "ScoreMethod", "StreamState", "Tokens", "get_method_class", "keep_top", "method_names", "register"]
