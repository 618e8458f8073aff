"""The saved-cache file: one safetensors file, its metadata, its checksum, and the model it belongs to.

docs/design.md, "Saved caches". A file holds named tensors (every layer's state, the token ids)
and, in the safetensors metadata, the format name and version, a SHA-256 of the metadata and of
every tensor (name, dtype, shape and bytes), and a JSON document: the compression settings, each
layer's description, and the fingerprint of the model the cache was made with (`model_fingerprint`).
`read` refuses a file that is not complete, not a kvcompress cache, of another format version, or
whose contents do not match its checksum; `check_model` refuses a model other than the one saved.
Summaries travel as plain tensors (`summary_tensors` / `summary_from`), positions as int32; a ragged
summary (`RaggedSummary`) as its packed tensors and per-head counts.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import tempfile
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from .integration.support import check_supported
from .quantization import QuantizedSummary, QuantizedTensor
from .ragged import RaggedSummary
from .summary import KVSummary, Normalizer

FORMAT = "kvcompress-cache"
VERSION = 1
# Weights are compared at this relative tolerance (and 1e-6 absolute), so one checkpoint in float32,
# bfloat16 or float16 is the same model; a different checkpoint differs far beyond it.
WEIGHT_RTOL = 2.0**-7
SAMPLES_PER_PARAMETER = 4


class CacheFileError(ValueError):
    """A saved cache that cannot be used: unreadable, foreign, of another version, corrupted, or from another model."""


def write(path: str | os.PathLike, tensors: dict[str, torch.Tensor], document: dict) -> None:
    """Write `tensors` and the JSON `document` to `path` atomically (a complete file or none)."""
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}
    text = json.dumps(document, sort_keys=True)
    metadata = {"format": FORMAT, "version": str(VERSION), "kvcompress": text, "sha256": _digest(text, tensors)}
    data = safetensors.torch.save(tensors, metadata)
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors on the CPU, the JSON document) of a file `write` wrote; CacheFileError for anything else."""
    data = Path(path).read_bytes()
    where = f"{str(path)!r}"
    if len(data) < 8:
        raise CacheFileError(f"{where} is not a kvcompress cache file: {len(data)} bytes, too short for a safetensors header (truncated?)")
    size = int.from_bytes(data[:8], "little")
    if 8 + size > len(data):
        raise CacheFileError(f"{where} is truncated or not a safetensors file: its header announces {size} bytes, the file has {len(data) - 8} after it")
    try:
        header = json.loads(data[8 : 8 + size])
    except (UnicodeDecodeError, ValueError) as err:
        raise CacheFileError(f"{where} is not a kvcompress cache file: its header is not safetensors JSON ({err})") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise CacheFileError(f"{where} is not a kvcompress cache file (a safetensors file without its {FORMAT!r} metadata, e.g. model weights)")
    if metadata.get("version") != str(VERSION):
        raise CacheFileError(f"{where} is a kvcompress cache of format version {metadata.get('version')!r}; this kvcompress reads version "
                             f"{VERSION}: compress the context again with this version")
    try:
        tensors = safetensors.torch.load(data)
    except safetensors.SafetensorError as err:
        raise CacheFileError(f"{where} is truncated or corrupted: safetensors cannot read it ({err})") from None
    text = metadata.get("kvcompress", "")
    if metadata.get("sha256") != _digest(text, tensors):
        raise CacheFileError(f"{where} is corrupted: its contents do not match the checksum written with them")
    return tensors, json.loads(text)


