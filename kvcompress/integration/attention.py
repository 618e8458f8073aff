"""The 'kvcompress' attention function, registered with transformers' AttentionInterface (DESIGN.md §3)."""

from __future__ import annotations

import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from ..attention import weighted_attention

ATTENTION_NAME = "kvcompress"


def kvcompress_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [B,H_q,q,d], key/value as a CompressedCache layer returned them -> ([B,q,H_q,d], None).

    Over a CompressedCache layer: weighted attention over its view (its stored state, then the
    new block: `causal_tail`), in the model's dtype, then the layer absorbs the new block with
    these queries. Without one (no cache, e.g. a plain forward) the keys are exact and causal.
    Nothing here reads tensor values on the host, so a decode step never synchronises.
    """
    layer = getattr(key, "kvcompress_layer", None)
    if layer is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    progress = layer.cache.progress
    out = weighted_attention(query, layer.view, scaling, causal_tail=True)
    layer.commit(query, scaling)
    if progress is not None:
        progress.update(1)
    return out.transpose(1, 2).contiguous(), None


def _unpadded_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs):
    """Mask builder for the 'kvcompress' implementation: causality comes from the cache's layout, so no
    mask; padded batches are refused rather than silently attended. Checked on multi-token forwards
    only (padding enters with the prompt), so decode steps never synchronise with the device."""
    if q_length > 1 and attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
        raise ValueError("kvcompress attention does not support padded batches: pass unpadded sequences (batch size 1 or equal lengths)")
    return None


AttentionInterface.register(ATTENTION_NAME, kvcompress_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, _unpadded_mask)
