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
  feeds the prompt in blocks of B tokens: stored KV stays within budget + ceil(slack·budget) + B
  for block-wise methods, ClusterGen and BalanceKV, budget + B for Express and SubGen); setting `absorbing` False compacts each
  stream to its budget once, and later tokens stay exact.
- "decode": every token, prompt and generated, goes through the stream.

Padded batches (left padding, prefill mode): the model's boolean mask tells each layer which
tokens of a block are padding; they get log-weight -inf (never attended) and each padded row is
compressed alone, so no padding is kept and every row equals its solo run. Sliding-window
layers (Gemma 2/3, Phi-3/Mistral with a window) are transformers' exact sliding-window layers.
`snapshot()`/`restore()` roll the cache back to a compressed context (many questions, one
compression); `reorder_cache` serves beam search.
"""

from __future__ import annotations

import copy
import inspect
import time
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from .api import default_sink_window
from .methods.base import (
    Method,
    Stream,
    Tokens,
    build_method,
    check_sink_window,
    compress_tokens,
    make_generator,
    query_positions_for,
    resolve_budget,
)
from .summary import KVSummary, Normalizer, SlotBuffer, concat

MODES = ("prefill", "chunked", "decode")
ATTENTION_NAME = "kvcompress"  # the attention implementation a CompressedCache needs (kvcompress.integration.attention)


@dataclass
class CompressionSettings:
    """What every layer of a CompressedCache does. Exactly one of budget / compression_ratio
    (a ratio is allowed only in prefill mode, where the prompt length is known when compressing).
    slack: re-compression slack of block-wise streams (and of ClusterGen's and BalanceKV's native
    ones) in chunked/decode mode (`Stream`; None is the default 0.5); an error in prefill mode and
    for streams that never hold more than budget (Express, SubGen)."""

    method: Method
    mode: str = "prefill"
    budget: int | None = None
    compression_ratio: float | None = None
    sink: int = 4
    window: int = 64
    seed: int = 0
    slack: float | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode != "prefill" and self.budget is None:
            raise ValueError(f"mode={self.mode!r} streams through a bounded cache: pass budget (compression_ratio needs the prompt length; kvc.generate converts it)")
        resolve_budget(10**9, self.budget, self.compression_ratio, 0, 0)
        if self.slack is not None:
            if self.mode == "prefill":
                raise ValueError(f"slack={self.slack!r} sets how streams re-compress: it applies to mode 'chunked' or 'decode', not 'prefill'")
            Stream(self.method, self.budget, self.sink, self.window, torch.Generator(), slack=self.slack)  # validates slack for this method


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
        self.front: SlotBuffer | KVSummary | Stream | None = None  # KVSummary: a padded batch's stacked rows
        self.tail: KVSummary | None = None
        self.pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.pending_real: torch.Tensor | None = None
        self.seen = 0
        self.stats = LayerStats()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def stored(self) -> KVSummary | None:
        """The layer's stored state as one summary (front then tail), without the pending block."""
        front = self.front.summary() if isinstance(self.front, (SlotBuffer, Stream)) else self.front
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
        self.pending_real = None
        self.seen += n
        new = KVSummary.exact(key_states, value_states, positions)
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.nbytes() + new.nbytes())
        if isinstance(self.front, SlotBuffer):  # compressed once: the block is stored in place, no copy
            view = self.front.append(new, most=self.seen)
        else:
            stored = self.stored()
            view = concat([stored, new]) if stored is not None else new
        self.view = view
        keys = view.keys
        keys.kvcompress_layer = self  # how the attention function finds this layer's view and commit()
        return keys, view.values

    def mask_padding(self, attention_mask: torch.Tensor | None) -> None:
        """Take the padding of the pending block from the model's 4D boolean mask [B, 1, q, seen] (None: no padding).

        The mask's columns are original positions 0..seen-1 (see get_mask_sizes); a column hidden from
        the block's last query is padding (left padding: the last query is a real token and sees
        every real token of its row). Padding slots of the view get log-weight -inf (never
        attended), and commit() leaves them out of what is stored.
        """
        if attention_mask is None:
            return
        if attention_mask.dtype != torch.bool or attention_mask.ndim != 4 or attention_mask.shape[-1] != self.seen:
            raise ValueError(
                f"kvcompress expects a boolean attention mask [B, 1, q, {self.seen}] from its mask function, "
                f"got {attention_mask.dtype} {tuple(attention_mask.shape)}"
            )
        n = self.pending[0].shape[2]
        real = attention_mask[:, 0, -1, -n:]
        self.pending_real = real
        hidden = ~real[:, None, :].expand(-1, self.view.log_weights.shape[1], -1)
        view = self.view
        stored = view.num_slots - n
        log_weights = torch.cat([view.log_weights[..., :stored], view.log_weights[..., stored:].masked_fill(hidden, float("-inf"))], -1)
        self.view = KVSummary(view.keys, view.values, log_weights, view.positions, view.normalizer)  # a new summary: its weights are not all 0

    def commit(self, queries: torch.Tensor, scale: float, attention_mass: torch.Tensor | None = None) -> None:
        """Absorb the pending block, now that its queries [B, H_q, n, d] are known (and, from the
        attention that computed it, the mass [B, H_kv, n] each token received: `Tokens.attention_mass`)."""
        keys, values, positions = self.pending
        real = self.pending_real
        self.pending, self.pending_real, self.view = None, None, None
        settings = self.cache.settings
        start = time.perf_counter()
        if settings.mode == "prefill" and self.front is None:
            if not has_padding(real):  # decode then appends in place, no copy of the state per step
                self.front = self._compressed_buffer(keys, values, positions, queries, scale, attention_mass)
            else:
                self.front = self._compress_rows(keys, values, positions, queries, scale, real)
        elif settings.mode == "decode" or (settings.mode == "chunked" and self.cache.absorbing):
            if has_padding(real):
                raise ValueError(f"padded batches are supported in mode='prefill' only, got mode={settings.mode!r}")
            if self.front is None:
                unrotate = self.cache.pre_rope_keys if settings.method.needs_pre_rope_keys else None
                self.front = Stream(settings.method, settings.budget, settings.sink, settings.window, self.cache.generator(self.layer_idx), scale,
                                    settings.slack, unrotate)
            self.front.update(keys, values, queries, None, positions, self.layer_idx, self.cache.num_layers)
        elif isinstance(self.front, SlotBuffer):  # the buffer took the block in update()
            return
        else:
            block = KVSummary.exact(keys, values, positions)
            if real is not None:
                padded = block.log_weights.masked_fill(~real[:, None, :], float("-inf"))
                block = KVSummary(keys, values, padded, block.positions)
            self.tail = block if self.tail is None else concat([self.tail, block])
            return
        self.stats.compress_seconds += time.perf_counter() - start

    def compact(self) -> None:
        """Compress a live stream down to its budget now (timed as compression)."""
        if isinstance(self.front, Stream):
            start = time.perf_counter()
            self.front.compact()
            self.stats.compress_seconds += time.perf_counter() - start

    def _compress_rows(self, keys, values, positions, queries, scale, real) -> KVSummary:
        """A padded batch: each row's real tokens compressed alone (with the generator of a solo run), stacked with -inf padding slots."""
        rows = []
        for b in range(keys.shape[0]):
            index = real[b].nonzero().squeeze(-1)
            rows.append(self._compress_once(
                keys[b : b + 1, :, index], values[b : b + 1, :, index], positions[index], queries[b : b + 1, :, index], scale
            ))
        return stack_rows(rows)

    def _compressed_buffer(self, keys, values, positions, queries, scale, attention_mass) -> SlotBuffer:
        """`_compress_once` into a buffer allocated at the compressed size (room for later tokens comes with the first of them)."""
        summary = self._compress_once(keys, values, positions, queries, scale, attention_mass)
        return SlotBuffer(summary, most=summary.num_slots)

    def _compress_once(self, keys, values, positions, queries, scale, attention_mass=None) -> KVSummary:
        settings = self.cache.settings
        b, h, n, _ = keys.shape
        pos = positions.expand(b, h, n)
        budget = resolve_budget(n, settings.budget, settings.compression_ratio, settings.sink, settings.window)
        tokens = Tokens(
            keys, values, pos, queries, self.cache.pre_rope_keys(keys, positions), scale,
            self.layer_idx, self.cache.num_layers, query_positions_for(queries, pos), attention_mass=attention_mass,
        )
        summary = compress_tokens(settings.method, tokens, budget, settings.sink, settings.window, self.cache.generator(self.layer_idx))
        return summary.to(self.dtype).checked_eviction()  # model's dtype; eviction_only read once

    def load_prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, attention_mass=None) -> None:
        """Compress an already computed context prefill (prefill mode): keys/values [B,H_kv,n,d], queries [B,H_q,n,d],
        attention_mass [B,H_kv,n] or None (`Tokens.attention_mass`)."""
        if self.cache.settings.mode != "prefill" or self.front is not None or self.seen:
            raise ValueError("load_prefill needs a fresh layer of a prefill-mode cache")
        self.lazy_initialization(keys, values)
        positions = torch.arange(keys.shape[2], device=keys.device)
        start = time.perf_counter()
        self.seen = keys.shape[2]
        self.front = self._compressed_buffer(keys, values, positions, queries, scale, attention_mass)
        self.stats.compress_seconds += time.perf_counter() - start
        self.stats.peak_bytes = max(self.stats.peak_bytes, 2 * keys.numel() * keys.element_size())

    def nbytes(self) -> int:
        """Bytes of every tensor this layer stores (compressed front, its workspace, exact tail)."""
        front = self.front.nbytes() if self.front is not None else 0
        return front + (self.tail.nbytes() if self.tail is not None else 0)

    def slots(self, row: int | None = None) -> int:
        """Occupied slots per head (finite log-weight), averaged over heads and the batch (or of one batch row)."""
        s = self.stored()
        if s is None:
            return 0
        occupied = torch.isfinite(s.log_weights).float().sum(-1)
        return int((occupied if row is None else occupied[row]).mean().round())

    def get_seq_length(self) -> int:
        # Original positions: generation keeps counting tokens seen, not slots stored.
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.front = self.tail = self.pending = self.pending_real = None
        self.seen = 0
        self.stats = LayerStats()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: keep the batch rows `beam_idx` [B] (prefill mode; a live stream cannot be reordered)."""
        if isinstance(self.front, Stream):
            raise ValueError(f"beam search reorders the cache rows: supported in mode='prefill', got mode={self.cache.settings.mode!r}")
        front = self.front.summary() if isinstance(self.front, SlotBuffer) else self.front
        self.front, self.tail = (select_rows(part, beam_idx) if part is not None else None for part in (front, self.tail))

    def snapshot(self):
        """The layer's state, to restore() later: a summary is shared (never modified in place), any other front (a live stream) copied."""
        return _frozen(self.front), self.tail, self.seen

    def restore(self, state) -> None:
        front, self.tail, self.seen = state
        self.front = _frozen(front)


