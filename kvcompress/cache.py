"""A transformers `Cache` that physically stores a compressed KV state per layer.

docs/design.md, "Model integration: three modes"; the byte accounting: docs/design.md, "Memory".

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
  feeds the prompt in blocks of B tokens: each stream stores at most its budget per head beside
  sink and window, its slack and the block it absorbs included, `methods.budget.stream_split`;
  the block of B tokens is held beside it only during its own forward); setting `absorbing` False
  stores what each stream keeps as a compressed context, as prefill mode stores one (the stream and
  its workspace let go), and later tokens stay exact.
- "decode": every token, prompt and generated, goes through the stream.

Padded batches (left padding, prefill mode): the model's boolean mask tells each layer which
tokens of a block are padding; they get log-weight -inf (never attended) and each padded row is
compressed alone, so no padding is kept and every row equals its solo run. Sliding-window
layers (Gemma 2/3) are transformers' exact sliding-window layers; a model whose every layer slides
(Mistral-7B-v0.1, Phi-3-mini-4k) has nothing to compress and is refused.
A compressed context of one row is shared by every row of a later block (beam search,
num_return_sequences): each row goes on from a copy of it, however it is stored, sliding windows
included; several rows, or a live stream's, refuse another count before any layer takes the block.
`snapshot()`/`restore()` roll the cache back to a compressed context (many questions, one
compression); `reorder_cache` serves beam search.

With `kv_bits` (docs/design.md, "Quantized storage"), a compressed context is stored as a
`QuantizedSummary` front (the method's summary) with its sink and window as the start of the exact
tail (sink keys are outliers a key group should not be scaled to): in prefill mode once the first
forward is compressed, in chunked mode when the prompt ends (its stream held each slot quantized as it
entered, keys per slot: `compact` stores them again with keys per channel). A compressed
context whose heads keep different numbers of slots (AdaKV) is stored the same way with its front
packed (only the kept slots, head after head; docs/design.md, "Memory"): a `RaggedSummary` at full
precision, a `QuantizedRaggedSummary` with `kv_bits`.
`save()` / `CompressedCache.load()` write and read a compressed context with its token ids
(docs/design.md, "Saved caches"; the file: `cache_file`).
"""

from __future__ import annotations

import copy
import json
import os
import time
import warnings
import weakref
from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from . import cache_file
from .checks import as_count, check_token_ids, describe
from .methods.base import UnknownParameters, compress_layers, compress_tokens, make_generator
from .methods.stream import Stream, batch_coupling
from .methods.tokens import Tokens, exact_ends, per_head, query_positions_for
from .model_support import RotaryInverse, attention_scales, check_supported, has_padding, keep_hidden_states, release_hidden_states
from .model_support import autocast_off, cache_dropping_length, common_dtype, decoding_settings, length_dependent_rope, select_compressed_attention
from .names import DEFAULT_METHOD, FULL
from .options import CompressionOptions
from .quantization import QuantizedRaggedSummary, QuantizedSummary
from .ragged import RaggedSummary, concat_parts, has_empty_slots, occupied_slots
from .saved_state import Instance, is_count
from .summary import KVSummary, Normalizer, SlotBuffer, concat, split_exact_ends

@dataclass(frozen=True)
class CachePlan:
    """How a cache compresses and stores its method's contexts: read once, when the cache is built, from what the
    method declares it needs (`Method.requirements`) and whether it draws random numbers (`Method.randomized`); the
    cache reads nothing else of its method.

    ragged: the heads of a layer keep different numbers of slots (budget scope "layer" or "model", AdaKV), so a
    compressed context is stored packed (`RaggedSummary`) rather than in one rectangular buffer.
    joint: one budget over every layer (budget scope "model"): each layer hands its context to the cache, which
    compresses them together once the last one has it (`CompressedCache._share_budget`); a padded batch is refused.
    pre_rope_keys: the method reads pre-RoPE keys, which the cache computes from the keys (`RotaryInverse`).
    hidden_states: the method reads each layer's input hidden states, which the model's attention modules keep for the
    attention function (`model_support.keep_hidden_states`).
    randomized: the method draws from its generator in shapes that depend on the batch, so an unpadded batch is
    compressed row by row to give each row its solo draws (`CompressedLayer._draws_per_row`); a stream takes one row only
    (`methods.stream.batch_coupling`, which also names a method whose stream scores a batch's rows together).
    """

    ragged: bool
    joint: bool
    pre_rope_keys: bool
    hidden_states: bool
    randomized: bool

    @classmethod
    def of(cls, method) -> "CachePlan":
        needs = method.requirements
        return cls(ragged=needs.ragged, joint=needs.budget_scope == "model", pre_rope_keys=needs.needs("pre_rope_keys"),
                   hidden_states=needs.needs("hidden_states"), randomized=method.randomized)


@dataclass
class CacheSnapshot:
    """What `CompressedCache.snapshot` keeps: each layer's state, whether the prompt was still streaming (`absorbing`),
    the contexts waiting for a joint compression, the token ids the cache stood for, and each layer's costs so far
    (`LayerStats`, copies)."""

    layers: list
    absorbing: bool
    waiting: dict
    token_ids: torch.Tensor | None
    stats: list


@dataclass
class LayerStats:
    """What one layer's compression cost: seconds spent compressing (and re-compressing), and the most KV bytes it
    stored at any step."""

    compress_seconds: float = 0.0
    peak_bytes: int = 0


