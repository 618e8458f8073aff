"""Saved state by explicit schema: how a live stream's objects are written to a cache file and read back.

A class whose instances a saved cache can hold (a `Stream`, each method's stream state, the slot buffers and summaries
they keep) is registered with `saved` under a stable name and a version, and declares its fields once, in
`saved_fields`: a name and a `Spec` for each (a count, a number, a tensor of a given dtype and symbolic shape, another
registered instance, a list of them, ...). Writing (`encode`) stores exactly those fields; reading (`decode`) first
checks the whole description against the schema (`validate`: kinds, dtypes, shapes, counts, references), then
builds only registered classes, field by field, and lets each instance check what ties its fields together
(`check_saved`). Nothing is looked up by a path taken from a file, and a class's private attributes are not its
format: renaming one changes nothing on disk unless its declaration changes (then its version does).

An instance is written as {"class": name, "version": v, "id": k, "fields": {...}}; a generator or an instance held in
several places is written once and referred to ({"ref": k}) after that, so what the graph shares stays shared. A
`Linked` field (the cache's method, its rotary inverse) is not written: the reader hands it back from its links.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import stat
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch


def canonical_safetensors(data: bytes) -> bytes:
    """A safetensors file's bytes (`safetensors.torch.save`'s) with its metadata's keys in sorted order: safetensors keeps
    them in a hash map, whose order changes from call to call, so the same tensors and metadata gave different bytes
    (files that cannot be compared, checksummed or deduplicated by content). The tensors' entries and data are as
    given; the header stays padded to a multiple of 8 bytes, as safetensors writes it."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    if "__metadata__" in header:
        header = {"__metadata__": dict(sorted(header.pop("__metadata__").items()))} | header
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + size:]


def set_mode(path: str | os.PathLike, mode: int) -> None:
    """chmod `path` to `mode`, where its filesystem keeps permissions (some network or FUSE mounts refuse any: nothing
    to set there)."""
    try:
        os.chmod(path, mode)
    except PermissionError:
        pass


def write_whole(path: str | os.PathLike, data: bytes | str) -> None:
    """Write `data` (text as UTF-8) to `path` whole or not at all (a cache, scorer or calibration file, a table): into a
    new file beside it, then renamed over it, so that a failed write (a full disk, an interrupt) leaves what was there
    before. Its folder must exist. A file written over keeps its permissions (a private one stays private). A symbolic
    link is written through (its target is the file written); a path that is not a regular file (a device, a pipe) is
    refused, as renaming over it would replace it."""
    path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file() and not path.is_dir():
        raise ValueError(f"cannot write {str(path)!r}: it is not a regular file (a device, a pipe or a socket); name a file")
    if not path.parent.is_dir():
        what = "is not a folder" if path.parent.exists() else "does not exist"
        raise FileNotFoundError(f"cannot write {str(path)!r}: its folder {str(path.parent)!r} {what}")
    mode = stat.S_IMODE(path.stat().st_mode) if path.is_file() else None
    partial = path.parent / f".{path.name}-{secrets.token_hex(8)}"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask's permissions, as any file the user writes
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        if mode is not None:
            set_mode(partial, mode)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


class SchemaError(ValueError):
    """A description that does not match the schema; `path` names the field (e.g. "stream.state.slots.length")."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path


# name -> class of every registered saveable class
REGISTRY: dict[str, type] = {}

_DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool")}
_FLOATS = ("float32", "float16", "bfloat16", "float64")


def saved(name: str, version: int = 1):
    """Class decorator: register `cls` under `name` at `version`; `cls.saved_fields` ({field: Spec}) is its format."""

    def register(cls):
        if name in REGISTRY and REGISTRY[name] is not cls:
            raise ValueError(f"saved-state name {name!r} is taken by {REGISTRY[name].__qualname__}")
        if not isinstance(getattr(cls, "saved_fields", None), dict):
            raise TypeError(f"{cls.__qualname__} must declare saved_fields, a dict of field name -> Spec")
        cls.saved_name, cls.saved_version = name, version
        REGISTRY[name] = cls
        return cls

    return register


class Saveable:
    """Defaults for a registered class: the fields are attributes of the same names, set on a bare instance."""

    saved_fields: ClassVar[dict[str, "Spec"]] = {}
    saved_name: ClassVar[str] = ""
    saved_version: ClassVar[int] = 0

    def saved_values(self) -> dict[str, Any]:
        """The value of every declared field."""
        return {name: getattr(self, name) for name in self.saved_fields}

    @classmethod
    def from_saved(cls, values: dict[str, Any]):
        """An instance with these field values (already checked against `saved_fields`), built without `__init__`."""
        obj = cls.__new__(cls)
        obj.__dict__.update(values)
        return obj

    def check_saved(self) -> None:
        """ValueError naming what is wrong when the fields, each valid alone, do not fit together."""


@dataclass
class _Scope:
    """Symbolic dimensions bound while checking one instance's fields (`Tensor` shapes)."""

    dims: dict[str, int]