def _frozen(front):
    """front itself if it is an immutable KVSummary (or None), else a deep copy (a stream or buffer that grows in place)."""
    return front if front is None or isinstance(front, KVSummary) else copy.deepcopy(front)


class SlidingWindowLayer(DynamicSlidingWindowLayer):
    """A sliding-window attention layer (Gemma 2/3, Phi-3): its window is kept exact, never compressed."""

    def __init__(self, sliding_window: int):
        super().__init__(sliding_window=sliding_window)
        self.stats = LayerStats()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.stats.peak_bytes = max(self.stats.peak_bytes, 2 * keys.numel() * keys.element_size())
        return keys, values

    def load_prefill(self, queries, keys, values, scale) -> None:
        """Take a recorded prefill of the context: the window keeps its last tokens."""
        self.update(keys, values)

    def nbytes(self) -> int:
        return 0 if not self.is_initialized else 2 * self.keys.numel() * self.keys.element_size()

    def slots(self, row: int | None = None) -> int:
        return 0 if not self.is_initialized else self.keys.shape[2]

    def snapshot(self):
        return (self.keys, self.values, self.cumulative_length) if self.is_initialized else None

    def restore(self, state) -> None:
        if state is None:
            self.is_initialized, self.keys, self.values, self.cumulative_length = False, None, None, 0
        else:
            self.keys, self.values, self.cumulative_length = state


