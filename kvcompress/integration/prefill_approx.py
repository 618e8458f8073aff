"""The Express paper's prefill recipe: Express approximates the prefill attention, then any method compresses the cache.

Gong et al., "Express Language Modeling", arXiv:2606.10944 (Sec. 4 "Accelerating KV cache
compression", Fig. 2, App. I.2; docs/design.md, "Composition"): the context is fed through the
model in chunks; each chunk's queries attend to a Thinformer Express cache of everything before
the chunk (32 sink and 32 window tokens exact, the middle thinned by the Express stream) plus the
chunk itself exactly, so no layer ever attends over the whole context. The keys and values this
approximate forward produces, for every context token, then form the cache that the eviction
method (SnapKV, PyramidKV, StreamingLLM, ... any registered method) compresses as after an exact
prefill.

`approximate_prefill` returns the same record as an exact prefill capture ({layer: (queries,
keys, values)}), so `CompressedCache.from_prefill` compresses it unchanged;
`kvc.generate(..., prefill_approx="express")` (a `CompressionOptions` setting) composes the two.
"""

from __future__ import annotations

import torch

from ..cache import CompressedCache, CompressedLayer
from ..checks import as_count
from ..model_support import check_supported, use_compressed_attention
from ..names import PREFILL_APPROXIMATIONS
from ..options import CompressionOptions
from .model import check_context_ids, logits_to_keep

# The paper's Express settings for the prefill (App. I.2): 32 sink + 32 window tokens exact.
EXPRESS_SINK, EXPRESS_WINDOW = 32, 32
# Middle slots per head of the Express stream during the prefill (the paper's m is not in its extracted text).
DEFAULT_EXPRESS_BUDGET = 512


class _RecordingLayer(CompressedLayer):
    """A chunked-mode layer that also keeps every block's queries, keys and values as the model produced them."""

    def __init__(self, cache: CompressedCache, layer_idx: int):
        super().__init__(cache, layer_idx)
        self.blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def commit(self, queries: torch.Tensor, scale: float, attention_mass: torch.Tensor | None = None,
               hidden_states: torch.Tensor | None = None) -> None:
        keys, values, _ = self.pending
        self.blocks.append((queries, keys, values))
        super().commit(queries, scale, attention_mass, hidden_states)


@torch.inference_mode()
def approximate_prefill(
    model,
    context_ids: torch.Tensor,
    prefill_approx: str = "express",
    budget: int = DEFAULT_EXPRESS_BUDGET,
    chunk_size: int = 128,
    seed: int = 0,
) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{layer: (queries [1,H_q,n,d], keys [1,H_kv,n,d], values [1,H_kv,n,d])} of the context [1, n], computed with Express attention.

    The context goes through the model in chunks of `chunk_size` tokens over a chunked-mode
    Express cache (sink 32, window 32, `budget` middle slots per head); every chunk's post-RoPE
    queries, keys and values are kept, on the model's device, in its dtype.
    """
    if prefill_approx not in PREFILL_APPROXIMATIONS:
        raise ValueError(f"prefill_approx must be one of {PREFILL_APPROXIMATIONS}, got {prefill_approx!r}")
    check_context_ids(context_ids)
    sliding = [i for i, (kind, _) in enumerate(check_supported(model)) if kind != "full_attention"]
    if sliding:
        raise ValueError(f"prefill_approx={prefill_approx!r} runs every layer over an Express cache, and layers {sliding} of this "
                         "model attend over a sliding window, which it does not keep: leave prefill_approx unset for this model")
    options = CompressionOptions(method="express", mode="chunked", budget=as_count("budget", budget, 1), sink=EXPRESS_SINK,
                                 window=EXPRESS_WINDOW, seed=seed, chunk_size=chunk_size)
    cache = CompressedCache(model, options)
    cache.layers = [_RecordingLayer(cache, i) for i in range(cache.num_layers)]
    with use_compressed_attention(model):
        for block in context_ids.split(options.chunk_size, dim=1):
            model(block, past_key_values=cache, use_cache=True, **logits_to_keep(model, last=False))
    return {
        i: tuple(torch.cat([blk[j] for blk in layer.blocks], dim=2) for j in range(3))
        for i, layer in enumerate(cache.layers)
    }
