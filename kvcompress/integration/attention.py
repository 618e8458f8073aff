"""The 'kvcompress' attention function, registered with transformers' AttentionInterface (DESIGN.md §3)."""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ..attention import weighted_attention
from ..cache import ATTENTION_NAME


def kvcompress_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [B,H_q,q,d], key/value as a CompressedCache layer returned them -> ([B,q,H_q,d], None).

    Over a CompressedCache layer: weighted attention over its view (log-weights as a bias, causal
    by original positions, padding slots ignored), then the layer absorbs the new block with these
    queries. Without one (a sliding-window layer, no cache, a plain forward) the keys are exact and
    the model's mask applies (`exact_attention_with_mask`). In the model's dtype; without soft-capping,
    causality comes from the view's layout (`causal_tail`: the block is its last slots), so a decode
    step reads no tensor value on the host.
    """
    layer = getattr(key, "kvcompress_layer", None)
    softcap = kwargs.pop("softcap", None)
    if layer is None:
        return exact_attention_with_mask(module, query, key, value, attention_mask, scaling, softcap, **kwargs)
    layer.mask_padding(attention_mask)
    view = layer.view
    progress = layer.cache.progress
    if softcap is None:
        out = weighted_attention(query, view, scaling, causal_tail=True)
    else:
        query_positions = torch.arange(layer.seen - query.shape[2], layer.seen, device=query.device)
        out = softcapped_weighted_attention(query, view, scaling, softcap, query_positions)
    layer.commit(query, scaling)
    if progress is not None:
        progress.update(1)
    return out.transpose(1, 2).contiguous(), None


# --- padded batches and model families (Gemma 2 soft-capping, sliding-window layers) ---


def _softcap_scores(query, keys, scaling, softcap):
    """[B,H_q,q,n] float32 logits tanh(s<q,k>/cap)·cap (Gemma 2), keys [B,H_kv,n,d] shared by GQA groups.

    Computed in the query's dtype, as Gemma 2's own attention does, so bfloat16 matches it."""
    group = query.shape[1] // keys.shape[1]
    logits = torch.matmul(query, keys.to(query.dtype).repeat_interleave(group, 1).transpose(-1, -2)) * scaling
    return (torch.tanh(logits / softcap) * softcap).float()


def _query_chunks(query, n_keys):
    """Query index ranges such that no chunk holds more than about 2^25 scores."""
    b, hq, nq, _ = query.shape
    chunk = max(1, (1 << 25) // max(1, b * hq * n_keys))
    return [(start, start + chunk) for start in range(0, nq, chunk)]


def softcapped_weighted_attention(query, summary, scaling, softcap, query_positions):
    """weighted_attention with soft-capped logits: log-weights and causality added after the cap. -> [B,H_q,q,d_v]."""
    group = query.shape[1] // summary.keys.shape[1]
    den = summary.denominator()

    def biased(q, qpos, keys, log_weights, positions):
        scores = _softcap_scores(q, keys, scaling, softcap) + log_weights.float().repeat_interleave(group, 1)[:, :, None]
        hidden = positions.repeat_interleave(group, 1)[:, :, None, :] > qpos[None, None, :, None]
        return scores.masked_fill(hidden, float("-inf"))

    outs = []
    for start, stop in _query_chunks(query, summary.num_slots + den.keys.shape[2]):
        q, qpos = query[:, :, start:stop], query_positions[start:stop]
        numerator = biased(q, qpos, summary.keys, summary.log_weights, summary.positions)
        log_den = torch.logsumexp(biased(q, qpos, den.keys, den.log_weights, den.positions), dim=-1, keepdim=True)
        probs = torch.exp(numerator - log_den).nan_to_num(0.0).to(query.dtype)
        outs.append(torch.matmul(probs, summary.values.to(query.dtype).repeat_interleave(group, 1)))
    return torch.cat(outs, dim=2)


def exact_attention_with_mask(module, query, key, value, attention_mask, scaling, softcap, **kwargs):
    """Exact attention over every key with the model's boolean mask (None: causal) -> ([B,q,H_q,d], None); SDPA unless soft-capped."""
    if softcap is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    n_q, n_k = query.shape[2], key.shape[2]
    if attention_mask is None:
        attention_mask = torch.ones(n_q, n_k, dtype=torch.bool, device=query.device).tril(n_k - n_q)[None, None]
    group = query.shape[1] // key.shape[1]
    outs = []
    for start, stop in _query_chunks(query, n_k):
        scores = _softcap_scores(query[:, :, start:stop], key, scaling, softcap)
        probs = scores.masked_fill(~attention_mask[:, :, start:stop], float("-inf")).softmax(-1).nan_to_num(0.0).to(query.dtype)
        outs.append(torch.matmul(probs, value.repeat_interleave(group, 1)))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, kvcompress_attention)
# SDPA's boolean masks (None where plain causal suffices). Over a compressed layer the columns are
# original positions (its get_mask_sizes), so the last row tells which tokens are padding.
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
