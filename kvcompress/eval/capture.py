"""Real attention inputs: post-RoPE q/k/v of chosen layers on real text, and a real-prose source.

`capture_qkv` runs one full-attention forward pass (no cache) with a temporary attention function
registered through transformers' `AttentionInterface`: it records what each chosen layer's
attention receives (queries [1, H_q, n, d] and keys/values [1, H_kv, n, d], after RoPE, before
grouped-query repetition) and then computes the attention with the SDPA implementation.

`prose_paragraphs` / `prose_text` give natural-language text that ships with every CPython: the
prose paragraphs of the Python language reference topics in `pydoc_data.topics` (the text behind
`help("for")`), without code samples, grammar blocks or headings.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable

import torch

_CAPTURE_IMPL = "kvcompress_capture"


def capture_qkv(
    model,
    tokenizer_or_ids,
    text: str | None = None,
    layers: Iterable[int] | None = None,
    max_tokens: int | None = None,
) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{layer: (queries [1,H_q,n,d], keys [1,H_kv,n,d], values [1,H_kv,n,d])} as attention sees them.

    tokenizer_or_ids: a tokenizer (then `text` is tokenised, no special tokens added) or input ids
    [n] / [1, n] (then `text` must be None). layers: layer indices, default all. max_tokens keeps
    the first tokens only. Tensors are detached CPU copies in the model's dtype. The model's own
    attention implementation is restored afterwards.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

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

    def recording_attention(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx in wanted:
            captured[module.layer_idx] = tuple(t.detach().to("cpu", copy=True) for t in (query, key, value))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(_CAPTURE_IMPL, recording_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation(_CAPTURE_IMPL)
    try:
        with torch.no_grad():
            model(input_ids=ids.to(model.device), use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    return dict(sorted(captured.items()))


def _is_prose(paragraph: str) -> bool:
    """A paragraph of running text: unindented, several words, mostly letters, ends a sentence."""
    if paragraph.startswith((" ", "*", "-", "+", "=")) or len(paragraph.split()) < 8:
        return False
    letters = sum(ch.isalpha() or ch.isspace() for ch in paragraph)
    return letters >= 0.85 * len(paragraph) and paragraph.rstrip().endswith((".", ":", "?", "!"))


def prose_paragraphs() -> list[str]:
    """Prose paragraphs of the Python language reference (`pydoc_data.topics`), in a fixed order.

    Line breaks inside a paragraph become spaces; paragraphs ending with ':' (which introduce a
    code sample that was removed) are dropped, and so are repeats (several topics share text).
    """
    from pydoc_data.topics import topics

    out: dict[str, None] = {}
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            if _is_prose(block) and not block.rstrip().endswith(":"):
                out.setdefault(" ".join(block.split()))
    return list(out)


def prose_text(n_chars: int | None = None, seed: int | None = None) -> str:
    """Real prose joined by blank lines: the paragraphs in order (seed None) or shuffled by `seed`.

    n_chars: stop at the first paragraph boundary at or after n_chars characters, cycling through
    the paragraphs again if needed; None returns every paragraph once.
    """
    paragraphs = prose_paragraphs()
    if seed is not None:
        random.Random(seed).shuffle(paragraphs)
    if n_chars is None:
        return "\n\n".join(paragraphs)
    if n_chars < 0:
        raise ValueError(f"n_chars must be >= 0, got {n_chars}")
    parts: list[str] = []
    total = 0
    while total < n_chars:
        for p in paragraphs:
            parts.append(p)
            total += len(p) + 2
            if total >= n_chars:
                break
    return "\n\n".join(parts)