@dataclass
class Context:
    """What checking and building share: the file's tensors, the known dimensions, the links, the target device."""

    tensors: dict[str, torch.Tensor]
    dims: dict[str, int] = field(default_factory=dict)
    links: dict[str, Any] = field(default_factory=dict)
    device: torch.device = torch.device("cpu")
    shared: dict[int, tuple[str, Any]] = field(default_factory=dict)  # id -> (kind, class name or built object)


class Spec(ABC):
    """How one field is written (`encode`: the JSON value, its tensors handed to the writer), checked whole before
    anything is built (`check`: SchemaError naming the field) and read (`decode`)."""

    @abstractmethod
    def encode(self, x, out: "_Writer", path: str):
        """The JSON value of `x`."""

    @abstractmethod
    def check(self, v, ctx: Context, scope: _Scope, path: str) -> None:
        """SchemaError unless the JSON value `v` is one this spec writes."""

    def decode(self, v, ctx: Context):
        """The value `v` (checked) stands for."""
        return v


def is_count(v, minimum: int = 0) -> bool:
    """Whether `v` is an int (not a bool) of at least `minimum`, as a count read from JSON must be."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _expect(ok: bool, path: str, what: str, v) -> None:
    if not ok:
        shown = repr(v) if not isinstance(v, (dict, list)) or len(repr(v)) < 80 else f"a {type(v).__name__}"
        raise SchemaError(path, f"expected {what}, got {shown}")


@dataclass(frozen=True)
class Count(Spec):
    """An int of at least `minimum`."""

    minimum: int = 0

    def encode(self, x, out, path):
        self.check(x, None, None, path)
        return int(x)

    def check(self, v, ctx, scope, path):
        _expect(is_count(v, self.minimum), path, f"an int >= {self.minimum}", v)


@dataclass(frozen=True)
class Real(Spec):
    """A finite number (at least `minimum` when given)."""

    minimum: float | None = None

    def encode(self, x, out, path):
        self.check(x, None, None, path)
        return float(x)

    def check(self, v, ctx, scope, path):
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (self.minimum is None or v >= self.minimum)
        _expect(ok, path, "a finite number" + (f" >= {self.minimum}" if self.minimum is not None else ""), v)

    def decode(self, v, ctx):
        return float(v)


@dataclass(frozen=True)
class Flag(Spec):
    """A bool."""

    def encode(self, x, out, path):
        _expect(isinstance(x, bool), path, "a bool", x)
        return x

    def check(self, v, ctx, scope, path):
        _expect(isinstance(v, bool), path, "a bool", v)


@dataclass(frozen=True)
class Choice(Spec):
    """One of a few strings."""

    options: tuple[str, ...]

    def encode(self, x, out, path):
        self.check(x, None, None, path)
        return x

    def check(self, v, ctx, scope, path):
        _expect(isinstance(v, str) and v in self.options, path, f"one of {list(self.options)}", v)


@dataclass(frozen=True)
class DType(Spec):
    """A torch dtype, written by name."""

    def encode(self, x, out, path):
        name = str(x).removeprefix("torch.")
        _expect(name in _DTYPES, path, f"a dtype among {sorted(_DTYPES)}", x)
        return name

    def check(self, v, ctx, scope, path):
        _expect(isinstance(v, str) and v in _DTYPES, path, f"a dtype among {sorted(_DTYPES)}", v)

    def decode(self, v, ctx):
        return _DTYPES[v]


@dataclass(frozen=True)
class Device(Spec):
    """The device the state lives on: not written; read back as the device the cache is loaded to."""

    def encode(self, x, out, path):
        _expect(isinstance(x, torch.device), path, "a torch.device", x)
        return None

    def check(self, v, ctx, scope, path):
        _expect(v is None, path, "null (a device is not saved)", v)

    def decode(self, v, ctx):
        return ctx.device


@dataclass(frozen=True)
class Linked(Spec):
    """An object of the cache itself (its method, a part of it, its rotary inverse), one of the links `names`: written
    as the link's name, handed back by the reader's links."""

    names: tuple[str, ...]

    def __init__(self, *names: str):
        object.__setattr__(self, "names", names)

    def encode(self, x, out, path):
        name = next((n for n in self.names if n in out.links and out.links[n] is x), None)
        _expect(name is not None, path, f"one of the cache's own {list(self.names)}", type(x).__name__)
        return name

    def check(self, v, ctx, scope, path):
        _expect(v in self.names and v in ctx.links, path, f"one of {list(self.names)}", v)

    def decode(self, v, ctx):
        return ctx.links[v]


@dataclass(frozen=True)
class Tensor(Spec):
    """A tensor of one of `dtypes` ("float": any floating dtype) whose shape is `shape`: space-separated dimensions,
    each an int, "*" (any), a symbol bound once per instance, or a last "..." (any further dimensions) (and by the reader for B, H and D: the batch, the
    model's KV heads and head dimension). Written as the name of a tensor of the file."""

    shape: str
    dtypes: tuple[str, ...] = ("float",)

    def allowed(self) -> set[str]:
        return {d for name in self.dtypes for d in (_FLOATS if name == "float" else (name,))}

    def encode(self, x, out, path):
        _expect(isinstance(x, torch.Tensor), path, "a tensor", type(x).__name__)
        return out.tensor(x)

    def check(self, v, ctx, scope, path):
        _expect(isinstance(v, str) and v in ctx.tensors, path, "the name of a tensor of the file", v)
        t = ctx.tensors[v]
        dtype = str(t.dtype).removeprefix("torch.")
        _expect(dtype in self.allowed(), path, f"a tensor of dtype {' or '.join(sorted(self.allowed()))}", f"{dtype} tensor {v!r}")
        dims = self.shape.split()
        if dims and dims[-1] == "...":  # any number of further dimensions
            dims = dims[:-1]
            _expect(t.ndim >= len(dims), path, f"a tensor of shape [{self.shape}]", f"shape {list(t.shape)} ({v!r})")
        else:
            _expect(t.ndim == len(dims), path, f"a tensor of shape [{self.shape}]", f"shape {list(t.shape)} ({v!r})")
        for dim, size in zip(dims, t.shape):
            if dim == "*":
                continue
            if dim.isdigit():
                _expect(size == int(dim), path, f"a tensor of shape [{self.shape}]", f"shape {list(t.shape)} ({v!r})")
                continue
            known = ctx.dims.get(dim, scope.dims.get(dim))
            if known is None:
                scope.dims[dim] = size
            _expect(known is None or known == size, path, f"a tensor of shape [{self.shape}] with {dim} = {known}", f"shape {list(t.shape)} ({v!r})")

    def decode(self, v, ctx):
        return ctx.tensors[v].to(ctx.device)


@dataclass(frozen=True)
class Maybe(Spec):
    """None, or a value of `inner`."""

    inner: Spec

    def encode(self, x, out, path):
        return None if x is None else self.inner.encode(x, out, path)

    def check(self, v, ctx, scope, path):
        if v is not None:
            self.inner.check(v, ctx, scope, path)

    def decode(self, v, ctx):
        return None if v is None else self.inner.decode(v, ctx)


@dataclass(frozen=True)
class Sequence(Spec):
    """A list (or, with kind="tuple", a tuple) of values of `item`; with `size`, of exactly that many."""

    item: Spec
    kind: str = "list"
    size: int | None = None

    def encode(self, x, out, path):
        _expect(isinstance(x, (list, tuple)), path, f"a {self.kind}", type(x).__name__)
        return [self.item.encode(v, out, f"{path}[{i}]") for i, v in enumerate(x)]

    def check(self, v, ctx, scope, path):
        _expect(isinstance(v, list) and (self.size is None or len(v) == self.size), path,
                "a list" + (f" of {self.size}" if self.size is not None else ""), v)
        for i, item in enumerate(v):
            self.item.check(item, ctx, scope, f"{path}[{i}]")

    def decode(self, v, ctx):
        items = [self.item.decode(item, ctx) for item in v]
        return items if self.kind == "list" else tuple(items) if self.kind == "tuple" else torch.Size(items)


@dataclass(frozen=True)
class Record(Spec):
    """A tuple of fixed length whose items have their own specs."""

    items: tuple[Spec, ...]

    def encode(self, x, out, path):
        _expect(isinstance(x, tuple) and len(x) == len(self.items), path, f"a tuple of {len(self.items)}", x)
        return [spec.encode(v, out, f"{path}[{i}]") for i, (spec, v) in enumerate(zip(self.items, x))]

    def check(self, v, ctx, scope, path):
        _expect(isinstance(v, list) and len(v) == len(self.items), path, f"a list of {len(self.items)}", v)
        for i, (spec, item) in enumerate(zip(self.items, v)):
            spec.check(item, ctx, scope, f"{path}[{i}]")

    def decode(self, v, ctx):
        return tuple(spec.decode(item, ctx) for spec, item in zip(self.items, v))


@dataclass(frozen=True)
class Mapping(Spec):
    """A dict from `key` values to `value` values, written as a list of [key, value] pairs."""

    key: Spec
    value: Spec

    def encode(self, x, out, path):
        _expect(isinstance(x, dict), path, "a dict", type(x).__name__)
        return [[self.key.encode(k, out, f"{path}.key"), self.value.encode(v, out, f"{path}[{k!r}]")] for k, v in x.items()]

    def check(self, v, ctx, scope, path):
        _expect(isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v), path, "a list of [key, value] pairs", v)
        keys = []
        for k, item in v:
            self.key.check(k, ctx, scope, f"{path}.key")
            self.value.check(item, ctx, scope, f"{path}[{k!r}]")
            keys.append(repr(k))
        _expect(len(set(keys)) == len(keys), path, "distinct keys", v)

    def decode(self, v, ctx):
        return {self.key.decode(k, ctx): self.value.decode(item, ctx) for k, item in v}


