"""The saved-cache file: one safetensors file, its metadata, its checksum, and the model it belongs to.

docs/design.md, "Saved caches". A file holds named tensors (every layer's state, the token ids)
and, in the safetensors metadata, the format name and version, a SHA-256 of the metadata and of
every tensor (name, dtype, shape and bytes), and a JSON document: the compression settings, each
layer's description, and the fingerprint of the model the cache was made with (`model_fingerprint`).
`read` refuses a file that is not complete, not a kvcompress cache, of another format version, or
whose contents do not match its checksum; `check_model` refuses a model other than the one saved.
Each layer's state (a summary, or a live stream with its method's state) is written by explicit
schema (`saved_state`: registered classes, named fields, a version each) and checked whole against
it before anything is built (`state_from`). The checksum guards against corruption, not against
editing: an edited file that does not fit the schema is a CacheFileError naming the field.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from .model_support import check_supported
from .saved_state import SchemaError, Spec, canonical_safetensors, decode, encode, write_whole

FORMAT = "kvcompress-cache"
VERSION = 2
# Weights are compared at this relative tolerance (and 1e-6 absolute), so one checkpoint in float32,
# bfloat16 or float16 is the same model; a different checkpoint differs far beyond it.
WEIGHT_RTOL = 2.0**-7
SAMPLES_PER_PARAMETER = 4


class CacheFileError(ValueError):
    """A saved cache that cannot be used: unreadable, foreign, of another version, corrupted, or from another model."""


class CacheFileMissing(CacheFileError, FileNotFoundError):
    """A saved cache's path that names no file (nothing there, or a folder): a CacheFileError and a FileNotFoundError."""


def as_path(path) -> Path:
    """`path` (a str or os.PathLike) as a Path; anything else is refused, naming what was given."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file's path (a str or os.PathLike), got {type(path).__name__}")
    return Path(path)


def existing_file(path, parameter: str = "path") -> Path:
    """`path` as a Path (`as_path`) when it names a file; else CacheFileMissing naming `parameter` and the path."""
    file = as_path(path)
    if not file.is_file():
        raise CacheFileMissing(f"{parameter}={str(path)!r}: {'a folder, not a file' if file.is_dir() else 'no such file'}; pass the "
                               "path of a cache saved with CompressedCache.save (e.g. kvc.compress_context(...).save(path))")
    return file


def write(path: str | os.PathLike, tensors: dict[str, torch.Tensor], document: dict) -> None:
    """Write `tensors` and the JSON `document` to `path` atomically (a complete file or none)."""
    path = as_path(path)
    if path.is_dir():
        raise IsADirectoryError(f"cannot write {str(path)!r}: it is a folder; name a file in it, e.g. {str(path / 'context.kvc')!r}")
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}
    text = json.dumps(document, sort_keys=True)
    metadata = {"format": FORMAT, "version": str(VERSION), "kvcompress": text, "sha256": _digest(text, tensors)}
    write_whole(path, canonical_safetensors(safetensors.torch.save(tensors, metadata)))


def read(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors on the CPU, the JSON document) of a file `write` wrote; CacheFileError for anything else."""
    data = existing_file(path).read_bytes()
    where = f"{str(path)!r}"
    if len(data) < 8:
        raise CacheFileError(f"{where} is not a kvcompress cache file: {len(data)} bytes, too short for a safetensors header (truncated?)")
    size = int.from_bytes(data[:8], "little")
    if data[8:9] != b"{":  # a safetensors file: its header's length, then the header's JSON object
        raise CacheFileError(f"{where} is not a kvcompress cache file: it does not start as a safetensors file does (its header's "
                             f"length, then a JSON object); it starts with {data[:12]!r}")
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
    try:
        document = json.loads(text)
    except ValueError as err:
        raise CacheFileError(f"{where} has a document that is not JSON ({err})") from None
    missing = sorted({"options", "stream_length", "model", "layers"} - set(document)) if isinstance(document, dict) else None
    if missing is None or missing:
        raise CacheFileError(f"{where} has a document without its fields {missing or ['options', 'stream_length', 'model', 'layers']}")
    return tensors, document


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
        samples.append(flat[sample_indices(flat.numel(), SAMPLES_PER_PARAMETER).to(flat.device)].float().cpu())
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


