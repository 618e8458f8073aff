"""The method registry: every method is registered under its name, with its paper's sink and window defaults."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Method


_REGISTRY: dict[str, type["Method"]] = {}


def register(cls: type["Method"]) -> type["Method"]:
    """Class decorator: make a method available by its `name`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a `name`")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"method name {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def method_names() -> list[str]:
    return sorted(_REGISTRY)


def get_method_class(name: str) -> type["Method"]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(method_names())}")
    return _REGISTRY[name]


def build_method(name: str, **params) -> "Method":
    """Instantiate a registered method with its parameters, rejecting unknown ones by name."""
    cls = get_method_class(name)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"method {name!r} has no parameter(s) {unknown}; its parameters are {sorted(known)}")
    for f in fields(cls):
        if f.type in ("bool", bool) and f.name in params and not isinstance(params[f.name], bool):
            raise ValueError(
                f"method {name!r} parameter {f.name} must be True or False (on the command line: true or false), got {params[f.name]!r}"
            )
    return cls(**params)


def default_sink_window(method: str, sink: int | None, window: int | None) -> tuple[int, int]:
    """(sink, window): the given ones, the method's paper defaults where None."""
    cls = get_method_class(method)
    return (cls.default_sink if sink is None else sink, cls.default_window if window is None else window)
