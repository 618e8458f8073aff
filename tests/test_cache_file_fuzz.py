"""Fuzzed cache files: every damaged or edited file either loads and answers, or is refused with a CacheFileError.

Files of every state kind (prefill, chunked and decode modes; full precision, quantized, ragged; block-wise and native
streams) are truncated at every section, have bits flipped in their tensors, and have their JSON document edited with the
checksum recomputed, which anyone can do: each field changed, deleted or given another type, a class name replaced,
tensors reshaped or dropped. Loading such a file must never end in another exception, nor must answering from it.
"""

import json
import random

import pytest
import safetensors.torch
import torch

import kvcompress as kvc
from kvcompress import cache_file
from kvcompress.cache_file import CacheFileError
from kvcompress.integration import answer_from_cache_ids, compress_context_ids

from test_integration import blocks, tiny

FILES = [
    dict(method="snapkv", mode="prefill"),
    dict(method="snapkv", mode="prefill", kv_bits=4),
    dict(method="adakv", mode="prefill"),  # ragged: heads keep different numbers of slots
    dict(method="keydiff", mode="decode", kv_bits=4),  # a live stream, quantized
    # slow (many edits, each answered), e2e only: BalanceKV's chunked stream, a full-precision block-wise decode stream,
    # the native streams, and a quantized BalanceKV decode stream
    *(pytest.param(s, marks=pytest.mark.e2e) for s in (dict(method="balancekv", mode="chunked"), dict(method="keydiff", mode="decode"),
                                                        dict(method="subgen", mode="decode"),
                                                        dict(method="express", mode="decode"),
                                                        dict(method="clustergen", mode="decode"),
                                                        dict(method="hybrid", mode="decode"), dict(method="balancekv", mode="decode", kv_bits=4))),
]
QUESTION = torch.tensor([[5, 17, 33]])


@pytest.fixture(scope="module")
def model():
    return tiny()


def _save(model, tmp_path, settings: dict):
    ids = torch.randint(0, 96, (1, 90), generator=torch.Generator().manual_seed(11))
    path = tmp_path / ("-".join(str(v) for v in settings.values()) + ".kvc")
    compress_context_ids(model, ids, budget=12, sink=2, window=4, **blocks(settings["mode"], 16), **settings).save(path)
    return path


def _outcome(model, path) -> str | None:
    """None when the file loads and answers (the question and 2 tokens) or is a CacheFileError; else the exception that
    escaped."""
    try:
        cache = kvc.load_cache(path, model)
    except CacheFileError:
        return None
    except Exception as err:  # noqa: BLE001 - what this test exists to catch
        return f"load: {type(err).__name__}: {err}"[:300]
    try:
        (res,) = answer_from_cache_ids(model, cache, [QUESTION], max_new_tokens=2, stop_at_eos=False)
        assert len(res.token_ids) == 2
    except Exception as err:  # noqa: BLE001
        return f"answer: {type(err).__name__}: {err}"[:300]
    return None


def _paths(node, path=()):
    """(path, value) of every node of a JSON document, the document's fields first."""
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*path, i))


def _shape(path) -> tuple:
    """A path with list indices and layer numbers generalised: one edit per field of the schema, not per slot."""
    return tuple("#" if isinstance(p, int) else p for p in path)


def _set(doc, path, value=..., delete=False):
    doc = json.loads(json.dumps(doc))
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


def _other_values(value) -> list:
    """The same type with another value, and another type."""
    if isinstance(value, bool):
        return [not value, "yes"]
    if isinstance(value, int):
        return [value + 1, -value - 7, value * 1000 + 3, str(value)]
    if isinstance(value, float):
        return [-value * 2 - 1, float("nan"), str(value)]
    if isinstance(value, str):
        return [value + "x", 3]
    if value is None:
        return [0, "x", {}]
    if isinstance(value, list):
        return [value[:-1], value + value[-1:], 1]
    return [[], "x"]


