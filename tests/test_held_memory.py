"""The memory a compressed cache holds is the memory it reports: every tensor it keeps owns its storage (a view of a
larger tensor would keep the whole of it alive, uncounted), and what it holds beyond `nbytes()` is bookkeeping (positions,
log-weights, per-head counts) and, in a decode-mode stream of a method that scores with the queries, the documented
workspace its state keeps to score the next block (docs/design.md, "Quantized storage (`kv_bits`)": the latest block's
queries and exact neighbours). Checked for
every method in every mode, at full precision and quantized, on a tiny model, and for the default on the real one."""

import pytest
import torch

import kvcompress as kvc
from kvcompress.cache import CompressedCache
from kvcompress.integration import compress_context_ids
from kvcompress.methods.base import Method

from test_saved_cache import CASES, _ids, _options

# Workspace a decode-mode stream keeps beside what it stores: its state's latest block (`Tokens.scoring_context`)
WORKSPACE = ("last",)


def held_tensors(cache: CompressedCache) -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor the cache's layers hold, reached through their attributes (the model, the
    methods and the generators, which the cache shares with others, left out)."""
    found, seen = [], set()

    def walk(obj, path: str) -> None:
        if id(obj) in seen or obj is None or isinstance(obj, (CompressedCache, Method, torch.nn.Module, torch.Generator)):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append((path, obj))
        elif isinstance(obj, (list, tuple)):
            for i, item in enumerate(obj):
                walk(item, f"{path}[{i}]")
        elif isinstance(obj, dict):
            for key, item in obj.items():
                walk(item, f"{path}.{key}")
        elif hasattr(obj, "__dict__"):
            for key, item in vars(obj).items():
                walk(item, f"{path}.{key}")

    for i, layer in enumerate(cache.layers):
        walk(layer, f"layers[{i}]")
    return found


def storage_bytes(tensors: list[tuple[str, torch.Tensor]]) -> int:
    """Bytes of the distinct storages under `tensors`."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for _, t in tensors if t.numel()}.values())


def viewed_bytes(tensors: list[tuple[str, torch.Tensor]]) -> int:
    """Bytes of each storage under `tensors` that some tensor spans: from the lowest element any of them starts at to
    the highest any reaches (so a small view beside a large one on the same storage shows as the gap between them)."""
    extents: dict[int, tuple[int, int]] = {}
    for _, t in tensors:
        if not t.numel():
            continue
        start = t.storage_offset() * t.element_size()
        end = start + (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()
        ptr = t.untyped_storage().data_ptr()
        low, high = extents.get(ptr, (start, end))
        extents[ptr] = (min(low, start), max(high, end))
    return sum(high - low for low, high in extents.values())


def is_bookkeeping(t: torch.Tensor, head_dim: int) -> bool:
    """What `nbytes()` leaves out as bookkeeping: integer tensors but codes (positions, counts, indices), float tensors
    with no feature axis (log-weights and scores [B, H, n] or packed [T], per-head statistics [B, H]; packed keys and
    values are [T, head_dim]) and expanded placeholders (a zero stride)."""
    if not t.is_floating_point():
        return t.dtype != torch.uint8
    return t.ndim in (1, 3) or (t.ndim == 2 and t.shape[-1] != head_dim) or 0 in t.stride()


def assert_holds_what_it_reports(cache: CompressedCache, mode: str, where: str) -> None:
    """No view of keys, values or codes keeps a larger tensor alive (small integer bookkeeping views aside); workspace
    only in decode mode, for a method that scores with the queries
    (the latest block's queries and exact neighbours); what is held beyond it is `nbytes()` plus bookkeeping."""
    tensors = [(p, t) for p, t in held_tensors(cache) if t.numel()]
    head_dim = cache.saved_dims["D"]
    kv = [(p, t) for p, t in tensors if not is_bookkeeping(t, head_dim)]
    assert storage_bytes(kv) <= viewed_bytes(kv), (where, _pinning(kv))
    stored = [(p, t) for p, t in tensors if not any(f".{w}." in p for w in WORKSPACE)]
    workspace = mode == "decode" and cache.options.compressor.requirements.needs("queries")
    assert workspace or len(stored) == len(tensors), f"{where}: workspace held: {_names(tensors, stored)}"
    bookkeeping = storage_bytes([(p, t) for p, t in stored if is_bookkeeping(t, head_dim)])
    assert storage_bytes(stored) <= cache.nbytes() + bookkeeping, where


def _pinning(tensors) -> list[str]:
    return [f"{p}: {t.numel() * t.element_size()} B of {t.untyped_storage().nbytes()}" for p, t in tensors
            if t.numel() and t.untyped_storage().nbytes() > t.numel() * t.element_size()][:5]


def _names(tensors, stored) -> list[str]:
    kept = {id(t) for _, t in stored}
    return [p for p, t in tensors if id(t) not in kept][:5]


@pytest.mark.parametrize("method, mode, bits", CASES)
def test_a_cache_holds_what_it_reports(tiny_checkpoint, tiny_default_scorer, method, mode, bits):
    model, _ = kvc.load_model(tiny_checkpoint, device="cpu", dtype="float32")
    cache = compress_context_ids(model, _ids(300, 1), **_options(method, mode, bits))
    assert_holds_what_it_reports(cache, mode, f"{method} {mode} kv_bits={bits}")


@pytest.mark.parametrize("mode", ["prefill", "chunked"])
def test_a_sliding_window_layer_holds_its_window_not_the_prompt(mode):
    """Gemma 3's sliding-window layers keep the last window - 1 tokens of a prompt block in storage of their own, as
    what they report."""
    from test_hf import _ids as token_ids, tiny

    model = tiny("gemma3")
    cache = compress_context_ids(model, token_ids(300), method="keydiff", compression_ratio=0.5, mode=mode,
                                 **({"chunk_size": 128} if mode == "chunked" else {}))
    assert any(type(layer).__name__ == "SlidingWindowLayer" for layer in cache.layers)
    assert_holds_what_it_reports(cache, mode, f"gemma3 keydiff {mode}")


@pytest.mark.e2e
@pytest.mark.smoke
@pytest.mark.parametrize("mode, bits", [("prefill", None), ("chunked", None), ("decode", None), ("prefill", 4)])
def test_the_default_holds_what_it_reports_on_the_default_model(default_model, mode, bits):
    """The default (AdaKV over KVzap: heads packed, an exact window split off, quantized with kv_bits) on SmolLM2 at
    ratio 0.75, 600 tokens of prose, the streams' prompt in blocks of 256."""
    model, tokenizer = default_model
    text = " ".join(f"Line {i} of the ledger notes that crate {i * 7 % 97} went to the harbour at dawn." for i in range(40))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :600]
    assert ids.shape[1] == 600
    cache = compress_context_ids(model, ids, method="default", compression_ratio=0.75, mode=mode, kv_bits=bits,
                                 **({} if mode == "prefill" else {"chunk_size": 256}))
    assert_holds_what_it_reports(cache, mode, f"default {mode} kv_bits={bits}")
