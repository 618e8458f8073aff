"""KVzip's context reconstruction: the forward that scores a prefilled context (`methods/kvzip.py`).

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv:2505.23416;
docs/design.md, "KVzip: scoring by reconstruction".

`reconstruct_context(model, cache, context_ids)` fills a fresh prefill-mode `CompressedCache`:
1. the context is prefilled once into a transient `DynamicCache` (every layer's post-RoPE keys
   and values, the last position's logits);
2. the context is fed back in chunks of the method's `reconstruction_chunk_size` tokens, each forward over
   [repeat instruction + chunk] with the whole context cache in place (positions continue after
   the context); the cache is cropped back to the context after each chunk, so each chunk's
   queries see the context and their own forward only. A recording attention function
   (`model_support.recording_attention`) records, for every compressed layer, the post-RoPE
   queries of the chunk's tokens and the log-sum-exp of
   their scores over their own forward's causal keys (`methods.kvzip.own_lse`), and computes the
   attention exactly as the model's own (SDPA with the model's masks);
3. each layer is compressed from the context's keys and values with those queries
   (`CompressedLayer.load_prefill(..., extra_lse=...)`); sliding-window layers keep their window.

The reconstruction forwards' time is compression time: it is added to the compressed layers'
`LayerStats.compress_seconds` (so `cache.compress_seconds()` and `GenerationResult.compress_seconds`
count it), besides the layers' own scoring and selection. What it costs is returned as
`ReconstructionStats`.

Steps 1-2 are what costs: `record_reconstruction` runs them once and keeps what step 3 needs (a
`RecordedReconstruction`), and `load_reconstruction` does step 3 for any fresh cache of a KVzip-scored
method with the same chunk size, so one context serves several ratios and methods (the evaluation
sweep, `generate_ids(prefill=recorded)`); `reconstruct_context` is the two in a row.

Soft-capped attention (Gemma 2) is refused: KVzip's scores are plain
softmax probabilities. One unpadded batch (every row the same length); a padded batch is refused
by the caller (`kvc.generate`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from ..cache import CompressedCache, CompressedLayer
from ..checks import describe
from ..methods.kvzip import own_lse
from ..model_support import attention_scales, recording_attention
from ..options import CompressionOptions
from .attention import exact_attention_with_mask, refuse_dropout
from .model import build_prompt, logits_to_keep

REPEAT_INSTRUCTION = "Repeat the previous context exactly."


@dataclass
class ReconstructionStats:
    """What one context's reconstruction cost: the chunk forwards run, the tokens they fed (instruction
    included), their seconds (counted as compression time), the largest transient KV bytes the
    reconstruction's DynamicCache held (context + instruction + one chunk, every layer): a working
    buffer freed once the layers are compressed, not part of the compressed cache's bytes; and the
    seconds of the context's own forward before them."""

    forwards: int
    tokens: int
    seconds: float
    peak_kv_bytes: int
    context_seconds: float


def with_repeat_prompt(options: CompressionOptions, tokenizer) -> CompressionOptions:
    """`options` with KVzip's repeat instruction rendered by `tokenizer` (`repeat_prompt_ids`) as their
    `repeat_prompt_ids`, when their method is scored by a reconstruction forward and they name none; else `options`."""
    if options.method is None or options.repeat_prompt_ids is not None or not options.compressor.requirements.needs("reconstruction"):
        return options
    return replace(options, repeat_prompt_ids=tuple(repeat_prompt_ids(tokenizer)[0].tolist()))


def options_prompt_ids(options: CompressionOptions) -> torch.Tensor | None:
    """[1, m]: the repeat instruction `options` name (`CompressionOptions.repeat_prompt_ids`), None when they name none."""
    return None if options.repeat_prompt_ids is None else torch.tensor([options.repeat_prompt_ids])


def repeat_prompt_ids(tokenizer, instruction: str = REPEAT_INSTRUCTION) -> torch.Tensor:
    """[1, m]: the ids that follow a context (`build_prompt`'s context part) to ask for its repetition: the
    instruction as a question after a blank line, then the end of the user turn and the assistant header
    through the tokenizer's chat template (the plain text where it has none)."""
    if not isinstance(instruction, str) or not instruction.strip():
        raise ValueError(f"instruction must be a non-empty str, got {instruction!r}")
    return build_prompt(tokenizer, "", instruction, layout="blank_line")[1]