class CompressedLayer(CacheLayerMixin):
    """One layer's state: front (compressed) + tail (exact) + the block awaiting commit."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: "CompressedCache", layer_idx: int):
        super().__init__()
        self._cache, self.layer_idx = weakref.ref(cache), layer_idx
        # KVSummary: a padded batch's stacked rows; RaggedSummary: a compressed context whose heads keep different numbers
        # of slots; QuantizedSummary / QuantizedRaggedSummary: a compressed context stored with kv_bits (`_stored_front`)
        self.front: SlotBuffer | KVSummary | QuantizedSummary | QuantizedRaggedSummary | RaggedSummary | Stream | None = None
        self.tail: KVSummary | None = None
        self.pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.pending_real: torch.Tensor | None = None
        self.refused: str | None = None  # a crop refused (`crop`): later forwards are refused until restore or reset
        # the RoPE positions [B or 1, n] the model rotated the pending block's keys at, when its attention was told them
        self.pending_rope_positions: torch.Tensor | None = None
        # what the pending block's attention reads: `view` (the stored slots and the block last, one summary) beside the
        # packed parts of what is stored (`view_packed`, RaggedSummary, attended where they are)
        self.view: KVSummary | None = None
        self.view_packed: list[RaggedSummary] = []
        # whether what is stored may hold tensors made under torch.inference_mode, which refuse in-place writes outside it
        self.holds_inference_tensors = False
        self.seen = 0
        self.rows: int | None = None  # the batch rows of what is stored (None before the first block; 1: shared by any rows)
        self.budgets: list[int] = []  # the middle budget each batch row was compressed to
        self.kv_bits: int | None = None  # the bits the compressed context is stored in (`CompressionOptions.bits_for`)
        self.stats = LayerStats()

    @property
    def cache(self) -> "CompressedCache":
        """The cache this layer belongs to, held weakly so that the two form no reference cycle: a dropped cache frees
        its tensors (and takes the default's hooks off the model) at once, not at the garbage collector's next full
        pass."""
        return self._cache()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def stored(self) -> KVSummary | None:
        """The layer's stored state as one summary (front then tail), without the pending block."""
        parts = self._stored_parts()
        return concat_parts(parts) if parts else None

    def _stored_parts(self) -> list[KVSummary | RaggedSummary]:
        """`stored()` as the parts `concat_parts` joins (a stream's sink, middle and window apart; packed slots as they
        are stored)."""
        if isinstance(self.front, Stream):
            front = self.front.summary_parts()
        elif isinstance(self.front, QuantizedRaggedSummary):
            front = [self.front.ragged()]
        elif isinstance(self.front, (SlotBuffer, QuantizedSummary)):
            front = [self.front.summary()]
        else:
            front = [self.front] if self.front is not None else []
        return front + ([self.tail] if self.tail is not None else [])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Take the next block (`Cache.update`): keys and values of two dtypes (under `torch.autocast` the model's rotary
        embedding returns the keys in the model's dtype beside values in the autocast dtype) are stored in one that holds
        both (`common_dtype`), and the block is stored and compressed with autocast off, in that dtype, as the attention
        over the layer runs (`integration.attention`). A block in another dtype than the layer stores (the model cast
        since) is refused."""
        key_states, value_states = common_dtype(key_states, value_states)
        if self.is_initialized and key_states.dtype != self.dtype:
            raise ValueError(f"layer {self.layer_idx} stores {self.dtype} and got a block in {key_states.dtype}: the model runs in "
                             "another dtype than the cache was built in (cast since with model.to(...) or model.half(), or another "
                             "instance loaded in another dtype); compress the context again with the model as it is, or save the "
                             "cache and load it for the model (kvc.load_cache casts a prefill- or chunked-mode file to the model's "
                             "dtype)")
        with autocast_off(key_states.device):
            return self._update(key_states, value_states)

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        dims = self.cache.saved_dims
        if key_states.shape[1] != dims["H"] or key_states.shape[3] != dims["D"]:
            raise ValueError(f"layer {self.layer_idx} got keys {describe(key_states)}: this cache was built for a model of "
                             f"{self.cache.num_layers} layers of {dims['H']} KV heads of dim {dims['D']}; build a CompressedCache "
                             "for the model it runs with")
        if self.refused is not None:
            raise ValueError(f"layer {self.layer_idx} of a CompressedCache refused {self.refused} and still holds the tokens it was "
                             "asked to drop: roll it back with cache.restore(snapshot) or start over with cache.reset()")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._leave_inference_tensors()
        rows = key_states.shape[0]  # checked against what every layer holds by `CompressedCache.update`
        if self.rows == 1 and rows > 1:  # a shared context: each row goes on from a copy of it
            self.reorder_cache(torch.zeros(rows, dtype=torch.long, device=key_states.device))
        self.rows = rows
        if self.pending is not None:
            raise RuntimeError(
                f"layer {self.layer_idx} of a CompressedCache got a new block before the previous one was committed: either the "
                "model runs without the 'kvcompress' attention implementation (kvcompress.integration.use_compressed_attention), "
                "or an earlier forward stopped before this layer's attention ran (an error, an interrupt), leaving the cache's "
                "layers at different tokens; roll it back with cache.restore(snapshot) or start over with cache.reset()"
            )
        n = key_states.shape[2]
        if n == 1 and self.cache.prompt_ends_at_first_step and self.cache.absorbing:
            if self.front is None:  # one-token prompt blocks would end the prompt at its second token
                raise ValueError("a chunked-mode cache built by name ends the prompt at its first one-token forward (model.generate's "
                                 "first step), so it takes a prompt in blocks of at least 2 tokens: give prefill_chunk_size >= 2, or "
                                 "build it from CompressionOptions and set cache.absorbing = False where the prompt ends")
            self.cache.absorbing = False  # model.generate's first step: the prompt has ended, the answer stays exact
        positions = torch.arange(self.seen, self.seen + n, device=key_states.device)
        self.pending = (key_states, value_states, positions)
        self.pending_real = None
        self.seen += n
        new = KVSummary.exact(key_states, value_states, positions)
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.nbytes() + new.nbytes())
        if isinstance(self.front, SlotBuffer):  # compressed once: the block is stored in place, no copy
            view = self.front.append(new, most=self.seen)
            self.view_packed = []
            self.stats.peak_bytes = max(self.stats.peak_bytes, self.nbytes())  # grown with headroom for later tokens
        elif isinstance(self.front, QuantizedSummary):  # dequantized straight into the view, the exact tail and block after it
            view = self.front.summary_then([p for p in (self.tail, new) if p is not None])
            self.view_packed = []
        else:  # the packed parts stay where they are stored (`attention.packed_then_causal_attention`), the rest is copied once
            parts = [*self._stored_parts(), new]
            self.view_packed = [p for p in parts if isinstance(p, RaggedSummary)]
            view = concat([p for p in parts if not isinstance(p, RaggedSummary)])
        self.view = view
        keys = view.keys
        keys.kvcompress_layer = self  # how the attention function finds this layer's view and commit()
        return keys, view.values

    def check_rows(self, rows: int) -> None:
        """A ValueError unless a block of `rows` batch rows can follow what the layer holds: one stored row is a context
        every row of a later block shares (beams, num_return_sequences); several rows, or a live stream's, are each
        row's own."""
        if self.rows is not None and rows != self.rows and (self.rows > 1 or isinstance(self.front, Stream)):
            raise ValueError(f"layer {self.layer_idx} holds {self.rows} batch row{'s' * (self.rows > 1)} and got a block of {rows}: "
                             + ("a live stream (mode chunked or decode) goes on with the rows it started with"
                                if isinstance(self.front, Stream) else "each row goes on from its own stored context")
                             + f"; give it {self.rows} rows (beam search reorders them), or compress each context into a cache of its own")

    def mask_padding(self, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None) -> None:
        """Take the padding of the pending block from the model's 4D boolean mask [B, 1, q, seen] (None: no padding),
        and the RoPE positions its keys were rotated at (position_ids [B or 1, q], None: unknown, then the slots'
        positions): transformers counts a left-padded row's positions from its first real token, which a padded row's
        pre-RoPE keys are un-rotated by (`_keep_rows`).

        The mask's columns are original positions 0..seen-1 (see get_mask_sizes); a column hidden from
        the block's last query is padding (left padding: the last query is a real token and sees
        every real token of its row). Padding slots of the view get log-weight -inf (never
        attended), and commit() leaves them out of what is stored.
        """
        self.pending_rope_positions = position_ids
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

    @torch.no_grad()
    def commit(self, queries: torch.Tensor, scale: float, attention_mass: torch.Tensor | None = None,
               hidden_states: torch.Tensor | None = None) -> None:
        """Absorb the pending block, now that its queries [B, H_q, n, d] are known (and, from the
        attention that computed it, the mass [B, H_kv, n] each token received: `Tokens.attention_mass`; and, when the
        model integration captured them for a method that reads them, the hidden states [B, n, d_model] the layer's
        attention received for the block: `Tokens.hidden_states`). What is handed over goes to the method as it is.
        Without gradients: compression selects and summarises, and a forward run with gradients on (a plain
        `model(...)` call outside `torch.no_grad`) attends and differentiates as usual."""
        keys, values, positions = self.pending
        options = self.cache.options
        # the model keeps hidden states while any cache of a method that reads them lives (`keep_hidden_states`): another
        # cache's method takes none
        hidden_states = per_head(hidden_states, keys.shape[1]) if self.cache.plan.hidden_states else None
        real, rope_positions = self.pending_real, self.pending_rope_positions
        view = self.view  # what the block's attention read (padding slots -inf, `mask_padding`)
        streams = options.mode == "decode" or (options.mode == "chunked" and self.cache.absorbing)
        if streams:
            self._check_stream_block(real, keys.shape[0])  # refused before the block is forgotten: later forwards are too
        self._forget_block()
        start = time.perf_counter()
        if options.mode == "prefill" and self.front is None:
            options.compressor.check_context(reconstructed=False)  # a plain forward's queries: refused by KVzip
            if has_padding(real) or self._draws_per_row(keys.shape[0]):
                self._keep_rows(keys, values, positions, queries, scale, real, hidden_states, rope_positions)
            else:  # decode then appends in place, no copy of the state per step
                self._compress_context(keys, values, positions, queries, scale, attention_mass, hidden_states=hidden_states)
        elif streams:
            if self.front is None:
                budget, self.kv_bits = options.storage_for(self.cache.stream_length, keys.shape[-1], self.dtype)
                self.budgets = [budget] * keys.shape[0]
                self.front = Stream(options.compressor, self._stream_budget(), options.sink, options.window, self.cache.generator(self.layer_idx), scale,
                                    options.slack, self.cache._unrotate, self.kv_bits, options.kv_group_size)
            if self.cache.warns_past_stream_length and self.seen > self.cache.stream_length:
                self.cache.warns_past_stream_length = False
                warnings.warn(
                    f"the streams have taken {self.seen} tokens, more than stream_length={self.cache.stream_length}, which "
                    f"compression_ratio={options.compression_ratio} was resolved against: they stay within the budget it gave, so "
                    "they now keep less than the ratio says (at ratio 0 they compress too); pass the tokens they will take as "
                    "stream_length (the prompt's and, in decode mode, the answer's)"
                    + ("; or the prompt never ended: a chunked cache built by name ends it at model.generate's first one-token "
                       "step, which a call with max_new_tokens=1 (or an answer that stops at once) never takes, so a later turn "
                       "is absorbed too" if options.mode == "chunked" and self.cache.prompt_ends_at_first_step else ""), stacklevel=2)
            self.front.update(keys, values, queries, None, positions, self.layer_idx, self.cache.num_layers, hidden_states)
        elif isinstance(self.front, SlotBuffer):  # the buffer took the block in update(), with gradients on if they were
            self.front.detach_()
            if has_padding(real):  # a left-padded turn: its padding stays unattended, as in the view
                self.front.hide_last(~real[:, None, :].expand(-1, keys.shape[1], -1))
            return
        elif isinstance(self.front, _PACKED_FRONTS):  # the view `update` joined is the tail then the block (gradients on if they were)
            self.tail = replace(view, keys=view.keys.detach(), values=view.values.detach())
            return
        else:
            block = KVSummary.exact(keys, values, positions)
            if real is not None:
                padded = block.log_weights.masked_fill(~real[:, None, :], float("-inf"))
                block = KVSummary(keys, values, padded, block.positions)
            self.tail = block if self.tail is None else concat([self.tail, block])
            return
        self.stats.compress_seconds += time.perf_counter() - start

    def _check_stream_block(self, real: torch.Tensor | None, rows: int) -> None:
        """A ValueError for a block a stream cannot take: padding, or a batch whose rows the method would keep together
        (`batch_coupling`). Raised while the block is still pending, so the cache refuses later forwards until
        `restore` or `reset` (this layer has counted the block; the layers after it have not seen it)."""
        options = self.cache.options
        if has_padding(real):
            raise ValueError(f"padded batches are supported in mode='prefill' only, got mode={options.mode!r}")
        why = batch_coupling(options.compressor, rows, solo_draws=True) if self.front is None else None
        if why is not None:
            raise ValueError(f"method {options.method!r} {why}, unlike each row alone: in mode={options.mode!r} run one row at a "
                             "time (kvc.generate does, for a list of contexts), or use mode='prefill', which compresses each row alone")

    def _stream_budget(self) -> int:
        """The middle budget of this layer's stream: its share of the options' budget (`Method.layer_budget`: the same
        for every layer unless the method shares one budget over the model), from the middle tokens the stream will take."""
        options, length = self.cache.options, self.cache.stream_length
        middle = None if length is None else max(1, length - options.sink - options.window)
        return options.compressor.layer_budget(self.budgets[0], self.layer_idx, middle)

    def compact(self) -> None:
        """End a live stream's prompt (chunked mode): the stream compacted (`Stream.compact`) and what it keeps stored as a
        compressed context (timed as compression): with kv_bits (the stream held its slots quantized, keys per slot; they
        are dequantized and stored again with keys per channel), or with heads that keep different numbers of slots, as
        `_keep` stores one; else its summary in storage of its own, later tokens joining the exact tail (as a loaded
        chunked cache stores it). The stream goes with its workspace (the latest block's queries), which nothing reads
        once the prompt has ended."""
        if not isinstance(self.front, Stream):
            return
        start = time.perf_counter()
        with autocast_off(self.device):  # in the stored dtype, as the stream's updates (`CompressedCache.update`)
            self.front.compact()
            summary, head, recent = self.front.summary(), self.front.head, self.front.recent
            if self.kv_bits is not None or (self.cache.plan.ragged and has_empty_slots(summary)):
                self._keep(summary, (head.length if head is not None else 0, recent.length if recent is not None else 0))
            else:
                self.front = summary.clone()
        self.stats.compress_seconds += time.perf_counter() - start

    def _keep(self, summary: KVSummary, exact: tuple[int, int]) -> None:
        """Store the compressed context `summary` (the front), whose first and last slots, `exact` = (sink, window) of
        them, are its exact sink and window. At full precision: in a buffer allocated at the compressed size (room for later
        tokens comes with the first of them), or, when its heads keep different numbers of slots (`CachePlan.ragged`,
        AdaKV: empty slots), packed without its empty slots (`RaggedSummary`) but for the sink and the window, which start
        the exact tail. With kv_bits: quantized but for the sink and the window, likewise (`_stored_front`): the sink's
        keys (attention sinks) stay exact rather than set the range of a key group, and its values, which most queries
        attend to, stay exact as well."""
        if self.kv_bits is None and not (self.cache.plan.ragged and has_empty_slots(summary)):
            self.front = SlotBuffer(summary, most=summary.num_slots)
            return
        front, self.tail = split_exact_ends(summary, *exact)
        self.front = self._stored_front(front)

    def _stored_front(self, front: KVSummary) -> QuantizedSummary | QuantizedRaggedSummary | RaggedSummary:
        """A compressed context's front as stored: at full precision packed without its empty slots (`RaggedSummary`);
        with kv_bits quantized, and packed as well where it has empty slots and no normalizer (`QuantizedRaggedSummary`),
        else with its empty slots (`QuantizedSummary`: they cost their codes but set no group's range)."""
        if self.kv_bits is None:
            return RaggedSummary.of(front)
        group_size = self.cache.options.kv_group_size
        if front.normalizer is None and has_empty_slots(front):
            return QuantizedRaggedSummary.of(front, self.kv_bits, group_size)
        return QuantizedSummary.of(front, self.kv_bits, group_size)

    def _exact_slots(self, n: int) -> tuple[int, int]:
        """(sink, window): the exact slots that start and end a compressed context of n tokens (`methods.tokens.exact_ends`)."""
        return exact_ends(n, self.cache.options.sink, self.cache.options.window)

    def _draws_per_row(self, rows: int) -> bool:
        """Whether a batch of `rows` rows must be compressed row by row to give each row its solo summary: a randomized
        method draws from the layer's generator in shapes that depend on the batch, so one call for every row (beams,
        `num_return_sequences`, equal-length contexts) would give each row other draws than it gets alone."""
        return rows > 1 and self.cache.plan.randomized

    def _keep_rows(self, keys, values, positions, queries, scale, real, hidden_states=None, rope_positions=None) -> None:
        """A padded batch, or a randomized method's batch (`_draws_per_row`; real None: no padding): each row's real
        tokens compressed alone (with the generator of a solo run; pre-RoPE keys un-rotated at the row's RoPE positions, `rope_positions` [B or 1, n] when known), stacked with -inf
        padding slots; with kv_bits, or with heads that keep different numbers of slots (`CachePlan.ragged`, AdaKV), the
        stacked fronts stored as `_stored_front` stores them and the stacked sinks and windows the exact tail (as `_keep`)."""
        if self.cache.plan.joint:
            raise ValueError(f"method {self.cache.options.method!r} with one budget over every layer compresses one context at a "
                             "time: a batch whose rows must be compressed apart (padded, or a randomized scorer's) is not supported; "
                             "run the contexts one by one")
        rows, lengths, bits = [], [], set()
        every = torch.arange(keys.shape[2], device=keys.device)
        for b in range(keys.shape[0]):
            index = real[b].nonzero().squeeze(-1) if real is not None else every
            lengths.append(index.numel())
            hidden = hidden_states[b : b + 1, :, index] if hidden_states is not None else None
            rope = None if rope_positions is None else rope_positions[min(b, rope_positions.shape[0] - 1), index]
            rows.append(self._compress_once(
                keys[b : b + 1, :, index], values[b : b + 1, :, index], positions[index], queries[b : b + 1, :, index], scale,
                hidden_states=hidden, rope_positions=rope,
            ))
            bits.add(self.kv_bits)  # the row's, as `_compress_once` resolved them
        if len(bits) > 1:
            raise ValueError(f"the rows of this batch store their contexts in different bits ({sorted(bits, key=str)}): a budget read "
                             "as memory picks each row's storage from its own length (full precision where quantizing buys no slot; "
                             "with kv_bits='auto', 8 or 4 bits); compress them one at a time (kvc.generate does, for a list of contexts)")
        (self.kv_bits,) = bits
        if self.kv_bits is None and not self.cache.plan.ragged:
            self.front = stack_rows(rows)
            return
        parts = [split_exact_ends(row, *self._exact_slots(n)) for row, n in zip(rows, lengths)]
        front = stack_rows([front for front, _ in parts])
        self.front = self._stored_front(front)
        self.tail = stack_rows([exact for _, exact in parts])

    def _compress_once(self, keys, values, positions, queries, scale, attention_mass=None, extra_lse=None, hidden_states=None,
                       rope_positions=None) -> KVSummary:
        options = self.cache.options
        tokens = self._tokens(keys, values, positions, queries, scale, attention_mass, extra_lse, hidden_states, rope_positions)
        budget, self.kv_bits = options.storage_for(tokens.length, tokens.keys.shape[-1], self.dtype)
        self.budgets += [budget] * tokens.keys.shape[0]
        summary = compress_tokens(options.compressor, tokens, budget, options.sink, options.window, self.cache.generator(self.layer_idx))
        return summary.to(self.dtype).checked_eviction()  # model's dtype; eviction_only read once

    def _tokens(self, keys, values, positions, queries, scale, attention_mass=None, extra_lse=None, hidden_states=None,
                rope_positions=None) -> Tokens:
        """The layer's context as the method sees it: keys/values [B,H_kv,n,d] at positions [n] (hidden states
        [B,H_kv,n,d_model] or None); pre-RoPE keys un-rotated at rope_positions [n] (None: `positions`)."""
        b, h, n, _ = keys.shape
        pos = positions.expand(b, h, n)
        return Tokens(
            keys, values, pos, queries, self.cache.pre_rope_keys(keys, positions if rope_positions is None else rope_positions), scale,
            self.layer_idx, self.cache.num_layers, query_positions_for(queries, pos), attention_mass=attention_mass, extra_lse=extra_lse,
            hidden_states=hidden_states,
        )

    def _compress_context(self, keys, values, positions, queries, scale, attention_mass=None, extra_lse=None, hidden_states=None) -> None:
        """Compress the context's prefill (one unpadded forward) and keep it; with one budget over every layer
        (`CachePlan.joint`) the layer hands it to the cache instead, which compresses every layer together once the last
        one has it (`CompressedCache._share_budget`)."""
        if self.cache.plan.joint:
            self.cache._share_budget(self, self._tokens(keys, values, positions, queries, scale, attention_mass, extra_lse, hidden_states))
            return
        summary = self._compress_once(keys, values, positions, queries, scale, attention_mass, extra_lse, hidden_states)
        self._keep(summary, self._exact_slots(keys.shape[2]))

    def load_prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, attention_mass=None,
                     extra_lse=None) -> None:
        """Compress an already computed context prefill (prefill mode): keys/values [B,H_kv,n,d], queries [B,H_q,n,d],
        attention_mass [B,H_kv,n] or None (`Tokens.attention_mass`). A method that needs a reconstruction forward (KVzip)
        takes its reconstruction's queries [B,H_q,q,d] and their own keys' log-sum-exp extra_lse [B,H_q,q]
        (`Tokens.extra_lse`; `integration.reconstruction`) instead of the context's queries: without extra_lse it refuses
        (`Method.check_context`)."""
        if self.cache.options.mode != "prefill" or self.front is not None or self.seen:
            raise ValueError("load_prefill needs a fresh layer of a prefill-mode cache")
        self.cache.options.compressor.check_context(reconstructed=extra_lse is not None)
        keys, values = common_dtype(keys, values)
        self.lazy_initialization(keys, values)
        positions = torch.arange(keys.shape[2], device=keys.device)
        start = time.perf_counter()
        self.seen, self.rows = keys.shape[2], keys.shape[0]
        with autocast_off(keys.device):  # as `CompressedCache.update`
            queries = None if queries is None else queries.to(keys.dtype)
            self._compress_context(keys, values, positions, queries, scale, attention_mass, extra_lse)
        self.stats.compress_seconds += time.perf_counter() - start
        self.stats.peak_bytes = max(self.stats.peak_bytes, 2 * keys.numel() * keys.element_size())

    def nbytes(self) -> int:
        """Bytes of every tensor this layer stores (compressed front, its workspace, exact tail)."""
        front = self.front.nbytes() if self.front is not None else 0
        return front + (self.tail.nbytes() if self.tail is not None else 0)

    def slots(self, row: int | None = None) -> int:
        """Occupied slots per head (finite log-weight), averaged over heads and the batch (or of one batch row), counted
        part by part (`stored()`'s parts, packed ones not unpacked)."""
        parts = self._stored_parts()
        if not parts:
            return 0
        occupied = sum(occupied_slots(part) for part in parts)
        return int((occupied if row is None else occupied[row]).double().mean().round())

    def get_seq_length(self) -> int:
        # Original positions: generation keeps counting tokens seen, not slots stored.
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def _leave_inference_tensors(self) -> None:
        """Before a block is stored: under torch.inference_mode, note that the state may now hold inference tensors;
        outside it, copy a state that may (a stream or buffer written in place: `_frozen`; immutable summaries are
        never written in place) into normal tensors once, since an inference tensor refuses an in-place write outside
        inference mode (a context compressed under it, answered by `model.generate`, which runs under no_grad)."""
        if torch.is_inference_mode_enabled():
            self.holds_inference_tensors = True
        elif self.holds_inference_tensors:
            self.front = _frozen(self.front, self.cache.stream_links())
            self.holds_inference_tensors = False

    def _forget_block(self) -> None:
        """Drop the pending block and the view of it (committed, or left by a forward that stopped before its attention
        committed it: `reset` and `restore` start over without it)."""
        self.pending, self.pending_real, self.pending_rope_positions, self.view, self.view_packed = None, None, None, None, []

    def reset(self) -> None:
        """Empty the layer as a fresh one is: its dtype and device too are taken from the next block."""
        self._forget_block()
        self.refused = None
        self.front = self.tail = self.rows = None
        self.seen = 0
        self.budgets, self.kv_bits = [], None
        self.stats = LayerStats()
        self.is_initialized = False

    def check_rows_can_change(self) -> None:
        """ValueError when the layer's batch rows cannot be selected or repeated: a live stream (decode mode, or a chunked
        prompt) scores its rows as it goes."""
        if isinstance(self.front, Stream):
            raise ValueError(f"beam search reorders the cache rows: supported in mode='prefill', got mode={self.cache.options.mode!r}")

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: keep the batch rows `beam_idx` [B] (a live stream, decode mode or a chunked prompt, cannot be
        reordered)."""
        self.check_rows_can_change()
        if isinstance(self.front, _STORED_FRONTS):
            self.front = self.front.select_rows(beam_idx)
        else:
            front = self.front.summary() if isinstance(self.front, SlotBuffer) else self.front
            self.front = select_rows(front, beam_idx) if front is not None else None
        self.tail = select_rows(self.tail, beam_idx) if self.tail is not None else None
        self.rows = beam_idx.shape[0] if self.rows is not None else None

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' `Cache.crop(-n)`, removing the last n tokens: refused but for crop(0), which changes nothing: what
        compression dropped cannot be told apart from what came after it (assisted generation, prompt lookup). The layer
        then holds tokens its caller meant to drop, so it refuses later forwards until `restore` or `reset`. A positive
        count is refused as transformers refuses it."""
        if tokens_to_remove == 0:
            return
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes minus the number of tokens to remove (transformers refuses a positive count), got "
                             f"crop({tokens_to_remove})")
        self.refused = f"crop({tokens_to_remove})"
        raise ValueError(f"a CompressedCache cannot remove its last {-tokens_to_remove} tokens (crop({tokens_to_remove})): compression "
                         "drops tokens, so it cannot roll back by a count (assisted generation and prompt_lookup_num_tokens crop the "
                         "cache); generate without them, or roll back with cache.restore(cache.snapshot() taken earlier)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each stored batch row `repeats` times in a row, as transformers' layers repeat theirs (a decoding strategy that
        expands the cache after the prompt): the rows `reorder_cache` keeps. A fresh layer has no rows to repeat."""
        self.check_rows_can_change()
        if self.rows is not None:
            self.reorder_cache(torch.arange(self.rows, device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Beam search's row selection (`reorder_cache`), under the name some decoding strategies use: `indices` as
        transformers' layers take them, row numbers (a tensor or a list) or a boolean mask over the rows."""
        indices = torch.as_tensor(indices)
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        self.reorder_cache(indices.long())

    def offload(self):
        """Refused, as `CompressedCache.offload` is."""
        self.cache.offload(self.layer_idx)

    prefetch = offload

    def snapshot(self):
        """The layer's state, to restore() later: a summary is shared (never modified in place), any other front (a live
        stream) copied, the cache's own objects it holds (`CompressedCache.stream_links`) left shared, not copied."""
        return _frozen(self.front, self.cache.stream_links()), self.tail, self.seen, self.rows, list(self.budgets), self.kv_bits

    def restore(self, state) -> None:
        """Take back a `snapshot()`: what is stored, the tokens seen, the rows, the budgets it was compressed to and the
        bits it stores them in."""
        self._forget_block()
        self.refused = None
        front, self.tail, self.seen, self.rows, budgets, self.kv_bits = state
        self.front, self.budgets = _frozen(front, self.cache.stream_links()), list(budgets)
        self.holds_inference_tensors = torch.is_inference_mode_enabled()
        if self.seen and not self.is_initialized:  # restored into a fresh cache: its dtype and device are the state's
            parts = self._stored_parts()
            self.lazy_initialization(parts[0].keys, parts[0].values)

    def export_state(self, prefix: str) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors named under `prefix`, description) of what the layer stores, for `import_state` (`CompressedCache.save`):
        a live stream (decode mode) as the whole state it continues from, a quantized or ragged front and its exact tail
        apart, anything else (a chunked stream among them: a loaded chunked cache's prompt has ended) as the one summary
        `stored()` reads; each written by its schema (`saved_state`)."""
        meta = {"kind": "compressed", "seen": self.seen, "budgets": self.budgets}
        if isinstance(self.front, Stream) and self.cache.options.mode == "decode":
            tensors, described = cache_file.state_tensors(f"{prefix}.stream", _SAVED_STREAM, self.front, self.cache.stream_links())
            return tensors, {**meta, "stream": described, "dtype": str(self.dtype).removeprefix("torch.")}
        if isinstance(self.front, _STORED_FRONTS):
            parts = {"front": self.front, "tail": self.tail}
        else:
            parts = {"stored": self.stored()}
        tensors, described = {}, {}
        for name, part in parts.items():
            if part is not None:
                part_tensors, described[name] = cache_file.state_tensors(f"{prefix}.{name}", _SAVED_SUMMARY, part, {})
                tensors.update(part_tensors)
        return tensors, {**meta, "parts": described}

    def import_state(self, prefix: str, tensors: dict[str, torch.Tensor], meta: dict, device, dtype: torch.dtype, path,
                     dims: dict[str, int]) -> None:
        """Take the state `export_state` described, on `device` in `dtype`: a quantized front and its tail as they were; a
        full-precision state as the front later tokens follow, as after compression in its mode (prefill: a buffer they
        are appended to in place; chunked: an exact tail beside it). A live stream goes on in the dtype it was saved in:
        another `dtype` is refused. Everything is checked against the schema and this cache's settings first
        (CacheFileError naming the file, the layer and the field)."""
        where, options = f"layers.{self.layer_idx}", self.cache.options
        # a decode-mode cache holds live streams; any other what it stores, as one summary or a packed front and its tail (a
        # chunked cache whose file holds its streams keeps their summaries)
        streams = options.mode == "decode" or options.mode == "chunked" and "stream" in meta
        keys = {"kind", "seen", "budgets", *(("stream", "dtype") if streams else ("parts",))}
        if set(meta) != keys or not is_count(meta["seen"], 1):
            raise cache_file.CacheFileError(f"{str(path)!r}: {where} must hold {sorted(keys)} with seen a positive count for a "
                                            f"mode={options.mode!r} cache, got {sorted(meta)} (seen {meta.get('seen')!r})")
        budgets = meta["budgets"]
        if not (isinstance(budgets, list) and len(budgets) == 1 and is_count(budgets[0], 1)):
            raise cache_file.CacheFileError(f"{str(path)!r}: {where}.budgets must be one positive count (one context), got {budgets!r}")
        self.dtype, self.device, self.is_initialized = dtype, torch.device(device), True
        self.seen, self.budgets = meta["seen"], list(budgets)
        read = dict(dims=dims, device=device, path=path)
        if streams:
            if options.mode == "decode" and meta["dtype"] != str(dtype).removeprefix("torch."):
                raise cache_file.CacheFileError(
                    f"{str(path)!r}: this cache holds live decode-mode streams in {meta['dtype']}, which go on absorbing every token in the dtype "
                    f"they were saved in: load it with the model in {meta['dtype']}, not {str(dtype).removeprefix('torch.')}")
            stream = cache_file.state_from(tensors, _SAVED_STREAM, meta["stream"], links=self.cache.stream_links(), where=f"{where}.stream", **read)
            settings = (stream.budget, stream.sink, stream.window, stream.seen)
            if settings != (self._stream_budget(), options.sink, options.window, self.seen):
                raise cache_file.CacheFileError(
                    f"{str(path)!r}: {where}.stream has budget, sink, window and tokens seen {settings}, the cache's settings say "
                    f"{(self._stream_budget(), options.sink, options.window, self.seen)}")
            self.front = stream if options.mode == "decode" else stream.summary().to(device=device, dtype=dtype)
            self.tail = None
        else:
            parts = meta["parts"]
            if not isinstance(parts, dict) or set(parts) not in ({"stored"}, {"front"}, {"front", "tail"}):
                raise cache_file.CacheFileError(f"{str(path)!r}: {where}.parts must be {{stored}} or {{front[, tail]}}, got "
                                                f"{sorted(parts) if isinstance(parts, dict) else parts!r}")
            built = {name: cache_file.state_from(tensors, _SAVED_SUMMARY, part, links={}, where=f"{where}.{name}", **read).to(device=device, dtype=dtype)
                     for name, part in parts.items()}
            if "stored" in built:
                stored = built["stored"]
                if not isinstance(stored, KVSummary):
                    raise cache_file.CacheFileError(f"{str(path)!r}: {where}.stored must be a kv_summary, got {type(stored).saved_name}")
                self.front = SlotBuffer(stored, most=stored.num_slots) if options.mode == "prefill" else stored
                self.tail = None
            else:
                if isinstance(built["front"], KVSummary) or isinstance(built.get("tail"), _STORED_FRONTS):
                    raise cache_file.CacheFileError(f"{str(path)!r}: {where}.front must be a quantized or ragged summary and its "
                                                    "tail a kv_summary")
                self.front, self.tail = built["front"], built.get("tail")
        self._check_loaded(path, dims)
        self.kv_bits = self._loaded_bits()
        self.rows = 1 if self.seen else None
        self.stats.peak_bytes = self.nbytes()
        self.holds_inference_tensors = torch.is_inference_mode_enabled()

    def _loaded_bits(self) -> int | None:
        """The bits a loaded state is stored in: a quantized front's, read from it; a decode stream's, from the settings."""
        front = self.front
        if isinstance(front, QuantizedRaggedSummary):
            return front.bits
        if isinstance(front, QuantizedSummary):
            return front.keys.bits
        if isinstance(front, Stream):  # as the stream was built (`update`)
            return self.cache.options.bits_for(self.cache.stream_length, self.cache.saved_dims["D"], self.dtype)
        return None

    def _check_loaded(self, path, dims: dict[str, int]) -> None:
        """CacheFileError unless what the layer now stores is a summary attention can read: one row of the model's KV heads
        and head dimension, positions in 0..seen-1 (-1 for empty slots, of weight -inf), no NaN or +inf weight."""
        where = f"{str(path)!r}: layers.{self.layer_idx}"
        try:
            s = self.stored()
        except (ValueError, RuntimeError, IndexError, TypeError) as err:
            raise cache_file.CacheFileError(f"{where} holds a state that cannot be read ({err})") from None
        if tuple(s.keys.shape[:2]) != (1, dims["H"]) or s.keys.shape[-1] != dims["D"] or s.values.shape[-1] != dims["V"]:
            raise cache_file.CacheFileError(f"{where} holds keys {list(s.keys.shape)} and values {list(s.values.shape)}, the model "
                                            f"needs [1, {dims['H']}, n, {dims['D']}]")
        empty = torch.isneginf(s.log_weights)
        bad_positions = (s.positions >= self.seen) | (s.positions < 0) & ~(empty & (s.positions == -1))
        if bool(bad_positions.any()) or bool((torch.isnan(s.log_weights) | torch.isposinf(s.log_weights)).any()):
            raise cache_file.CacheFileError(f"{where} holds positions outside 0..{self.seen - 1} or log-weights NaN or +inf")


_SAVED_STREAM = Instance(Stream)
_STORED_FRONTS = (QuantizedSummary, QuantizedRaggedSummary, RaggedSummary)
# fronts attended where they are stored, whose view for a block is the exact tail then the block (`update`)
_PACKED_FRONTS = (QuantizedRaggedSummary, RaggedSummary)
_SAVED_SUMMARY = Instance(KVSummary, *_STORED_FRONTS)


def _frozen(front, shared: dict):
    """front itself if it is an immutable summary (KVSummary or one of _STORED_FRONTS) or None, else a deep copy (a stream or
    buffer that grows in place) in which the objects of `shared` stay themselves: a restored stream still refers to the
    cache's own method and rotary inverse, as a saved one must (`CompressedCache.save` writes them as links)."""
    if front is None or isinstance(front, (KVSummary, *_STORED_FRONTS)):
        return front
    return copy.deepcopy(front, {id(obj): obj for obj in shared.values()})


class SlidingWindowLayer(DynamicSlidingWindowLayer):
    """A sliding-window attention layer (Gemma 2/3): its window is kept exact, never compressed."""

    def __init__(self, sliding_window: int):
        super().__init__(sliding_window=sliding_window)
        self.stats = LayerStats()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' sliding-window update, after two things it does not do: one stored row (a compressed context)
        is shared by every row of a later block (beams, num_return_sequences), as a compressed layer's is, while
        several stored rows refuse another count; and after a block of several tokens the window is kept in storage of
        its own, not as a view of the whole block's keys and values."""
        rows = key_states.shape[0]
        if self.is_initialized and self.keys.shape[0] != rows:
            if self.keys.shape[0] != 1:
                raise ValueError(f"a sliding-window layer holds {self.keys.shape[0]} batch rows and got a block of {rows}: each "
                                 f"row goes on from its own window; give it {self.keys.shape[0]} rows, or a cache of its own")
            self.keys, self.values = (t.expand(rows, *t.shape[1:]) for t in (self.keys, self.values))
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if key_states.shape[2] > 1:
            self.keys, self.values = self.keys.clone(), self.values.clone()
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.nbytes())  # what it stores, as the full cache's window is counted
        return keys, values

    def reset(self) -> None:
        """Empty the window as a fresh one is, its costs too."""
        super().reset()
        self.stats = LayerStats()

    def load_prefill(self, queries, keys, values, scale, attention_mass=None) -> None:
        """Take a recorded prefill of the context: the window keeps its last tokens (the queries and the attention mass,
        which a compressed layer's method may read, have no use here)."""
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
            self.is_initialized = True

    def export_state(self, prefix: str) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors named under `prefix`, description) of the window held, for `import_state`."""
        if not self.is_initialized:
            return {}, {"kind": "sliding", "seen": 0}
        return {f"{prefix}.keys": self.keys, f"{prefix}.values": self.values}, {"kind": "sliding", "seen": self.cumulative_length}

    def import_state(self, prefix: str, tensors: dict[str, torch.Tensor], meta: dict, device, dtype: torch.dtype, path,
                     dims: dict[str, int]) -> None:
        """Take the window `export_state` described, on `device` in `dtype`; CacheFileError for a window that does not fit
        the layer (dims: the model's KV heads H and head dimension D)."""
        seen = meta.get("seen")
        if set(meta) != {"kind", "seen"} or not is_count(seen):
            raise cache_file.CacheFileError(f"{str(path)!r}: {prefix} must hold kind and seen (a count), got {meta!r}")
        if seen:
            keys, values = (tensors.get(f"{prefix}.{name}") for name in ("keys", "values"))
            most = min(seen, self.sliding_window)
            shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) and t.is_floating_point() else None for t in (keys, values)]
            if shapes[0] is None or shapes[0] != shapes[1] or len(shapes[0]) != 4 or shapes[0][:2] != (1, dims["H"]) or \
                    shapes[0][3] != dims["D"] or not 1 <= shapes[0][2] <= most:
                raise cache_file.CacheFileError(f"{str(path)!r}: {prefix} must hold floating keys and values [1, {dims['H']}, w, "
                                                f"{dims['D']}] (the last w <= {most} of {seen} tokens), got shapes {shapes}")
            keys, values = keys.to(device, dtype), values.to(device, dtype)
            self.lazy_initialization(keys, values)
            self.keys, self.values, self.cumulative_length = keys, values, seen
        self.stats.peak_bytes = self.nbytes()