def select_rows(summary: KVSummary, index: torch.Tensor) -> KVSummary:
    """The batch rows `index` [k] of a summary (normalizer included)."""
    index = index.to(summary.keys.device)
    norm = summary.normalizer
    if norm is not None:
        norm = Normalizer(*(t.index_select(0, index) for t in (norm.keys, norm.log_weights, norm.positions)))
    rows = (t.index_select(0, index) for t in (summary.keys, summary.values, summary.log_weights, summary.positions))
    return KVSummary(*rows, normalizer=norm)


def has_padding(real: torch.Tensor | None) -> bool:
    """Whether a block's real-token flags [B, n] (None: no mask) mark any padding (one device sync)."""
    return real is not None and not bool(real.all())


def stack_rows(rows: list[KVSummary]) -> KVSummary:
    """Stack one-row summaries [1, H, n_b] into [B, H, max n_b], filling short rows with empty slots (log-weight -inf, position -1)."""
    width = max(r.num_slots for r in rows)

    def pad(t, size, value):
        return torch.nn.functional.pad(t, (0, 0, 0, size - t.shape[2]) if t.ndim == 4 else (0, size - t.shape[2]), value=value)

    out = KVSummary(
        torch.cat([pad(r.keys, width, 0.0) for r in rows]),
        torch.cat([pad(r.values, width, 0.0) for r in rows]),
        torch.cat([pad(r.log_weights, width, float("-inf")) for r in rows]),
        torch.cat([pad(r.positions, width, -1) for r in rows]),
    )
    if any(r.normalizer is not None for r in rows):
        dens = [r.denominator() for r in rows]
        size = max(d.keys.shape[2] for d in dens)
        out.normalizer = Normalizer(
            torch.cat([pad(d.keys, size, 0.0) for d in dens]),
            torch.cat([pad(d.log_weights, size, float("-inf")) for d in dens]),
            torch.cat([pad(d.positions, size, -1) for d in dens]),
        )
    return out