@dataclass(frozen=True)
class Generator(Spec):
    """A torch.Generator, written as its state (shared generators stay shared)."""

    def encode(self, x, out, path):
        _expect(isinstance(x, torch.Generator), path, "a torch.Generator", type(x).__name__)
        ref = out.ref(x)
        if ref is not None:
            return {"ref": ref}
        return {"generator": out.tensor(x.get_state()), "cpu": x.device.type == "cpu", "id": out.number(x)}

    def check(self, v, ctx, scope, path):
        _expect(isinstance(v, dict), path, "a generator", v)
        if set(v) == {"ref"}:
            _expect(ctx.shared.get(v["ref"], ("",))[0] == "generator", path, "a reference to a generator written before", v)
            return
        _expect(set(v) == {"generator", "cpu", "id"}, path, "a generator {generator, cpu, id}", v)
        _expect(isinstance(v["cpu"], bool), f"{path}.cpu", "a bool", v["cpu"])
        _expect(is_count(v["id"]) and v["id"] not in ctx.shared, f"{path}.id", "a new id", v["id"])
        Tensor("*", ("uint8",)).check(v["generator"], ctx, scope, f"{path}.generator")
        ctx.shared[v["id"]] = ("generator", None)

    def decode(self, v, ctx):
        if "ref" in v:
            return ctx.shared[v["ref"]][1]
        generator = torch.Generator(device="cpu" if v["cpu"] else ctx.device)
        try:
            generator.set_state(ctx.tensors[v["generator"]])
        except RuntimeError as err:
            raise SchemaError("generator", f"not a generator state ({err})") from None
        ctx.shared[v["id"]] = ("generator", generator)
        return generator