def select_rows(summary: KVSummary, index: torch.Tensor) -> KVSummary:
    """The batch rows `index` [k] of a summary (normalizer included)."""
    index = index.to(summary.keys.device)
    norm = summary.normalizer
    if norm is not None:
        norm = Normalizer(*(t.index_select(0, index) for t in (norm.keys, norm.log_weights, norm.positions)))
    rows = (t.index_select(0, index) for t in (summary.keys, summary.values, summary.log_weights, summary.positions))
    return KVSummary(*rows, normalizer=norm)


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


# `kvc.generate`'s settings for how it feeds a prompt, which a cache built by name (for `model.generate`) cannot honour
_FEEDING_SETTINGS = {
    "chunk_size": "model.generate(..., prefill_chunk_size=N) feeds the prompt in blocks of N (transformers' chunked prefill); "
                  "kvc.generate(..., mode='chunked', chunk_size=N) does too",
    "compress_question": "under model.generate the whole prompt, question included, goes through compression; "
                         "kvc.generate(..., compress_question=...) keeps the question out or compresses it",
    "prefill_approx": "kvc.generate(..., prefill_approx='express') runs the approximate prefill",
}


def refuse_feeding_settings(settings: dict) -> None:
    """ValueError for a setting of how `kvc.generate` feeds a prompt, given to a cache built by name: the cache stores the
    blocks its caller's forwards give it and feeds nothing itself."""
    given = sorted(set(settings) & set(_FEEDING_SETTINGS))
    if given:
        name = given[0]
        raise ValueError(f"CompressedCache(..., {name}={settings[name]!r}): a cache stores the blocks its caller's forwards give it "
                         f"and feeds nothing itself; {_FEEDING_SETTINGS[name]}")