class CompressedCache(Cache):
    """A transformers `Cache` whose full-attention layers store compressed KV; pass it as `past_key_values`.

        cache = CompressedCache(model, "snapkv", compression_ratio=0.5)
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)

    method: a registered method name (its parameters go in **method_params), or a ready
    `CompressionSettings` (then no other option). Exactly one of budget / compression_ratio;
    sink/window default to the method's paper; mode "prefill" (the first forward, i.e. the prompt,
    is compressed once), or "chunked"/"decode" with a budget and an optional re-compression
    `slack` (see the module docstring and `CompressionSettings`).
    Sliding-window layers (Gemma 2/3, Phi-3 with a window) keep their window exact.

    Built from a method name, the cache switches the model to the 'kvcompress' attention
    implementation (`model.set_attn_implementation("kvcompress")`), which attends over compressed
    layers and runs exact SDPA with the usual masks everywhere else, so the model keeps working
    without the cache. Built from a CompressionSettings (library use) it leaves the model as is:
    run it under `use_compressed_attention(model)`, which also restores the previous one on exit.
    """

    def __init__(
        self,
        model,
        method: "str | CompressionSettings",
        *,
        budget: int | None = None,
        compression_ratio: float | None = None,
        mode: str = "prefill",
        sink: int | None = None,
        window: int | None = None,
        seed: int = 0,
        slack: float | None = None,
        **method_params,
    ):
        layer_types = check_supported(model)
        if isinstance(method, CompressionSettings):
            if budget is not None or compression_ratio is not None or sink is not None or window is not None or slack is not None or method_params:
                raise ValueError("CompressedCache takes either a CompressionSettings or a method name with its options, not both")
            settings = method
        elif isinstance(method, str):
            sink, window = default_sink_window(method, sink, window)
            check_sink_window(sink, window)
            settings = CompressionSettings(build_method(method, **method_params), mode, budget, compression_ratio, sink, window, seed, slack)
        else:
            raise ValueError(f"method must be a method name (one of kvcompress.methods()) or a CompressionSettings, got {method!r}")
        self.settings = settings
        self.num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self._absorbing = True
        self.progress = None  # a tqdm bar ticked once per layer forward, set by kvc.generate on long prompts
        self._rotary = find_rotary_embedding(model) if settings.method.needs_pre_rope_keys else None
        layers = [
            CompressedLayer(self, i) if kind == "full_attention" else SlidingWindowLayer(window)
            for i, (kind, window) in enumerate(layer_types)
        ]
        super().__init__(layers=layers)
        if isinstance(method, str):
            select_compressed_attention(model)

    @property
    def absorbing(self) -> bool:
        """Chunked mode: True while blocks go through each layer's stream (the prompt)."""
        return self._absorbing

    @absorbing.setter
    def absorbing(self, value: bool) -> None:
        """Setting it False ends the prompt: every stream is compacted to its budget once (its slack compressed away)."""
        if self._absorbing and not value:
            for layer in self.layers:
                if isinstance(layer, CompressedLayer):
                    layer.compact()
        self._absorbing = value

    @classmethod
    def from_prefill(cls, model, settings: CompressionSettings, captured: dict) -> "CompressedCache":
        """A prefill-mode cache built from one recorded full prefill of the context.

        captured: {layer: (queries, keys, values)} for every layer, post-RoPE (as
        `kvcompress.eval.capture.capture_qkv` returns them), optionally with a fourth tensor, the
        attention mass [B,H_kv,n] the capture's prefill computed, handed to a method that scores
        with it (`needs_attention_mass`). One prefill then serves any number of methods and
        ratios: each gets its own compressed copy.
        """
        cache = cls(model, settings)
        if sorted(captured) != list(range(cache.num_layers)):
            raise ValueError(f"captured must hold every layer 0..{cache.num_layers - 1}")
        scales = attention_scales(model)
        for layer, (queries, keys, values, *mass) in captured.items():
            mass = mass[0] if mass and settings.method.needs_attention_mass else None
            cache.layers[layer].load_prefill(queries, keys, values, scales[layer], mass)
        return cache

    def snapshot(self) -> list:
        """Every layer's state (cheap: stored tensors are shared), for restore(): e.g. right after a context is compressed."""
        return [layer.snapshot() for layer in self.layers]

    def restore(self, snapshot: list) -> None:
        """Roll every layer back to a snapshot(): later tokens are forgotten, the compressed context is reused as is."""
        for layer, state in zip(self.layers, snapshot):
            layer.restore(state)

    def generator(self, layer_idx: int) -> torch.Generator:
        return make_generator(self.settings.seed * 100003 + layer_idx)

    def pre_rope_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """Un-rotate post-RoPE keys [B,H,n,d] at positions [n] or [B,H,n] with the model's rotary embedding (None if not needed).

        RoPE maps halves (x1, x2) to (x1·cos − x2·sin, x2·cos + x1·sin); the inverse is written half by
        half into one output, the same products and sums as the forward formula with −sin, with two
        half-size temporaries instead of five full-size ones (fewer fresh pages inside a prefill).
        """
        if self._rotary is None:
            return None
        rotary, extra = self._rotary
        b, h, n, _ = keys.shape
        if positions.ndim == 1:
            cos, sin = rotary(keys, positions[None].expand(b, -1), **extra)
            cos, sin = cos[:, None].to(keys.dtype), sin[:, None].to(keys.dtype)
        else:
            cos, sin = rotary(keys, positions.reshape(b * h, n), **extra)
            cos, sin = cos.view(b, h, n, -1).to(keys.dtype), sin.view(b, h, n, -1).to(keys.dtype)
        width = cos.shape[-1]  # partial rotary (Phi-3) rotates a prefix of the channels
        half = width // 2
        first, second = keys[..., :half], keys[..., half:width]
        out = torch.empty_like(keys)
        torch.mul(first, cos[..., :half], out=out[..., :half]).add_(second * sin[..., :half])
        torch.mul(second, cos[..., half:], out=out[..., half:width]).sub_(first * sin[..., half:])
        out[..., width:] = keys[..., width:]
        return out

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def peak_bytes(self) -> int:
        return sum(layer.stats.peak_bytes for layer in self.layers)

    def slots_per_layer(self, row: int | None = None) -> list[int]:
        """Occupied slots per KV head in each layer (averaged over the batch, or of one batch row)."""
        return [layer.slots(row) for layer in self.layers]

    def compress_seconds(self) -> float:
        return sum(layer.stats.compress_seconds for layer in self.layers)


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")