@dataclass(frozen=True)
class Instance(Spec):
    """An instance of a registered class: one named in `kinds`, or of a class in `kinds` (any registered subclass).
    Written once, then referred to."""

    kinds: tuple[str | type, ...]

    def __init__(self, *kinds: str | type):
        object.__setattr__(self, "kinds", kinds)

    @property
    def names(self) -> list[str]:
        return sorted(name for name, cls in REGISTRY.items()
                      if any(kind == name if isinstance(kind, str) else issubclass(cls, kind) for kind in self.kinds))

    def encode(self, x, out, path):
        name = getattr(type(x), "saved_name", None)
        _expect(name in self.names and REGISTRY.get(name) is type(x), path, f"an instance of {self.names}", type(x).__name__)
        ref = out.ref(x)
        if ref is not None:
            return {"ref": ref}
        number = out.number(x)
        values = x.saved_values()
        return {"class": name, "version": type(x).saved_version, "id": number,
                "fields": {f: spec.encode(values[f], out, f"{path}.{f}") for f, spec in type(x).saved_fields.items()}}

    def check(self, v, ctx, scope, path):
        _expect(isinstance(v, dict), path, f"an instance of {self.names}", v)
        if set(v) == {"ref"}:
            kind, name = ctx.shared.get(v["ref"], ("", None)) if isinstance(v["ref"], int) else ("", None)
            _expect(kind == "instance" and name in self.names, path, f"a reference to an instance of {self.names} written before", v)
            return
        _expect(set(v) == {"class", "version", "id", "fields"}, path, "an instance {class, version, id, fields}", v)
        name = v["class"]
        _expect(isinstance(name, str) and name in self.names, f"{path}.class", f"one of {self.names}", name)
        cls = REGISTRY[name]
        _expect(v["version"] == cls.saved_version, f"{path}.version",
                f"version {cls.saved_version} of {name} (the file was written by another kvcompress: compress the context again)", v["version"])
        _expect(is_count(v["id"]) and v["id"] not in ctx.shared, f"{path}.id", "a new id", v["id"])
        ctx.shared[v["id"]] = ("instance", name)
        fields = v["fields"]
        _expect(isinstance(fields, dict), f"{path}.fields", "an object", fields)
        missing, extra = set(cls.saved_fields) - set(fields), set(fields) - set(cls.saved_fields)
        _expect(not missing and not extra, f"{path}.fields", f"the fields of {name} {sorted(cls.saved_fields)}",
                f"missing {sorted(missing)}, unknown {sorted(extra)}")
        own = _Scope({})
        for f, spec in cls.saved_fields.items():
            spec.check(fields[f], ctx, own, f"{path}.{f}")

    def decode(self, v, ctx):
        if "ref" in v:
            return ctx.shared[v["ref"]][1]
        cls = REGISTRY[v["class"]]
        values = {f: spec.decode(v["fields"][f], ctx) for f, spec in cls.saved_fields.items()}
        obj = cls.from_saved(values)
        ctx.shared[v["id"]] = ("instance", obj)
        return obj