def _digest(text: str, tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the JSON document and of every tensor's name, dtype, shape and bytes (CPU tensors), in name order."""
    h = hashlib.sha256(text.encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"\0{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def model_fingerprint(model) -> dict:
    """What a cache must match to be used with `model`: its class, layer and head shapes, RoPE, and a sample of its weights.

    weights: a SHA-256 of the parameters' names and shapes, and SAMPLES_PER_PARAMETER evenly
    spaced values of every parameter (float32), compared at WEIGHT_RTOL by `check_model`.
    """
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = list(model.named_parameters())
    names = hashlib.sha256("\n".join(f"{name} {list(p.shape)}" for name, p in params).encode()).hexdigest()
    samples = []
    for _, p in params:
        flat = p.detach().reshape(-1)
        index = torch.linspace(0, flat.numel() - 1, min(SAMPLES_PER_PARAMETER, flat.numel()), device=flat.device).round().long()
        samples.append(flat[index].float().cpu())
    return _plain({
        "class": type(model).__name__,
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "head_dim": head_dim,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": getattr(config, "max_position_embeddings", None),
        "layers": check_supported(model),
        "rope": getattr(config, "rope_parameters", None),
        "weights": {"parameters": names, "samples": [s.tolist() for s in samples] if samples else []},
    })


def _plain(value):
    """value as JSON reads it back (tuples as lists, keys as strings), so a saved and a fresh fingerprint compare equal."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def check_model(saved: dict, model, path) -> None:
    """CacheFileError unless `model` matches the fingerprint `saved` (`model_fingerprint`), naming what differs."""
    current = model_fingerprint(model)
    where = f"{str(path)!r}"
    for key in sorted(set(saved) | set(current)):
        if key != "weights" and saved.get(key) != current.get(key):
            raise CacheFileError(f"{where} was saved from another model: its {key} is {saved.get(key)!r}, this model's is {current.get(key)!r}; "
                                 "load it with the model it was made with")
    weights, ours = saved.get("weights", {}), current["weights"]
    if weights.get("parameters") != ours["parameters"]:
        raise CacheFileError(f"{where} was saved from another model: its parameters (names and shapes) differ from this model's")
    names = [name for name, _ in model.named_parameters()]
    for name, theirs, mine in zip(names, weights["samples"], ours["samples"]):
        a, b = torch.tensor(theirs), torch.tensor(mine)
        if not torch.allclose(a, b, rtol=WEIGHT_RTOL, atol=1e-6):
            raise CacheFileError(f"{where} was saved from another model: its weights differ from this model's ({name}: {theirs} in the file, "
                                 f"{mine} here); load it with the checkpoint it was made with")


def summary_tensors(prefix: str, summary: KVSummary | QuantizedSummary | RaggedSummary) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of a summary, named under `prefix`, and its description for `summary_from`."""
    if isinstance(summary, RaggedSummary):
        tensors = {f"{prefix}.keys": summary.keys, f"{prefix}.values": summary.values, f"{prefix}.positions": summary.positions,
                   f"{prefix}.counts": summary.counts}
        if summary.log_weights is not None:
            tensors[f"{prefix}.log_weights"] = summary.log_weights
        return tensors, {"quantized": False, "ragged": True, "eviction_only": summary.log_weights is None, "normalizer": False}
    if isinstance(summary, QuantizedSummary):
        tensors = {**_quantized_tensors(f"{prefix}.keys", summary.keys), **_quantized_tensors(f"{prefix}.values", summary.values),
                   f"{prefix}.positions": summary.positions}
        if summary.log_weights is not None:
            tensors[f"{prefix}.log_weights"] = summary.log_weights
        if summary.normalizer is not None:
            keys, log_weights, positions = summary.normalizer
            tensors.update(_quantized_tensors(f"{prefix}.normalizer.keys", keys))
            tensors.update({f"{prefix}.normalizer.log_weights": log_weights, f"{prefix}.normalizer.positions": positions})
        meta = {"quantized": True, "bits": summary.keys.bits, "group_size": summary.keys.group_size,
                "key_dim": summary.keys.dim, "value_dim": summary.values.dim}
        return tensors, {**meta, "eviction_only": summary.eviction_only, "normalizer": summary.normalizer is not None}
    tensors = {f"{prefix}.keys": summary.keys, f"{prefix}.values": summary.values, f"{prefix}.positions": summary.positions.int()}
    if not summary.eviction_only:
        tensors[f"{prefix}.log_weights"] = summary.log_weights
    if summary.normalizer is not None:
        norm = summary.normalizer
        tensors.update({f"{prefix}.normalizer.keys": norm.keys, f"{prefix}.normalizer.log_weights": norm.log_weights,
                        f"{prefix}.normalizer.positions": norm.positions.int()})
    return tensors, {"quantized": False, "eviction_only": summary.eviction_only, "normalizer": summary.normalizer is not None}


def _quantized_tensors(prefix: str, q: QuantizedTensor) -> dict[str, torch.Tensor]:
    return {f"{prefix}.packed": q.packed, f"{prefix}.scale": q.scale, f"{prefix}.zero": q.zero}


def summary_from(prefix: str, tensors: dict[str, torch.Tensor], meta: dict, device,
                 dtype: torch.dtype) -> KVSummary | QuantizedSummary | RaggedSummary:
    """The summary `summary_tensors` described, on `device`, its keys and values (or scales) in `dtype`."""
    positions = tensors[f"{prefix}.positions"]
    log_weights = tensors.get(f"{prefix}.log_weights")
    if meta["eviction_only"]:
        log_weights = None
    if meta.get("ragged"):
        return RaggedSummary(tensors[f"{prefix}.keys"], tensors[f"{prefix}.values"], log_weights, positions,
                             tensors[f"{prefix}.counts"]).to(device, dtype)
    if meta["quantized"]:
        def quantized(name: str, axis: str, dim: int) -> QuantizedTensor:
            return QuantizedTensor(tensors[f"{name}.packed"], tensors[f"{name}.scale"], tensors[f"{name}.zero"], meta["bits"],
                                   meta["group_size"], axis, dim)

        norm = None
        if meta["normalizer"]:
            norm = (quantized(f"{prefix}.normalizer.keys", "channel", meta["key_dim"]), tensors[f"{prefix}.normalizer.log_weights"],
                    tensors[f"{prefix}.normalizer.positions"])
        keys, values = quantized(f"{prefix}.keys", "channel", meta["key_dim"]), quantized(f"{prefix}.values", "token", meta["value_dim"])
        return QuantizedSummary(keys, values, log_weights, positions, norm).to(device, dtype)
    if log_weights is None:
        log_weights = torch.zeros(1).expand(positions.shape)
    norm = None
    if meta["normalizer"]:
        norm = Normalizer(tensors[f"{prefix}.normalizer.keys"], tensors[f"{prefix}.normalizer.log_weights"],
                          tensors[f"{prefix}.normalizer.positions"].long())
    summary = KVSummary(tensors[f"{prefix}.keys"], tensors[f"{prefix}.values"], log_weights, positions.long(), norm, meta["eviction_only"])
    return summary.to(dtype, device)


# What an entry of a saved object graph is (`state_tensors`): each entry is a JSON object holding one of these keys.
_KINDS = ("link", "ref", "value", "tensor", "generator", "dtype", "device", "size", "list", "tuple", "dict", "object")


def state_tensors(prefix: str, obj, links: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of a live object graph (a decode-mode `Stream` and the method state it holds), named under `prefix`,
    and its JSON description, for `state_from`.

    None, bools, numbers and strings are kept in the description; a tensor is stored once however often it is held;
    a `torch.Generator` as its state; a dtype, a device, a size, a list, a tuple or a dict as such; an instance of a
    kvcompress class as its class name and attributes. A generator or an instance held in several places is stored
    once and referred to (`ref`) after that, so what the graph shares stays shared (a hybrid's state and its
    coreset draw from one generator). An object among `links` (the cache's method, its rotary inverse) is stored by
    its name and given back by `state_from`'s own links. Anything else is a ValueError.
    """
    tensors: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}
    linked = {id(value): name for name, value in links.items() if value is not None}
    shared: dict[int, int] = {}  # id of a generator or instance already stored -> its number
    keep = []  # what `shared` numbers, alive until the encoding ends (ids are only unique among live objects)

    def tensor(t: torch.Tensor) -> str:
        if id(t) not in names:
            names[id(t)] = f"{prefix}.{len(names)}"
            tensors[names[id(t)]] = t
        return names[id(t)]

    def encode(x):
        if id(x) in linked:
            return {"link": linked[id(x)]}
        if id(x) in shared:
            return {"ref": shared[id(x)]}
        ours = type(x).__module__.startswith("kvcompress.") and hasattr(x, "__dict__")
        if isinstance(x, torch.Generator) or ours:
            shared[id(x)] = len(keep)
            keep.append(x)
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"value": x}
        if isinstance(x, torch.Tensor):
            return {"tensor": tensor(x)}
        if isinstance(x, torch.Generator):
            return {"generator": str(x.device), "state": tensor(x.get_state()), "id": shared[id(x)]}
        if isinstance(x, torch.dtype):
            return {"dtype": str(x).removeprefix("torch.")}
        if isinstance(x, torch.device):
            return {"device": str(x)}
        if isinstance(x, torch.Size):
            return {"size": list(x)}
        if isinstance(x, (list, tuple)):
            return {type(x).__name__: [encode(v) for v in x]}
        if isinstance(x, dict):
            return {"dict": [[encode(k), encode(v)] for k, v in x.items()]}
        cls = type(x)
        if ours:
            return {"object": f"{cls.__module__}:{cls.__qualname__}", "id": shared[id(x)], "attributes": {k: encode(v) for k, v in vars(x).items()}}
        raise ValueError(f"a live stream holds a {cls.__module__}.{cls.__qualname__}, which a cache file cannot store")

    return tensors, encode(obj)


def state_from(tensors: dict[str, torch.Tensor], description: dict, links: dict, device):
    """The object graph `state_tensors` described, its tensors and generators on `device` (a generator keeps the
    device it was saved on when that is the CPU). Only kvcompress classes are built, without running their
    constructors; CacheFileError for a description naming anything else."""
    device = torch.empty(0, device=device).device  # "cuda" as the tensors moved there report it ("cuda:0")
    loaded: dict[str, torch.Tensor] = {}
    built: dict[int, object] = {}  # generators and instances by their number (`ref`)

    def decode(x: dict):
        kind = next((k for k in _KINDS if k in x), None)
        value = x.get(kind)
        if kind == "link":
            return links[value]
        if kind == "ref":
            return built[value]
        if kind == "value":
            return value
        if kind == "tensor":
            if value not in loaded:
                loaded[value] = tensors[value].to(device)
            return loaded[value]
        if kind == "generator":
            generator = built[x["id"]] = torch.Generator(device="cpu" if value == "cpu" else device)
            generator.set_state(tensors[x["state"]])
            return generator
        if kind == "dtype":
            return getattr(torch, value)
        if kind == "device":
            return device
        if kind == "size":
            return torch.Size(value)
        if kind in ("list", "tuple"):
            items = [decode(v) for v in value]
            return items if kind == "list" else tuple(items)
        if kind == "dict":
            return {decode(k): decode(v) for k, v in value}
        if kind == "object":
            module, name = value.split(":")
            if not module.startswith("kvcompress."):
                raise CacheFileError(f"a saved stream names the class {value!r}, which is not kvcompress's")
            cls = importlib.import_module(module)
            for part in name.split("."):
                cls = getattr(cls, part)
            obj = built[x["id"]] = cls.__new__(cls)
            obj.__dict__.update({k: decode(v) for k, v in x["attributes"].items()})
            return obj
        raise CacheFileError(f"a saved stream holds an entry of none of the kinds {_KINDS}: {sorted(x)}")

    return decode(description)
