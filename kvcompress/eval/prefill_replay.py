"""One full prefill, many compressions: evaluate several methods/ratios on the same context cheaply.

In prefill mode (DESIGN.md §3) a layer is compressed only after its own attention over the whole
block, so the context's hidden states, and every layer's q/k/v, do not depend on the method. A
`SharedPrefill` captures them once (`eval.capture.capture_qkv`), then `cache(method, ...)`
compresses every layer with `kvc.compress` exactly as `CompressedCache` does in prefill mode and
returns a `CompressedCache` holding the summaries, ready for the question and the answer. The
result equals `kvc.generate(..., mode="prefill")` up to float rounding (SDPA vs weighted attention
in the shared prefill).
"""

from __future__ import annotations

import torch

from ..api import compress, default_sink_window
from ..cache import CompressedCache, CompressionSettings
from ..methods.base import build_method
from ..summary import KVSummary
from .capture import capture_qkv


class SharedPrefill:
    """The context's per-layer (queries, keys, values, pre-RoPE keys), captured in one forward."""

    def __init__(self, model, context_ids: torch.Tensor):
        self.model = model
        self.context_ids = context_ids
        self.n = context_ids.shape[1]
        captured = capture_qkv(model, context_ids)
        positions = torch.arange(self.n)
        unrotate = CompressedCache(model, CompressionSettings(build_method("compactor"), budget=1))
        self.layers = [(q, k, v, unrotate.pre_rope_keys(k, positions)) for q, k, v in captured.values()]
        self.scale = model.model.layers[0].self_attn.scaling

    def cache(self, method: str | None, compression_ratio: float = 0.0, sink=None, window=None, seed: int = 0, **params) -> CompressedCache:
        """A prefill-mode cache whose layers hold `method`'s summaries of the context (None: exact, the full cache)."""
        settings = CompressionSettings(build_method(method or "random", **params), budget=1, seed=seed)
        cache = CompressedCache(self.model, settings)
        if method is not None:
            sink, window = default_sink_window(method, sink, window)
        for idx, (layer, (q, k, v, pre)) in enumerate(zip(cache.layers, self.layers)):
            if method is None:
                front = KVSummary.exact(k, v, torch.arange(self.n))
            else:
                front = compress(
                    method, k, v, queries=q, pre_rope_keys=pre, compression_ratio=compression_ratio, sink=sink, window=window,
                    seed=cache.generator(idx), scale=self.scale, layer_idx=idx, num_layers=len(self.layers), **params,
                )
            layer.lazy_initialization(k, v)
            layer.front, layer.seen = front, self.n
        return cache


@torch.inference_mode()
def continuation_logits(model, cache: CompressedCache, ids: torch.Tensor) -> torch.Tensor:
    """Logits [1, m, V] of tokens ids [1, m] appended (exactly) after the cache's context."""
    from ..integration.generate import use_compressed_attention

    with use_compressed_attention(model):
        return model(ids, past_key_values=cache, use_cache=True).logits


@torch.inference_mode()
def greedy_answer(model, cache: CompressedCache, question_ids: torch.Tensor, max_new_tokens: int = 16) -> list[int]:
    """Greedy token ids after the question (stops at EOS)."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
    logits = continuation_logits(model, cache, question_ids)[:, -1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits.argmax(-1))
        out.append(token)
        if token in eos or len(out) == max_new_tokens:
            break
        logits = continuation_logits(model, cache, torch.tensor([[token]]))[:, -1]
    return out