class _Recorder:
    """The attention function of the reconstruction forwards: exact attention, and for each compressed layer of
    a chunk forward the chunk's queries and their own keys' log-sum-exp."""

    def __init__(self, layers: set[int]):
        self.layers = layers
        self.context = 0  # tokens of the context in the cache before the forward
        self.offset: int | None = None  # instruction tokens before the chunk's tokens; None: the context's own forward
        self.queries: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
        self.lse: dict[int, list[torch.Tensor]] = {i: [] for i in layers}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        softcap = kwargs.pop("softcap", None)
        refuse_dropout(dropout, "KVzip's scoring forward")
        if softcap is not None:
            raise ValueError("method 'kvzip' scores with plain softmax attention; this model soft-caps its attention logits "
                             "(Gemma 2), which KVzip's scores do not model: use another method")
        if self.offset is not None and module.layer_idx in self.layers:
            own = key[:, :, self.context :]
            chunk_queries = query[:, :, self.offset :]
            self.queries[module.layer_idx].append(chunk_queries)
            self.lse[module.layer_idx].append(own_lse(chunk_queries, own, scaling, self.offset))
        return exact_attention_with_mask(module, query, key, value, attention_mask, scaling, softcap, **kwargs)


def _kv_bytes(cache) -> int:
    return sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in cache.layers if layer.is_initialized)


def _check(cache, context_ids, prefix_ids) -> None:
    if not isinstance(cache, CompressedCache) or cache.options.mode != "prefill" or cache.get_seq_length():
        raise ValueError(f"reconstruct_context fills a fresh prefill-mode CompressedCache, got {cache!r}")
    if not cache.options.compressor.requirements.needs("reconstruction"):
        raise ValueError(f"method {cache.options.method!r} does not score with a reconstruction forward (only e.g. 'kvzip' does)")
    for name, ids, least in (("context_ids", context_ids, 1), ("prefix_ids", prefix_ids, 0)):
        if ids is None and name == "prefix_ids":
            continue
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[1] < least or ids.is_floating_point():
            raise ValueError(f"{name} must be an integer tensor [B, n] with n >= {least}, got {describe(ids)}")
    if prefix_ids is not None and prefix_ids.shape[0] not in (1, context_ids.shape[0]):
        raise ValueError(f"prefix_ids must have 1 row or the context's {context_ids.shape[0]}, got {prefix_ids.shape[0]}")


@dataclass
class RecordedReconstruction:
    """One context's prefill and reconstruction forwards (module docstring, steps 1-2), recorded once by
    `record_reconstruction` so that any number of KVzip-scored caches (other methods built on KVzip's scores,
    other ratios) compress that context without running the model again (`load_reconstruction`).

    context_ids [B, n] and prefix_ids [B, m] (the repeat instruction; m = 0 without one): what was run;
    chunk_size: context tokens repeated per forward; logits [B, V]: the context's last position's;
    keys, values: every layer's context keys and values [B, H_kv, n, d], post-RoPE; queries, lse: for each
    layer a cache compresses (`layers`), the reconstruction's queries of the repeated context [B, H_q, n, d]
    and their own keys' log-sum-exp [B, H_q, n]; stats: what the forwards cost (`stats.seconds`, the
    reconstruction forwards, is counted as compression time by every cache loaded from it).
    """

    context_ids: torch.Tensor
    prefix_ids: torch.Tensor
    chunk_size: int
    logits: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    queries: dict[int, torch.Tensor]
    lse: dict[int, torch.Tensor]
    stats: ReconstructionStats

    def check_matches(self, context_ids: torch.Tensor, prefix_ids: torch.Tensor | None) -> None:
        """Refuse context_ids [B, n] and prefix_ids [1 or B, m] or None other than the ones recorded."""
        prefix = context_ids[:, :0] if prefix_ids is None else prefix_ids.expand(context_ids.shape[0], -1)
        for name, given, recorded in (("context_ids", context_ids, self.context_ids), ("repeat_prompt_ids", prefix, self.prefix_ids)):
            if given.shape != recorded.shape or not torch.equal(given.to(recorded.device), recorded):
                raise ValueError(f"the recorded reconstruction was made for other {name}: recorded {describe(recorded)}, "
                                 f"given {describe(given)}; record this context with record_reconstruction")


def _compressed_layers(cache: CompressedCache) -> set[int]:
    return {i for i, layer in enumerate(cache.layers) if isinstance(layer, CompressedLayer)}


