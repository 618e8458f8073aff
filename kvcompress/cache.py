"""A transformers `Cache` that physically stores a compressed KV state per layer (DESIGN.md §3).

Each layer holds a *front* (what compression produced: sink + method summary + window, as a
one-shot `KVSummary` or a live `Stream`) and an exact *tail* (tokens appended after compression,
e.g. the question and the answer in `prefill` and `chunked` modes). `update()` returns the front,
the tail and the new block as one view for attention; the attention function
(`integration.attention`) attends over it and then calls `commit()` with the layer's queries,
which is when the new block is absorbed — so query-aware methods see the real queries and the
block's own queries still see the block exactly.

Modes:
- "prefill": the first forward (the context) is compressed once, at its end; later tokens stay exact.
- "chunked": while `absorbing` is True every block goes through the method's stream (the caller
  feeds the prompt in blocks of B tokens: stored KV stays at budget + B); afterwards exact.
- "decode": every token, prompt and generated, goes through the stream.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .methods.base import Method, Stream, Tokens, compress_tokens, make_generator, query_positions_for, resolve_budget
from .summary import KVSummary, SlotBuffer, concat

MODES = ("prefill", "chunked", "decode")


@dataclass
class CompressionSettings:
    """What every layer of a CompressedCache does. Exactly one of budget / compression_ratio
    (a ratio is allowed only in prefill mode, where the prompt length is known when compressing)."""

    method: Method
    mode: str = "prefill"
    budget: int | None = None
    compression_ratio: float | None = None
    sink: int = 4
    window: int = 64
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode != "prefill" and self.budget is None:
            raise ValueError(f"mode={self.mode!r} streams through a bounded cache: pass budget (compression_ratio needs the prompt length; kvc.generate converts it)")
        resolve_budget(10**9, self.budget, self.compression_ratio, 0, 0)


@dataclass
class LayerStats:
    compress_seconds: float = 0.0
    peak_bytes: int = 0


class CompressedLayer(CacheLayerMixin):
    """One layer's state: front (compressed) + tail (exact) + the block awaiting commit."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: "CompressedCache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.front: SlotBuffer | Stream | None = None
        self.tail: KVSummary | None = None
        self.pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.seen = 0
        self.stats = LayerStats()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def stored(self) -> KVSummary | None:
        """The layer's stored state as one summary (front then tail), without the pending block."""
        front = self.front.summary() if self.front is not None else None
        parts = [p for p in (front, self.tail) if p is not None]
        return concat(parts) if parts else None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending is not None:
            raise RuntimeError(
                "a CompressedCache layer got a new block before the previous one was committed: the model must run "
                "with the 'kvcompress' attention implementation (kvcompress.integration.use_compressed_attention)"
            )
        n = key_states.shape[2]
        positions = torch.arange(self.seen, self.seen + n, device=key_states.device)
        self.pending = (key_states, value_states, positions)
        self.seen += n
        new = KVSummary.exact(key_states, value_states, positions)
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.nbytes() + new.nbytes())
        if isinstance(self.front, SlotBuffer):  # compressed once: the block is stored in place, no copy
            view = self.front.append(new)
        else:
            stored = self.stored()
            view = concat([stored, new]) if stored is not None else new
        self.view = view
        keys = view.keys
        keys.kvcompress_layer = self  # how the attention function finds this layer's view and commit()
        return keys, view.values

    def commit(self, queries: torch.Tensor, scale: float) -> None:
        """Absorb the pending block, now that its queries [B, H_q, n, d] are known."""
        keys, values, positions = self.pending
        self.pending, self.view = None, None
        settings = self.cache.settings
        start = time.perf_counter()
        if settings.mode == "prefill" and self.front is None:
            self.front = self._compress_once(keys, values, positions, queries, scale)
        elif settings.mode == "decode" or (settings.mode == "chunked" and self.cache.absorbing):
            if self.front is None:
                self.front = Stream(settings.method, settings.budget, settings.sink, settings.window, self.cache.generator(self.layer_idx), scale)
            self.front.update(
                keys, values, queries, self.cache.pre_rope_keys(keys, positions), positions,
                self.layer_idx, self.cache.num_layers,
            )
        elif isinstance(self.front, SlotBuffer):  # the buffer took the block in update()
            return
        else:
            block = KVSummary.exact(keys, values, positions)
            self.tail = block if self.tail is None else concat([self.tail, block])
            return
        self.stats.compress_seconds += time.perf_counter() - start

    def _compress_once(self, keys, values, positions, queries, scale) -> SlotBuffer:
        settings = self.cache.settings
        b, h, n, _ = keys.shape
        pos = positions.expand(b, h, n)
        budget = resolve_budget(n, settings.budget, settings.compression_ratio, settings.sink, settings.window)
        tokens = Tokens(
            keys, values, pos, queries, self.cache.pre_rope_keys(keys, positions), scale,
            self.layer_idx, self.cache.num_layers, query_positions_for(queries, pos),
        )
        summary = compress_tokens(settings.method, tokens, budget, settings.sink, settings.window, self.cache.generator(self.layer_idx))
        return SlotBuffer(summary.to(self.dtype).checked_eviction())  # model's dtype; eviction_only read once

    def load_prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> None:
        """Compress an already computed context prefill (prefill mode): keys/values [B,H_kv,n,d], queries [B,H_q,n,d]."""
        if self.cache.settings.mode != "prefill" or self.front is not None or self.seen:
            raise ValueError("load_prefill needs a fresh layer of a prefill-mode cache")
        self.lazy_initialization(keys, values)
        positions = torch.arange(keys.shape[2], device=keys.device)
        start = time.perf_counter()
        self.front = self._compress_once(keys, values, positions, queries, scale)
        self.stats.compress_seconds += time.perf_counter() - start
        self.seen = keys.shape[2]
        self.stats.peak_bytes = max(self.stats.peak_bytes, 2 * keys.numel() * keys.element_size())

    def nbytes(self) -> int:
        """Bytes of every tensor this layer stores (compressed front, its workspace, exact tail)."""
        front = self.front.nbytes() if self.front is not None else 0
        return front + (self.tail.nbytes() if self.tail is not None else 0)

    def slots(self) -> int:
        """Occupied slots per head (finite log-weight), averaged over batch and heads."""
        s = self.stored()
        return 0 if s is None else int(torch.isfinite(s.log_weights).float().sum(-1).mean().round())

    def get_seq_length(self) -> int:
        # Original positions: generation keeps counting tokens seen, not slots stored.
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.front = self.tail = self.pending = None
        self.seen = 0
        self.stats = LayerStats()


