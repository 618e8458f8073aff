"""One full prefill, many compressions: evaluate several methods/ratios on the same context cheaply.

In prefill mode (docs/design.md, "Model integration: three modes") a layer is compressed only
after its own attention over the whole block, so the context's hidden states, and every layer's q/k/v, do not depend on the method. A
`SharedPrefill` captures them once (`eval.capture.capture_qkv`), then `cache(method, ...)`
builds a prefill-mode `CompressedCache` from that record (`CompressedCache.from_prefill`), ready
for the question and the answer. The result equals `kvc.generate(..., mode="prefill")` up to float rounding (SDPA vs weighted attention
in the shared prefill).
"""

from __future__ import annotations

import torch

from ..cache import CompressedCache
from ..model_support import RotaryInverse, use_compressed_attention
from ..names import FULL
from ..options import CompressionOptions
from .capture import capture_qkv
from .generation import generate_ids


class SharedPrefill:
    """The context's per-layer post-RoPE (queries, keys, values), captured in one forward."""

    def __init__(self, model, context_ids: torch.Tensor):
        self.model, self.context_ids = model, context_ids
        self.n = context_ids.shape[1]
        self.captured = capture_qkv(model, context_ids)

    def cache(self, method: str | None, compression_ratio: float = 0.0, sink=None, window=None, seed: int = 0, **params) -> CompressedCache:
        """A prefill-mode cache holding `method`'s compression of the context (None or "full": the exact, full cache)."""
        method, compression_ratio = full_as_ratio_zero(method, compression_ratio)
        options = CompressionOptions(method=method, method_params=params, compression_ratio=compression_ratio, sink=sink, window=window, seed=seed)
        return CompressedCache.from_prefill(self.model, options, self.captured)

    def answer_ids(self, question_ids: torch.Tensor, method: str | None, compression_ratio: float = 0.0, max_new_tokens: int = 16, **params) -> list[int]:
        """Greedy answer token ids to the question after `method`'s compression (`generate_ids` on the record)."""
        method, compression_ratio = full_as_ratio_zero(method, compression_ratio)
        res = generate_ids(
            self.model, self.context_ids, question_ids, method=method, compression_ratio=compression_ratio,
            max_new_tokens=max_new_tokens, prefill=self.captured, **params,
        )
        return res.token_ids

    def pre_rope_keys(self, layer: int) -> torch.Tensor:
        """[1, H_kv, n, d] pre-RoPE keys of a layer (un-rotated as the integration does)."""
        return RotaryInverse(self.model)(self.captured[layer][1], torch.arange(self.n))


@torch.inference_mode()
def continuation_logits(model, cache: CompressedCache, ids: torch.Tensor) -> torch.Tensor:
    """Logits [1, m, V] of tokens ids [1, m] appended (exactly) after the cache's context."""
    with use_compressed_attention(model):
        return model(ids, past_key_values=cache, use_cache=True).logits


def full_as_ratio_zero(method: str | None, compression_ratio: float) -> tuple[str, float]:
    """The full cache (None or FULL, "full") from a record: any method at ratio 0 keeps every token exactly."""
    return ("streamingllm", 0.0) if method in (None, FULL) else (method, compression_ratio)