@torch.inference_mode()
def record_reconstruction(model, cache: CompressedCache, context_ids: torch.Tensor,
                          prefix_ids: torch.Tensor | None = None) -> RecordedReconstruction:
    """Prefill context_ids [B, n] (unpadded) and run KVzip's reconstruction forwards for caches like `cache` (a fresh
    prefill-mode `CompressedCache` of a method scored by a reconstruction forward: its layers and its method's
    `reconstruction_chunk_size` say what is recorded; the cache itself is left untouched).

    prefix_ids [1 or B, m]: the repeat instruction placed before each chunk of the repeated context
    (`repeat_prompt_ids`); None: the one the cache's options name (`CompressionOptions.repeat_prompt_ids`; without
    one, the context is repeated with no instruction).
    """
    from transformers import DynamicCache

    prefix_ids = options_prompt_ids(cache.options) if prefix_ids is None else prefix_ids
    _check(cache, context_ids, prefix_ids)
    device = next(model.parameters()).device
    context_ids = context_ids.to(device)
    rows, n = context_ids.shape
    prefix = (prefix_ids if prefix_ids is not None else context_ids[:, :0]).to(device).expand(rows, -1)
    chunk_size = cache.options.compressor.reconstruction_chunk_size
    recorder = _Recorder(_compressed_layers(cache))
    with recording_attention(model, recorder):
        start = time.perf_counter()
        past = DynamicCache()
        logits = model(context_ids, past_key_values=past, use_cache=True, **logits_to_keep(model, last=True)).logits[:, -1]
        context_kv = [(layer.keys, layer.values) for layer in past.layers]
        context_seconds = time.perf_counter() - start
        recorder.context, recorder.offset = n, prefix.shape[1]
        start, forwards, peak = time.perf_counter(), 0, _kv_bytes(past)
        for chunk in context_ids.split(chunk_size, dim=1):
            model(torch.cat([prefix, chunk], 1), past_key_values=past, use_cache=True, **logits_to_keep(model, last=False))  # for its attention only
            peak = max(peak, _kv_bytes(past))
            past.crop(n - past.get_seq_length())  # back to the context (a negative count removes the chunk's tokens)
            forwards += 1
        seconds = time.perf_counter() - start
    del past
    return RecordedReconstruction(
        context_ids=context_ids, prefix_ids=prefix, chunk_size=chunk_size, logits=logits,
        keys=[keys for keys, _ in context_kv], values=[values for _, values in context_kv],
        queries={i: torch.cat(recorder.queries[i], 2) for i in recorder.layers},
        lse={i: torch.cat(recorder.lse[i], 2) for i in recorder.layers},
        stats=ReconstructionStats(forwards, n + forwards * prefix.shape[1], seconds, peak, context_seconds),
    )


def shared_reconstruction(model, options: CompressionOptions, context_ids: torch.Tensor,
                          recorded: dict[int, RecordedReconstruction]) -> RecordedReconstruction:
    """The recorded reconstruction of context_ids [B, n] for the chunk size of `options`' method (a method scored by a
    reconstruction forward), with their repeat instruction: taken from `recorded` ({chunk size: record}, all of this
    context and instruction), or recorded now and added to it."""
    chunk_size = options.compressor.reconstruction_chunk_size
    if chunk_size not in recorded:  # a fresh cache of these options says which layers to record
        recorded[chunk_size] = record_reconstruction(model, CompressedCache(model, options), context_ids)
    return recorded[chunk_size]


@torch.inference_mode()
def load_reconstruction(model, cache: CompressedCache, recorded: RecordedReconstruction) -> tuple[torch.Tensor, ReconstructionStats]:
    """Compress every layer of the fresh prefill-mode `cache` from `recorded` (module docstring, step 3); -> (the
    context's last logits [B, V], the recorded `ReconstructionStats`). The recorded reconstruction forwards' seconds
    are added to the compressed layers' compression time, as if they had run for this cache; `recorded` is not
    modified, so it serves any number of caches."""
    _check(cache, recorded.context_ids, None)
    chunk_size = cache.options.compressor.reconstruction_chunk_size
    layers = _compressed_layers(cache)
    if chunk_size != recorded.chunk_size or layers != set(recorded.queries):
        raise ValueError(f"method {cache.options.method!r} reconstructs in chunks of {chunk_size} tokens and compresses layers "
                         f"{sorted(layers)}; the recorded reconstruction used chunks of {recorded.chunk_size} and layers "
                         f"{sorted(recorded.queries)}: record it with a cache of this method")
    scales = attention_scales(model)
    for i, layer in enumerate(cache.layers):
        keys, values = recorded.keys[i], recorded.values[i]
        if i in layers:
            layer.load_prefill(recorded.queries[i], keys, values, scales[i], extra_lse=recorded.lse[i])
            layer.stats.compress_seconds += recorded.stats.seconds / len(layers)  # the reconstruction forwards are compression work
        else:
            layer.load_prefill(None, keys, values, scales[i])
    return recorded.logits, recorded.stats


@torch.inference_mode()
def reconstruct_context(model, cache: CompressedCache, context_ids: torch.Tensor,
                        prefix_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ReconstructionStats]:
    """Prefill context_ids [B, n] (unpadded) and compress every layer of the fresh prefill-mode `cache` with KVzip's
    reconstruction (module docstring); -> (the context's last logits [B, V], `ReconstructionStats`).

    prefix_ids [1 or B, m]: the repeat instruction placed before each chunk of the repeated context
    (`repeat_prompt_ids`); None: the one the cache's options name, if any. The cache's layers end up
    holding the compressed context at positions 0..n-1, as after any prefill-mode compression. The same as
    `load_reconstruction(model, cache, record_reconstruction(model, cache, context_ids, prefix_ids))`.
    """
    return load_reconstruction(model, cache, record_reconstruction(model, cache, context_ids, prefix_ids))