class _Writer:
    """Collects the tensors of what is encoded (each stored once) and numbers what is shared."""

    def __init__(self, prefix: str, links: dict):
        self.prefix, self.links = prefix, links
        self.tensors: dict[str, torch.Tensor] = {}
        self._names: dict[int, str] = {}
        self._numbers: dict[int, int] = {}
        self._keep: list = []  # what is numbered, alive until the encoding ends (ids are only unique among live objects)

    def tensor(self, t: torch.Tensor) -> str:
        if id(t) not in self._names:
            self._names[id(t)] = f"{self.prefix}.{len(self._names)}"
            self.tensors[self._names[id(t)]] = t
            self._keep.append(t)
        return self._names[id(t)]

    def ref(self, x) -> int | None:
        return self._numbers.get(id(x))

    def number(self, x) -> int:
        self._numbers[id(x)] = len(self._keep)
        self._keep.append(x)
        return self._numbers[id(x)]


def encode(spec: Spec, obj, prefix: str, links: dict) -> tuple[dict[str, torch.Tensor], Any]:
    """(tensors named under `prefix`, JSON description) of `obj` written as `spec` says. links: the objects of the cache
    itself that `Linked` fields name (written by name, not stored)."""
    out = _Writer(prefix, links)
    return out.tensors, spec.encode(obj, out, prefix)


def decode(spec: Spec, description, tensors: dict[str, torch.Tensor], *, dims: dict[str, int], links: dict, device, path: str):
    """The object `encode` described: the whole description checked against `spec` first (SchemaError naming the field),
    then built, its tensors moved to `device`; then every instance's `check_saved` (SchemaError naming the instance)."""
    check = Context(tensors, dims, links, torch.device(device))
    spec.check(description, check, _Scope({}), path)
    ctx = Context(tensors, dims, links, torch.empty(0, device=device).device)
    try:
        built = spec.decode(description, ctx)
    except _BUILD_ERRORS as err:  # a constructor's own check (e.g. KVSummary's shapes)
        raise SchemaError(path, str(err)) from None
    # an instance is numbered before what it holds: checked in reverse, what it holds is checked before it
    for number, (kind, obj) in sorted(ctx.shared.items(), reverse=True):
        if kind == "instance":
            try:
                obj.check_saved()
            except _BUILD_ERRORS as err:
                raise SchemaError(f"{path} ({type(obj).saved_name} #{number})", str(err)) from None
    return built


_BUILD_ERRORS = (ValueError, RuntimeError, IndexError, TypeError, OverflowError)