def check_supported(model) -> list[tuple[str, int | None]]:
    """[(layer type, sliding window)] per layer: "full_attention" (compressed) or "sliding_attention" (window kept exact).

    Raises a clear error for a model kvcompress does not support. A sliding window at least as long
    as the model's positions never slides, so such a layer counts as full attention.
    """
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"unsupported model type {model_type!r}: kvcompress supports decoder-only models using transformers' "
            f"AttentionInterface: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"unsupported model: layer types {unknown}; kvcompress handles full_attention and sliding_attention layers")
    longest = getattr(config, "max_position_embeddings", None)
    layers = []
    for kind, kw in zip(types, kwargs):
        window = kw.get("sliding_window")
        if kind == "sliding_attention" and longest is not None and window >= longest:
            kind, window = "full_attention", None
        layers.append((kind, window))
    return layers


def attention_scales(model) -> dict[int, float]:
    """{layer_idx: attention scale} of the model's attention modules."""
    return {m.layer_idx: m.scaling for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")}


def find_rotary_embedding(model):
    """(rotary embedding module, extra forward kwargs for the full-attention layers' rotation)."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            takes_type = "layer_type" in inspect.signature(module.forward).parameters  # Gemma 3: local and global RoPE
            return module, ({"layer_type": "full_attention"} if takes_type else {})
    raise ValueError("the model has no rotary embedding module: cannot recover pre-RoPE keys")


def select_compressed_attention(model) -> None:
    """Switch the model to the 'kvcompress' attention implementation (registered by `kvcompress.integration`)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ATTENTION_NAME not in ALL_ATTENTION_FUNCTIONS.valid_keys():
        raise ValueError(f"the {ATTENTION_NAME!r} attention is registered by kvcompress.integration: import it first (kvc.CompressedCache does)")
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
