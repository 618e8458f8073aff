"""Training data for learned KVzip scores: each context token's layer inputs, and its exact KVzip score.

Jégou and Jeblick, "KVzap: Fast, Adaptive, and Faithful KV Cache Pruning" (arXiv 2601.07891) train a small surrogate
per layer that maps a token's hidden state to its KVzip score (Kim et al., "KVzip: Query-Agnostic KV Cache
Compression with Context Reconstruction", arXiv 2505.23416), so that a token can be scored when it enters the cache,
without KVzip's reconstruction forward. `record_scoring_pairs` runs the project's own KVzip on a context (its prefill
and its reconstruction forwards, `integration.reconstruction`) and returns, for every full-attention layer, what a
surrogate may read and the score it must predict. `methods.kvzap` fits and applies the surrogates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import CompressedCache, CompressedLayer
from ..methods.kvzip import reconstruction_scores
from ..model_support import attention_modules, attention_scales
from .model import build_prompt
from .reconstruction import record_reconstruction, repeat_prompt_ids

# KVzip's log-scores below this are clamped when used as targets: a probability under e^-20 (about 2e-9) is one no
# budget keeps, and the surrogate need not rank such tokens among themselves.
SCORE_FLOOR = -20.0


@dataclass
class ScoringPairs:
    """One context's training pairs for every full-attention layer (layer index -> tensor).

    hidden [n, d_model]: the hidden state the layer's attention receives for each context token (after the layer's input
    norm: what its key and value projections read), in float32. targets [H_kv, n] float32: the token's KVzip score for
    each KV head (log of the largest reconstruction probability it receives, `methods.kvzip.reconstruction_scores`,
    floored at SCORE_FLOOR). The first `sink` tokens are left out (a cache keeps them exactly).
    """

    hidden: dict[int, torch.Tensor]
    targets: dict[int, torch.Tensor]


def context_ids_of(tokenizer, text: str) -> torch.Tensor:
    """[1, n]: the ids a prompt-building entry point (`kvc.generate`) compresses for `text`: the chat template's head and the text."""
    return build_prompt(tokenizer, text)[0]


@torch.inference_mode()
def record_scoring_pairs(model, tokenizer, context_ids: torch.Tensor, sink: int = 4) -> ScoringPairs:
    """The surrogate's training pairs of one context, context_ids [1, n] (`context_ids_of`): one prefill and KVzip's
    reconstruction forwards with its default repeat instruction and chunk size; each full-attention layer's attention
    inputs are recorded during the prefill (a forward pre-hook on its attention module)."""
    cache = CompressedCache(model, "kvzip", compression_ratio=0.5)
    layers = {i for i, layer in enumerate(cache.layers) if isinstance(layer, CompressedLayer)}
    hidden: dict[int, torch.Tensor] = {}

    def record(module, args, kwargs):
        if module.layer_idx in layers and module.layer_idx not in hidden:  # the context's prefill, the first forward
            states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            hidden[module.layer_idx] = states[0, sink:].float().cpu()

    handles = [m.register_forward_pre_hook(record, with_kwargs=True) for m in attention_modules(model)]
    try:
        recorded = record_reconstruction(model, cache, context_ids, repeat_prompt_ids(tokenizer))
    finally:
        for handle in handles:
            handle.remove()
    scales = attention_scales(model)
    targets = {}
    for i in sorted(layers):
        keys = recorded.keys[i]
        scores, _ = reconstruction_scores(recorded.queries[i], keys[:, :, sink:], scales[i], exact_keys=keys[:, :, :sink],
                                          extra_lse=recorded.lse[i], chunk_size=recorded.chunk_size)
        targets[i] = scores[0].clamp_min(SCORE_FLOOR).cpu()
    return ScoringPairs(hidden, targets)


def text_contexts(tokenizer, paragraphs: list[str], tokens: int, count: int, seed: int, flag: str = "--contexts") -> list[torch.Tensor]:
    """`count` contexts [1, n] (`context_ids_of`) of about `tokens` tokens each: `paragraphs` shuffled by `seed`, then
    joined by blank lines, a context closing at the first paragraph that takes it to `tokens` tokens; each paragraph is
    used once. ValueError when the paragraphs fill fewer, naming `flag` (the option that set `count`) and how many fit."""
    import random

    order = list(paragraphs)
    random.Random(seed).shuffle(order)
    contexts, part, length, total = [], [], 0, 0
    for paragraph in order:
        part.append(paragraph)
        added = len(tokenizer(paragraph + "\n\n", add_special_tokens=False)["input_ids"])
        length, total = length + added, total + added
        if length >= tokens:
            contexts.append(context_ids_of(tokenizer, "\n\n".join(part)))
            part, length = [], 0
            if len(contexts) == count:
                return contexts
    raise ValueError(f"{flag} {count}: the text ({len(paragraphs)} paragraphs) fills {len(contexts)} contexts of {tokens} tokens; "
                     f"ask for at most {len(contexts)} contexts, or fewer tokens per context (--tokens)" if contexts else
                     f"--tokens {tokens}: the text ({len(paragraphs)} paragraphs) fills no context of {tokens} tokens "
                     f"(it holds about {total} tokens); use fewer tokens per context")


def scoring_pairs(model, tokenizer, contexts: list[torch.Tensor], sink: int = 4, progress=None) -> ScoringPairs:
    """`record_scoring_pairs` of every context, concatenated along the tokens (hidden [N, d_model], targets [H_kv, N])."""
    pairs = []
    for i, ids in enumerate(contexts):
        pairs.append(record_scoring_pairs(model, tokenizer, ids, sink))
        if progress is not None:
            progress(f"context {i + 1}/{len(contexts)}: {ids.shape[1]} tokens scored by KVzip")
    layers = sorted(pairs[0].hidden)
    return ScoringPairs({i: torch.cat([p.hidden[i] for p in pairs]) for i in layers},
                        {i: torch.cat([p.targets[i] for p in pairs], 1) for i in layers})


def fidelity(surrogate, pairs: ScoringPairs) -> dict[int, list[float]]:
    """{layer: [Spearman correlation of the surrogate's predicted scores with KVzip's, one per KV head]} on `pairs`
    (text the surrogate was not fitted on)."""
    from ..methods.kvzap import spearman

    out = {}
    for layer in surrogate.layers:
        predicted = surrogate.predict(pairs.hidden[layer][None, None].expand(1, surrogate.kv_heads, -1, -1), layer)[0]
        out[layer] = [spearman(predicted[h], pairs.targets[layer][h]) for h in range(surrogate.kv_heads)]
    return out