class CompressedCache(Cache):
    """A transformers `Cache` whose full-attention layers store compressed KV; pass it as `past_key_values`.

        cache = CompressedCache(model, "snapkv", compression_ratio=0.5)
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)

    method: a registered method name or a named setting ("default", the default; "kvzip_refit"), with the rest of
    `CompressionOptions` as keyword settings
    (budget or compression_ratio, mode, sink, window, seed, slack, and the method's own
    parameters), or a ready `CompressionOptions` (then no settings). Sliding-window layers (Gemma
    2/3) keep their window exact; a model whose every layer slides is refused (nothing to compress).

    The cache stores the blocks its caller's forwards give it: `model.generate` gives the prompt in one
    forward, or in blocks of N with `model.generate(..., prefill_chunk_size=N)`; kvc.generate's settings
    for feeding a prompt (chunk_size, compress_question, prefill_approx) are refused here. In mode
    "chunked" the prompt ends (`absorbing` set False: what the streams keep stored, later tokens exact) when
    the caller says so or, in a cache built by name, at the first one-token forward: `model.generate`'s
    first step, after the prompt, so the answer stays exact. Such a cache therefore refuses a prompt in one-token
    blocks (`prefill_chunk_size=1`), and a call that never takes a one-token step (`max_new_tokens=1`) leaves its
    prompt open: a later turn is absorbed too.

    stream_length: in chunked and decode modes, the number of tokens the streams will take (prompt,
    and in decode mode the answer too): needed with a compression_ratio, which is resolved against
    it, and by a method that shares one budget over the model's layers (AdaKV with scope "model",
    the default), which shares it by the fraction of the stream kept; optional with a budget
    otherwise. A prefill-mode layer resolves the ratio against the tokens of the forward it
    compresses and takes no stream_length.

    Built from a method name, the cache switches the model to the 'kvcompress' attention
    implementation (`model.set_attn_implementation("kvcompress")`), which attends over compressed
    layers and runs exact SDPA with the usual masks everywhere else, so the model keeps working
    without the cache (without attention weights, as under SDPA: output_attentions=True warns); for a method that reads the layers' hidden states (KVzap, and AdaKV over its
    scores) it also hooks the model's attention modules to keep their inputs for the attention
    function, until the cache is garbage collected (`model_support.keep_hidden_states`); a cache of another method takes
    none of them. Built from
    a CompressionOptions (library use) it leaves the model as is: run it under
    `use_compressed_attention(model)` (and `integration.attention.feeding_hidden_states(model)` for
    such a method), which restore the model on exit.

    token_ids [1, n]: the ids of the n tokens the cache holds when known, None otherwise
    (`kvc.compress_context` and `kvc.generate` set them); `save` stores them with the state, so a
    loaded cache continues after them. `save(path)` / `CompressedCache.load(path, model)`
    (`kvc.load_cache`): docs/design.md, "Saved caches".
    """

    def __init__(self, model, method: "str | CompressionOptions" = DEFAULT_METHOD, *, stream_length: int | None = None, **settings):
        layer_types = check_supported(model)
        if method is None or method == FULL or (isinstance(method, CompressionOptions) and method.method is None):
            raise ValueError(f"method={method!r}: a CompressedCache compresses, and the full cache is transformers' own DynamicCache (what "
                             "model.generate uses when no past_key_values is passed); name a method: 'default' or one of kvcompress.methods()")
        if not isinstance(method, (str, CompressionOptions)):
            raise ValueError(f"method must be a method name (one of kvcompress.methods()) or a CompressionOptions, got {method!r}")
        if isinstance(method, str):
            refuse_feeding_settings(settings)
        try:
            options = CompressionOptions.build(method, **settings) if isinstance(method, CompressionOptions) else CompressionOptions.build(method=method, **settings)
        except UnknownParameters as err:
            decoding, others = decoding_settings(err.names, settings)
            if not decoding:
                raise
            raise ValueError(f"CompressedCache(..., {', '.join(f'{name}={settings[name]!r}' for name in decoding)}): "
                             f"{'it is one of' if len(decoding) == 1 else 'they are'} model.generate's decoding settings, not the "
                             "cache's: pass them to the model.generate call the cache goes to, model.generate(..., past_key_values=cache, "
                             + ", ".join(f"{name}=..." for name in decoding) + ")" + others) from None
        if all(kind != "full_attention" for kind, _ in layer_types):
            windows = sorted({window for _, window in layer_types})
            raise ValueError(
                f"every layer of this model slides (sliding_window={', '.join(map(str, windows))} tokens"
                + ("" if getattr(model.config, "max_position_embeddings", None) is None else
                   f", below its max_position_embeddings={model.config.max_position_embeddings}") + "): kvcompress compresses "
                "full-attention layers and keeps a sliding window exact, so nothing would be compressed; use the full cache")
        if options.streams and options.compression_ratio is not None and stream_length is None:
            raise ValueError(
                f"mode={options.mode!r} with compression_ratio={options.compression_ratio}: pass stream_length (the tokens the "
                "streams will take) to resolve the ratio against, or a budget"
            )
        if options.streams and stream_length is not None:
            options.token_budget_for(as_count("stream_length", stream_length, 1))
        elif options.streams and options.budget is not None:  # a method whose layers' shares need the stream's length refuses now
            options.compressor.layer_budget(options.budget, 0, None)
        elif stream_length is not None:
            raise ValueError(f"stream_length={stream_length!r} is the tokens a stream will take; mode={options.mode!r} streams "
                             "nothing and takes none")
        self.options, self.stream_length = options, stream_length
        # built by name (the `model.generate` route), a chunked prompt ends at the first one-token forward (the first step)
        self.prompt_ends_at_first_step = isinstance(method, str) and options.mode == "chunked"
        # ... and streams that take more tokens than the stream_length their ratio was resolved against say so, once
        self.warns_past_stream_length = isinstance(method, str) and options.streams and options.compression_ratio is not None
        self.token_ids: torch.Tensor | None = None
        self._model = weakref.ref(model)  # for the fingerprint save() writes; the cache does not keep the model alive
        config = model.config.get_text_config(decoder=True)
        self.num_layers = config.num_hidden_layers
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # the model's dimensions a saved state must have (`saved_state` shapes: batch, KV heads, query heads, head dims,
        # hidden size)
        self.saved_dims = {"B": 1, "H": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                           "Q": config.num_attention_heads, "D": head_dim, "V": head_dim, "M": config.hidden_size,
                           "vocab": config.vocab_size}
        self._absorbing = True
        self._waiting: dict[int, Tokens] = {}  # layer -> its context, until every layer has one (`_share_budget`)
        self.progress = None  # a tqdm bar ticked once per layer forward, set by kvc.generate on long prompts
        self.plan = CachePlan.of(options.compressor)
        rope = length_dependent_rope(model)
        if self.plan.pre_rope_keys and options.streams and rope is not None and (stream_length is None or stream_length > rope[1]):
            raise ValueError(
                f"method {options.method!r} in mode={options.mode!r} un-rotates the keys its streams hold, piece by piece with the "
                f"frequencies the pieces' own positions select, and this model's RoPE ({rope[0]!r}) picks its frequencies from "
                f"the length a forward reaches, switching past {rope[1]} positions: keys rotated for one side of that length "
                f"would be un-rotated with the other's; pass a stream_length within {rope[1]} tokens (got {stream_length}), use "
                "mode='prefill', or a method that reads no pre-RoPE keys")
        drop = cache_dropping_length(model)
        if isinstance(method, str) and drop is not None:
            warnings.warn(f"this model's model.generate drops the cache it is given when the sequence first passes "
                          f"original_max_position_embeddings={drop} tokens, to recompute it with its long RoPE factors: a prompt "
                          f"past {drop} tokens is then not compressed at all, and an answer crossing it goes on uncompressed; "
                          f"kvc.generate refuses what would cross it", UserWarning, stacklevel=2)
        self._unrotate = RotaryInverse(model) if self.plan.pre_rope_keys else None
        layers = [
            CompressedLayer(self, i) if kind == "full_attention" else SlidingWindowLayer(window)
            for i, (kind, window) in enumerate(layer_types)
        ]
        super().__init__(layers=layers)
        options.compressor.check_model(tuple(i for i, (kind, _) in enumerate(layer_types) if kind == "full_attention"),
                                       self.saved_dims["H"], self.saved_dims["M"])
        # built by name, a cache of a method that reads the layers' inputs (KVzap) has the model keep them while it lives
        self.keeps_hidden_states = isinstance(method, str) and self.plan.hidden_states
        if isinstance(method, str):
            select_compressed_attention(model, keep=True)
        self._hold_hidden_states()

    def _hold_hidden_states(self) -> None:
        """While this cache lives, the model keeps its layers' input hidden states, when `keeps_hidden_states`."""
        model = self._model()
        if self.keeps_hidden_states and model is not None:
            weakref.finalize(self, release_hidden_states, keep_hidden_states(model))

    def __deepcopy__(self, memo) -> "CompressedCache":
        """A copy of every state; one that keeps the model's hidden states (`keeps_hidden_states`) keeps them while it
        lives, as the original does while it lives."""
        copied = self.__class__.__new__(self.__class__)
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            setattr(copied, name, copy.deepcopy(value, memo))
        for layer in copied.layers:  # a weak reference is copied as it is: each copied layer belongs to the copy
            if isinstance(layer, CompressedLayer):
                layer._cache = weakref.ref(copied)
        copied._hold_hidden_states()
        return copied

    def __reduce_ex__(self, protocol):
        """Refused: the cache refers to its model, which is not part of it (pickle, copy.copy)."""
        raise TypeError("a CompressedCache cannot be pickled or shallow-copied: it refers to its model, which it does not hold; "
                        "cache.save(path) writes its state to a file that kvc.load_cache(path, model) reads back, and "
                        "copy.deepcopy(cache) copies it in memory")

    def offload(self, layer_idx: int, only_non_sliding: bool = True):
        """Refused, as `prefetch` is: transformers' offloaded caches move layers between devices, which a compressed
        cache, the smaller one already, does not do."""
        raise NotImplementedError(f"layer_idx={layer_idx}: a CompressedCache keeps its layers on the model's device and does not "
                                  "offload or prefetch them (transformers' offloaded caches do); cache.save(path) writes its state "
                                  "to a file")

    prefetch = offload

    def early_initialization(self, batch_size: int, num_heads, head_dim, dtype: torch.dtype, device) -> None:
        """Refused: transformers' export recipes initialise a cache's tensors before the first forward, and a compressed
        cache's storage is shaped by what its method keeps, known only once blocks come (it is built lazily)."""
        raise NotImplementedError("a CompressedCache shapes its storage from the blocks it is given (what its method keeps), so it "
                                  "cannot be initialised in advance (early_initialization, for torch.export recipes); run the model "
                                  "with it as it is")

    def _rows_can_change(self) -> None:
        """ValueError, before any layer changes, when a compressed layer's rows cannot be selected or repeated."""
        for layer in self.layers:
            if isinstance(layer, CompressedLayer):
                layer.check_rows_can_change()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: keep the batch rows `beam_idx` [B] in every layer (refused before any layer changes in a streaming
        mode: `CompressedLayer.reorder_cache`)."""
        self._rows_can_change()
        super().reorder_cache(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """`reorder_cache` under the name some decoding strategies use (`CompressedLayer.batch_select_indices`)."""
        self._rows_can_change()
        super().batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each batch row `repeats` times in every layer (`CompressedLayer.batch_repeat_interleave`)."""
        self._rows_can_change()
        super().batch_repeat_interleave(repeats)

    def reset(self) -> None:
        """Empty every layer and start a new prompt: a chunked cache absorbs the next prompt into its streams again."""
        super().reset()
        self._absorbing, self._waiting, self.token_ids = True, {}, None

    @property
    def absorbing(self) -> bool:
        """Chunked mode: True while blocks go through each layer's stream (the prompt)."""
        return self._absorbing

    @absorbing.setter
    def absorbing(self, value: bool) -> None:
        """Setting it False ends the prompt: what every stream keeps is stored as a compressed context
        (`CompressedLayer.compact`; with kv_bits, quantized). The prompt cannot start again: setting it True afterwards
        is an error."""
        if value and not self._absorbing:
            raise ValueError("the prompt has ended (absorbing was set False): the streams are stored and later tokens stay exact, "
                             "so absorbing cannot be set True again; build a new cache for a new prompt")
        if self._absorbing and not value:
            for layer in self.layers:
                if isinstance(layer, CompressedLayer):
                    layer.compact()
        self._absorbing = value

    @classmethod
    def from_prefill(cls, model, options: CompressionOptions, captured: dict) -> "CompressedCache":
        """A prefill-mode cache built from one recorded full prefill of the context.

        captured: {layer: (queries, keys, values)} for every layer, post-RoPE (as
        `kvcompress.eval.capture.capture_qkv` returns them; queries None for a method that reads none), optionally
        with a fourth tensor, the
        attention mass [B,H_kv,n] the capture's prefill computed, handed on to the method (a method
        that does not score with it, `Requirements.inputs`, ignores it). One prefill then serves any number of methods and
        ratios: each gets its own compressed copy. The tensors are moved to the model's device
        (`capture_qkv` records CPU copies), so the cache is built and held where the model runs.
        """
        cache = cls(model, options)
        if sorted(captured) != list(range(cache.num_layers)):
            raise ValueError(f"captured must hold every layer 0..{cache.num_layers - 1}")
        scales = attention_scales(model)
        device = next(model.parameters()).device
        for layer, (queries, keys, values, *mass) in captured.items():
            mass = mass[0].to(device) if mass else None
            queries = queries.to(device) if queries is not None else None
            cache.layers[layer].load_prefill(queries, keys.to(device), values.to(device), scales[layer], mass)
        return cache

    def check_same_model(self, model) -> None:
        """CacheFileError when `model` is another model object than the one this cache was built (or loaded) for and
        their fingerprints differ (`cache_file.check_model`, as a saved file is checked: shapes, RoPE, sampled weights);
        a second instance of the same weights passes. Nothing to compare once that model is gone."""
        built = self._model()
        if built is not None and built is not model:
            cache_file.check_model(cache_file.model_fingerprint(built), model, None)

    def save(self, path: str | os.PathLike, token_ids: torch.Tensor | None = None) -> None:
        """Write the compressed context to `path`, one safetensors file (docs/design.md, "Saved caches").

        The file holds every layer's state as stored (quantized where kv_bits made it so), the
        token ids it stands for, the compression settings, and the fingerprint of the model it was
        made with; `CompressedCache.load(path, model)` (`kvc.load_cache`) reads it back, and it
        answers as this cache does. token_ids [1, n]: the ids of the n tokens held (default:
        `self.token_ids`). One context (batch size 1). A decode-mode cache saves its live streams whole (every
        later token goes on through them after `load`, as here); a chunked-mode cache is saved once its prompt has
        ended (`absorbing` set False, as `kvc.compress_context` does), not compacted behind the caller's back.
        """
        model = self._model()
        if model is None:
            raise ValueError("the model this cache was built with has been deleted: save the cache while its model is alive")
        if self.options.mode == "chunked" and self.absorbing:
            raise ValueError(
                "this mode='chunked' cache holds live streams that keep absorbing its prompt: it can be saved once the prompt has "
                "ended (cache.absorbing = False stores what its streams keep, as kvc.compress_context does)"
            )
        seen = self.get_seq_length()
        if seen == 0:
            raise ValueError("the cache holds no tokens yet: compress a context first (kvc.compress_context)")
        ids = self.token_ids if token_ids is None else token_ids
        if ids is None:
            raise ValueError(f"the cache does not know the ids of the {seen} tokens it holds: pass token_ids=[1, {seen}]")
        # what `load` refuses, refused before the file is written (and stored as int32)
        check_token_ids("token_ids", ids, f"[1, {seen}] (one context, the tokens the cache holds)", self.saved_dims["vocab"], rows=1)
        if ids.shape[1] != seen:
            raise ValueError(f"token_ids must be an integer tensor [1, {seen}] (one context, the tokens the cache holds), got {describe(ids)}")
        stored = next((layer.stored() for layer in self.layers if isinstance(layer, CompressedLayer)), None)
        if stored is not None and stored.keys.shape[0] != 1:
            raise ValueError(f"a saved cache holds one context (batch size 1), this cache holds a batch of {stored.keys.shape[0]}")
        options = self.options.to_dict()
        try:
            kept = CompressionOptions(**json.loads(json.dumps(options))) == self.options
        except TypeError:
            kept = False
        if not kept:
            raise ValueError(f"the settings {options} do not survive JSON (e.g. a method parameter that is not a number, string or bool); "
                             "a cache with them cannot be saved")
        tensors, layers = {"token_ids": ids.to(torch.int32)}, []
        for i, layer in enumerate(self.layers):
            layer_tensors, meta = layer.export_state(f"layers.{i}")
            tensors.update(layer_tensors)
            layers.append(meta)
        document = {"options": options, "stream_length": self.stream_length, "model": cache_file.model_fingerprint(model), "layers": layers,
                    "method_files": self.options.compressor.file_digests()}
        cache_file.write(path, tensors, document)

    @classmethod
    def load(cls, path: str | os.PathLike, model) -> "CompressedCache":
        """The cache `save` wrote to `path`, on `model`'s devices in its dtype, with its token ids (`token_ids`).

        Refuses (`cache_file.CacheFileError`, a ValueError) a file that is truncated, corrupted, not
        a kvcompress cache or of another format version, and a model other than the one the cache
        was made with (its class, layer and head shapes, RoPE, and a sample of its weights: the
        same checkpoint in another dtype is the same model). Switches the model to the 'kvcompress'
        attention implementation, as a cache built from a method name does.
        """
        if isinstance(path, torch.nn.Module):
            raise ValueError(f"path must be the saved file's path, got a {type(path).__name__}: the path comes first, then the model")
        check_supported(model)  # before the file is read against it (e.g. a tokenizer given for the model)
        tensors, document = cache_file.read(path)
        where = f"{str(path)!r}"
        cache_file.check_model(document["model"], model, path)
        options = document["options"]
        try:
            cache = cls(model, CompressionOptions(**options), stream_length=document["stream_length"])
        except (TypeError, ValueError) as err:
            raise cache_file.CacheFileError(f"{where} holds settings this kvcompress does not accept ({err}): options {options!r}, "
                                            f"stream_length {document['stream_length']!r}") from None
        # a decode-mode cache goes on scoring every later token: with the weights it was made with (files before the
        # record are taken as they are); the other modes only read what they store
        recorded, current = document.get("method_files"), cache.options.compressor.file_digests()
        if cache.options.mode == "decode" and recorded is not None and recorded != current:
            raise cache_file.CacheFileError(
                f"{where} was compressed by {options['method']!r} with weights of checksums {recorded}; the files its settings name "
                f"now hold {current} (a scorer file replaced or trained again at the same path): the cache would go on with other "
                "weights than it was made with; compress the context again")
        layers, ids = document["layers"], tensors.get("token_ids")
        if not isinstance(layers, list) or len(layers) != len(cache.layers) or not all(isinstance(m, dict) for m in layers):
            raise cache_file.CacheFileError(f"{where} must describe the model's {len(cache.layers)} layers, one object each")
        kinds = ["sliding" if isinstance(layer, SlidingWindowLayer) else "compressed" for layer in cache.layers]
        if [m.get("kind") for m in layers] != kinds:
            raise cache_file.CacheFileError(f"{where} describes layers of kinds {[m.get('kind') for m in layers]}, the model's are {kinds}")
        seen = {m.get("seen") for m, kind in zip(layers, kinds) if kind == "compressed"}
        if len(seen) != 1 or not isinstance(ids, torch.Tensor) or ids.dtype != torch.int32 or tuple(ids.shape) != (1, *seen):
            raise cache_file.CacheFileError(f"{where} must hold token_ids, int32 [1, n], for the n tokens every compressed layer has "
                                            f"seen; got {describe(ids)} and layers that have seen {sorted(seen, key=str)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cache.saved_dims["vocab"]):
            raise cache_file.CacheFileError(f"{where} holds token ids outside the model's vocabulary 0..{cache.saved_dims['vocab'] - 1}")
        devices = {m.layer_idx: next(m.parameters()).device for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")}
        for i, (layer, meta) in enumerate(zip(cache.layers, layers)):
            layer.import_state(f"layers.{i}", tensors, meta, devices[i], model.dtype, path, cache.saved_dims)
        if cache.options.mode != "decode":
            cache.absorbing = False  # the prompt has ended: nothing streams any more, later tokens stay exact
        cache.token_ids = ids.long().to(devices[0])
        select_compressed_attention(model, keep=True)
        return cache

    def activate_past_recording(self) -> None:
        """transformers' call before assisted generation (an assistant model, `prompt_lookup_num_tokens`), which checks
        draft tokens in the cache's forwards and crops the ones it rejects: refused before any token is fed, since a
        compressing cache would compress the drafts with the prompt they follow, and no cache of this kind takes a
        token back (`crop`), not even at ratio 0."""
        ratio = self.options.compression_ratio
        setting = f"compression_ratio={ratio}" if ratio is not None else f"budget={self.options.budget}"
        raise ValueError(f"a CompressedCache ({setting}) cannot serve assisted generation (assistant_model, prompt_lookup_num_tokens): "
                         "transformers checks the draft tokens in the cache's forwards, so they would be compressed with the prompt, "
                         "and a rejected one cannot be taken back; generate without them, or with transformers' own cache")

    def crop(self, tokens_to_remove: int) -> None:
        """`CompressedLayer.crop`'s refusal, before any layer is cropped (a sliding-window layer ahead of the first compressed
        one would otherwise drop its tokens first): every compressed layer then refuses later forwards until `restore` or
        `reset`."""
        compressed = [layer for layer in self.layers if isinstance(layer, CompressedLayer)]
        if tokens_to_remove < 0 and compressed and self.get_seq_length() == 0:
            return  # nothing held, nothing to remove (as transformers' caches do)
        if tokens_to_remove < 0 and compressed:
            for layer in compressed[1:]:
                layer.refused = f"crop({tokens_to_remove})"
            compressed[0].crop(tokens_to_remove)
        super().crop(tokens_to_remove)

    def _share_budget(self, layer: CompressedLayer, tokens: Tokens) -> None:
        """Hold `layer`'s context until every compressed layer has handed in its own, then compress them together
        (`methods.base.compress_layers`: one budget over every layer's heads) and keep each layer's share. Until then
        the layers hold their whole context (counted in their peak bytes, as a prefill does). The joint compression's
        time is counted by the layer whose context completes the set."""
        self._waiting[layer.layer_idx] = tokens
        compressed = [item for item in self.layers if isinstance(item, CompressedLayer)]
        if len(self._waiting) < len(compressed):
            return
        waiting, self._waiting = self._waiting, {}
        options, n = self.options, tokens.length
        budget, bits = options.storage_for(n, tokens.keys.shape[-1], tokens.keys.dtype)
        summaries = compress_layers(options.compressor, [waiting[item.layer_idx] for item in compressed], budget, options.sink,
                                    options.window, [self.generator(item.layer_idx) for item in compressed])
        for item, summary in zip(compressed, summaries):
            item.budgets += [budget] * tokens.keys.shape[0]
            item.kv_bits = bits
            item._keep(summary.to(item.dtype).checked_eviction(), item._exact_slots(n))

    @property
    def kv_bits(self) -> int | None:
        """The bits the compressed context is stored in (`CompressedLayer.kv_bits`; None: full precision, as a budget read
        as memory that holds the context at full precision leaves it)."""
        return next((layer.kv_bits for layer in self.layers if isinstance(layer, CompressedLayer) and layer.kv_bits is not None), None)

    def snapshot(self) -> "CacheSnapshot":
        """Every layer's state (cheap: stored tensors are shared) and where the prompt stands, for restore(): e.g. right
        after a context is compressed."""
        return CacheSnapshot([layer.snapshot() for layer in self.layers], self._absorbing, dict(self._waiting), self.token_ids,
                             [replace(layer.stats) for layer in self.layers])

    def restore(self, snapshot: "CacheSnapshot") -> None:
        """Roll the cache back to a snapshot(): later tokens are forgotten, and so are their costs (the peak bytes and
        compression seconds since), the compressed context is reused as is, and a chunked prompt that was still
        streaming when the snapshot was taken streams again."""
        if not isinstance(snapshot, CacheSnapshot):
            raise ValueError(f"snapshot must be what cache.snapshot() returned, got {type(snapshot).__name__}")
        for layer, state, stats in zip(self.layers, snapshot.layers, snapshot.stats):
            layer.restore(state)
            layer.stats = replace(stats)
        self._absorbing, self._waiting, self.token_ids = snapshot.absorbing, dict(snapshot.waiting), snapshot.token_ids

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """`Cache.update`; the first layer's block first checks that every compressed layer can take its batch rows
        (`CompressedLayer.check_rows`), so a refused block changes no layer, sliding-window layers included."""
        if layer_idx == 0:
            for layer in self.layers:
                if isinstance(layer, CompressedLayer):
                    layer.check_rows(key_states.shape[0])
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def stream_links(self) -> dict:
        """What a live stream holds of the cache itself (its method and the methods it is made of, its rotary inverse),
        which a saved stream refers to by name (`saved_state.Linked`) rather than stores."""
        method = self.options.compressor
        return {"method": method, **method.parts(), "unrotate": self._unrotate}

    def generator(self, layer_idx: int) -> torch.Generator:
        return make_generator((self.options.seed * 100003 + layer_idx) % 2**64)

    def pre_rope_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """Pre-RoPE keys of post-RoPE keys [B,H,n,d] at positions [n] or [B,H,n] (`RotaryInverse`); None when the method needs none."""
        return self._unrotate(keys, positions) if self._unrotate is not None else None

    def middle_budget(self, row: int = 0) -> int | None:
        """The middle budget batch row `row` was compressed to (the first compressed layer's; None before compression)."""
        budgets = next((layer.budgets for layer in self.layers if isinstance(layer, CompressedLayer) and layer.budgets), None)
        return budgets[row] if budgets is not None else None

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def __repr__(self) -> str:
        """What the cache holds: its method and mode, the bits it stores (as set before anything is stored, as resolved
        after), the tokens it has seen, the slots per KV head its layers keep (least..most over the layers) and the bytes
        it stores (transformers' own repr lists the layers' class names only)."""
        slots, tokens = self.slots_per_layer(), self.get_seq_length()
        kept = f"{min(slots):.0f}..{max(slots):.0f}" if slots else "-"  # a batch's: the mean over its rows
        bits = self.kv_bits if tokens else self.options.kv_bits  # once compressed, what is stored ("auto" resolved)
        storage = "" if bits is None else f", kv_bits={bits}"
        return (f"CompressedCache(method={self.options.method!r}, mode={self.options.mode!r}{storage}, tokens={tokens}, "
                f"slots={kept} per KV head, stored_bytes={self.nbytes()})")

    def peak_bytes(self) -> int:
        return sum(layer.stats.peak_bytes for layer in self.layers)

    def slots_per_layer(self, row: int | None = None) -> list[int]:
        """Occupied slots per KV head in each layer (averaged over the batch, or of one batch row)."""
        return [layer.slots(row) for layer in self.layers]

    def compress_seconds(self) -> float:
        return sum(layer.stats.compress_seconds for layer in self.layers)


def load_cache(path: str | os.PathLike, model) -> CompressedCache:
    """The compressed cache saved at `path` (`CompressedCache.save`), for `model`: `CompressedCache.load`."""
    return CompressedCache.load(path, model)