def _edits(document: dict, rng: random.Random):
    """(what, edited document) for every field of the document: changed, deleted, or of another type."""
    seen = set()
    for path, value in _paths(document):
        if not path or _shape(path) in seen:
            continue
        seen.add(_shape(path))
        if path[0] == "model" and len(path) > 2 and path[1] == "weights":
            continue  # the weight samples: one edit of the fingerprint's structure below is enough
        for other in _other_values(value):
            yield f"{path} = {other!r}"[:200], _set(document, path, other)
        if isinstance(path[-1], str):
            yield f"del {path}", _set(document, path, delete=True)
        if path[-1] == "class":
            for name in ("os:system", "kvcompress.methods.stream:Stream", "tokens", "kv_summary", "stream"):
                yield f"{path} = {name!r}", _set(document, path, name)


@pytest.mark.parametrize("settings", FILES, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_an_edited_or_damaged_file_loads_and_answers_or_is_a_cache_file_error(model, tmp_path, settings):
    path = _save(model, tmp_path, settings)
    assert _outcome(model, path) is None
    data = path.read_bytes()
    tensors = safetensors.torch.load(data)
    document = json.loads(safetensors.safe_open(str(path), "pt").metadata()["kvcompress"])
    rng = random.Random(0)
    failures, cases = [], 0
    probe = tmp_path / "probe.kvc"

    def run(what: str) -> None:
        nonlocal cases
        cases += 1
        problem = _outcome(model, probe)
        if problem is not None:
            failures.append(f"{what}: {problem}")

    # truncated at every section: in the length, in the header, at and inside every tensor's bytes
    header = int.from_bytes(data[:8], "little")
    offsets = json.loads(data[8 : 8 + header])
    cuts = {0, 4, 8, 8 + header // 2, 8 + header}
    for name, entry in offsets.items():
        if name != "__metadata__":
            start, end = entry["data_offsets"]
            cuts |= {8 + header + start + (end - start) // 2, 8 + header + end - 1}
    for cut in sorted(c for c in cuts if c < len(data)):
        probe.write_bytes(data[:cut])
        run(f"truncated at {cut}")
    # bits flipped in tensors (the checksum is not recomputed)
    for name in rng.sample(sorted(tensors), min(8, len(tensors))):
        start, end = offsets[name]["data_offsets"]
        if end > start:
            flipped = bytearray(data)
            flipped[8 + header + rng.randrange(start, end)] ^= 1 << rng.randrange(8)
            probe.write_bytes(bytes(flipped))
            run(f"bit flipped in {name}")
    # the document edited, the checksum recomputed
    for what, edited in _edits(document, rng):
        cache_file.write(probe, tensors, edited)
        run(what)
    # tensors reshaped or dropped, the checksum recomputed
    for name, t in tensors.items():
        others = {k: v for k, v in tensors.items() if k != name}
        cache_file.write(probe, others, document)
        run(f"{name} dropped")
        for reshaped in (t.reshape(-1), t[..., :-1] if t.ndim and t.shape[-1] > 1 else t.reshape(1, -1)):
            cache_file.write(probe, {**others, name: reshaped}, document)
            run(f"{name} reshaped to {list(reshaped.shape)}")
    assert cases > 100
    assert not failures, f"{len(failures)} of {cases} cases escaped:\n" + "\n".join(failures[:25])


def test_writing_into_a_folder_that_does_not_exist_names_the_path(tmp_path):
    """The error names the path asked for, not the hidden temporary file the atomic write makes beside it."""
    path = tmp_path / "no" / "doc.kvc"
    with pytest.raises(FileNotFoundError, match=f"cannot write '{path}': its folder '{path.parent}' does not exist"):
        cache_file.write(path, {"x": torch.zeros(1)}, {})


def test_saved_files_take_the_umasks_permissions(tmp_path):
    """A saved cache and a scorer file are readable as the user's umask says, as any file they write (safetensors'
    save_file and a temporary file make them private to the owner)."""
    import os

    from test_kvzap import _surrogate

    old = os.umask(0o022)
    try:
        cache_file.write(tmp_path / "doc.kvc", {"x": torch.zeros(1)}, {})
        _surrogate().save(tmp_path / "scorer.safetensors")
        os.umask(0o077)
        cache_file.write(tmp_path / "private.kvc", {"x": torch.zeros(1)}, {})
    finally:
        os.umask(old)
    assert {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {"doc.kvc": 0o644, "scorer.safetensors": 0o644,
                                                                             "private.kvc": 0o600}
