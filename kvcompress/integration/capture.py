"""Real attention inputs: post-RoPE q/k/v of chosen layers, recorded during one full forward pass.

`capture_qkv` runs one full-attention forward pass (no cache) with a recording attention function
(`model_support.recording_attention`, under SDPA's masks, sliding windows included): it records
what each chosen layer's attention receives (queries [1, H_q, n, d] and keys/values [1, H_kv, n, d], after RoPE,
before grouped-query repetition) and then computes the layer's exact attention (SDPA, or soft-capped scores where
SDPA takes none: Gemma 2), or, with
`attention_mass=True`, with `integration.attention.causal_attention_with_mass`, recording each key's
received attention mass as a by-product (what H2O scores with; `Tokens.attention_mass`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..model_support import recording_attention


def capture_qkv(
    model,
    tokenizer_or_ids,
    text: str | None = None,
    layers: Iterable[int] | None = None,
    max_tokens: int | None = None,
    attention_mass: bool = False,
) -> dict[int, tuple[torch.Tensor, ...]]:
    """{layer: (queries [1,H_q,n,d], keys [1,H_kv,n,d], values [1,H_kv,n,d])} as attention sees them.

    tokenizer_or_ids: a tokenizer (then `text` is tokenised, no special tokens added) or input ids
    [n] / [1, n] (then `text` must be None). layers: layer indices, default all. max_tokens keeps
    the first tokens only. Tensors are detached CPU copies in the model's dtype. The model's own
    attention implementation is restored afterwards. attention_mass=True appends a fourth tensor,
    mass [1,H_kv,n] float32, to each full-causal layer's tuple (not to sliding-window or
    soft-capped layers, whose attention is not one causal pass: they stay exact, as without it).
    """
    from .attention import causal_attention_with_mass, exact_attention_with_mask
    from .model import logits_to_keep

    if isinstance(tokenizer_or_ids, torch.Tensor):
        if text is not None:
            raise ValueError("text must be None when input ids are given")
        ids = tokenizer_or_ids.reshape(1, -1)
    else:
        if text is None:
            raise ValueError("text is required when a tokenizer is given")
        ids = tokenizer_or_ids(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    if max_tokens is not None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        ids = ids[:, :max_tokens]
    if ids.shape[1] == 0:
        raise ValueError("nothing to capture: the input has no tokens")
    num_layers = model.config.num_hidden_layers
    wanted = set(range(num_layers)) if layers is None else set(layers)
    bad = [i for i in wanted if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layers must lie in [0, {num_layers - 1}], got {sorted(bad)}")

    captured: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def plain_attention(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
        """The layer's exact attention under the model's mask: SDPA, or soft-capped scores (Gemma 2), which SDPA refuses."""
        return exact_attention_with_mask(module, query, key, value, attention_mask, scaling, softcap, **kwargs)

    def recording(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx not in wanted:
            return plain_attention(module, query, key, value, attention_mask, **kwargs)
        recorded = [query, key, value]
        fused = attention_mass and kwargs.get("softcap") is None and getattr(module, "sliding_window", None) is None
        if fused:  # one unpadded sequence: the model's mask is the causal one the kernel applies
            out, mass = causal_attention_with_mass(query, key, value, kwargs.get("scaling"))
            recorded.append(mass)
            result = out.transpose(1, 2).contiguous(), None
        else:
            result = plain_attention(module, query, key, value, attention_mask, **kwargs)
        captured[module.layer_idx] = tuple(t.detach().to("cpu", copy=True) for t in recorded)
        return result

    with recording_attention(model, recording), torch.no_grad():
        model(input_ids=ids.to(model.device), use_cache=False, **logits_to_keep(model, last=False))
    return dict(sorted(captured.items()))
