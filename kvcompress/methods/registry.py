"""The method registry: every method is registered under its name, with its own sink and window defaults."""

from __future__ import annotations

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
    """Instantiate a registered method from its parameters as plain values (`Method.from_params`: unknown ones are
    refused by name; a parameter that is itself a method, AdaKV's scorer, is given by its registered name)."""
    return get_method_class(name).from_params(params)


def default_sink_window(method: str, sink: int | None, window: int | None) -> tuple[int, int]:
    """(sink, window): the given ones, the method's own defaults (`default_sink`, `default_window`) where None."""
    cls = get_method_class(method)
    return (cls.default_sink if sink is None else sink, cls.default_window if window is None else window)