class CompressedCache(Cache):
    """A Cache whose layers store compressed KV. Use with the 'kvcompress' attention implementation.

    model: the transformers model (for the layer count and, for methods that need pre-RoPE keys,
    its rotary embedding); settings: what to compress and how.
    """

    def __init__(self, model, settings: CompressionSettings):
        check_supported(model)
        self.settings = settings
        self.num_layers = model.config.num_hidden_layers
        self.absorbing = True
        self.progress = None  # a tqdm bar ticked once per layer forward, set by kvc.generate on long prompts
        self._rotary = find_rotary_embedding(model) if settings.method.needs_pre_rope_keys else None
        super().__init__(layers=[CompressedLayer(self, i) for i in range(self.num_layers)])

    @classmethod
    def from_prefill(cls, model, settings: CompressionSettings, captured: dict) -> "CompressedCache":
        """A prefill-mode cache built from one recorded full prefill of the context.

        captured: {layer: (queries, keys, values)} for every layer, post-RoPE (as
        `kvcompress.eval.capture.capture_qkv` returns them). One prefill then serves any number
        of methods and ratios: each gets its own compressed copy.
        """
        cache = cls(model, settings)
        if sorted(captured) != list(range(cache.num_layers)):
            raise ValueError(f"captured must hold every layer 0..{cache.num_layers - 1}")
        scales = attention_scales(model)
        for layer, (queries, keys, values) in captured.items():
            cache.layers[layer].load_prefill(queries, keys, values, scales[layer])
        return cache

    def generator(self, layer_idx: int) -> torch.Generator:
        return make_generator(self.settings.seed * 100003 + layer_idx)

    def pre_rope_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """Un-rotate post-RoPE keys [B,H,n,d] at positions [n] with the model's rotary embedding (None if not needed)."""
        if self._rotary is None:
            return None
        cos, sin = self._rotary(keys, positions[None].expand(keys.shape[0], -1))
        cos, sin = cos[:, None].to(keys.dtype), sin[:, None].to(keys.dtype)
        half = keys.shape[-1] // 2
        rotated_half = torch.cat((-keys[..., half:], keys[..., :half]), dim=-1)
        return keys * cos - rotated_half * sin

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def peak_bytes(self) -> int:
        return sum(layer.stats.peak_bytes for layer in self.layers)

    def slots_per_layer(self) -> list[int]:
        return [layer.slots() for layer in self.layers]

    def compress_seconds(self) -> float:
        return sum(layer.stats.compress_seconds for layer in self.layers)


SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def check_supported(model) -> None:
    """Raise a clear error for a model whose attention does not go through AttentionInterface."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"unsupported model type {model_type!r}: kvcompress supports decoder-only models using transformers' "
            f"AttentionInterface with full attention in every layer: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    layer_types = getattr(model.config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"unsupported model: layer types {sorted(set(layer_types))}; kvcompress needs full attention in every layer")


def attention_scales(model) -> dict[int, float]:
    """{layer_idx: attention scale} of the model's attention modules."""
    return {m.layer_idx: m.scaling for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")}


def find_rotary_embedding(model):
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            return module
    raise ValueError("the model has no rotary embedding module: cannot recover pre-RoPE keys")