def sample_indices(numel: int, count: int) -> torch.Tensor:
    """min(count, numel) evenly spaced indices of a flat tensor of `numel` elements, first and last included [k], int64.

    Exact integer arithmetic (round(i·(numel-1)/(k-1)) by floor division), so the last index is numel-1 for any size: a
    float32 linspace rounds indices past 2^24 and can step beyond the end."""
    k = min(count, numel)
    if k <= 1:
        return torch.zeros(k, dtype=torch.long)
    steps = torch.arange(k, dtype=torch.long)
    return (steps * (numel - 1) * 2 + (k - 1)) // (2 * (k - 1))


def _plain(value):
    """value as JSON reads it back (tuples as lists, keys as strings), so a saved and a fresh fingerprint compare equal."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def check_model(saved: dict, model, path) -> None:
    """CacheFileError unless `model` matches the fingerprint `saved` (`model_fingerprint`), naming what differs. path:
    the file's, or None for a cache held in memory (`CompressedCache.check_same_model`), which the messages then name."""
    current = model_fingerprint(model)
    where = f"{str(path)!r}" if path is not None else "the compressed context"
    made, advice = ("was saved from", "load it with") if path is not None else ("was built with", "answer from it with")
    if not isinstance(saved, dict) or not isinstance(saved.get("weights"), dict):
        raise CacheFileError(f"{where} has no model fingerprint (its 'model' field is not one): remake the file with kvcompress compress")
    for key in sorted(set(saved) | set(current)):
        if key != "weights" and saved.get(key) != current.get(key):
            raise CacheFileError(f"{where} {made} another model: its {key} is {saved.get(key)!r}, this model's is {current.get(key)!r}; "
                                 f"{advice} the model it was made with")
    weights, ours = saved["weights"], current["weights"]
    if weights.get("parameters") != ours["parameters"]:
        raise CacheFileError(f"{where} {made} another model: its parameters (names and shapes) differ from this model's")
    names = [name for name, _ in model.named_parameters()]
    samples = weights.get("samples")
    shapes_agree = isinstance(samples, list) and len(samples) == len(ours["samples"]) and all(
        isinstance(s, list) and len(s) == len(m) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in s)
        for s, m in zip(samples, ours["samples"]))
    if not shapes_agree:
        raise CacheFileError(f"{where} has a model fingerprint whose weight samples are not {SAMPLES_PER_PARAMETER} numbers per parameter")
    for name, theirs, mine in zip(names, samples, ours["samples"]):
        a, b = torch.tensor(theirs, dtype=torch.float32), torch.tensor(mine, dtype=torch.float32)
        if not torch.allclose(a, b, rtol=WEIGHT_RTOL, atol=1e-6):
            raise CacheFileError(f"{where} {made} another model: its weights differ from this model's ({name}: {theirs} there, "
                                 f"{mine} here); {advice} the checkpoint it was made with")


def state_tensors(prefix: str, spec: Spec, state, links: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors named under `prefix`, JSON description) of a layer's state written as `spec` says (`saved_state.encode`:
    each registered class writes its declared fields). links: the cache's own objects a state refers to by name."""
    return encode(spec, state, prefix, links)


def state_from(tensors: dict[str, torch.Tensor], spec: Spec, description, *, dims: dict[str, int], links: dict, device, where: str,
               path) -> object:
    """The state `state_tensors` described, checked whole against `spec` before anything is built (`saved_state.decode`);
    CacheFileError naming the file and the field for anything that does not fit."""
    try:
        return decode(spec, description, tensors, dims=dims, links=links, device=device, path=where)
    except SchemaError as err:
        raise CacheFileError(f"{str(path)!r} holds a state that does not fit this kvcompress's format at {err}") from None
