"""Weighted attention over a KVSummary (DESIGN.md §1, §7).

out(q) = Σ_i w_i exp(s<q,k_i>) v_i / Σ_j w'_j exp(s<q,k'_j>), with (k', w') the normalizer when
present, else the same slots. Everything runs in the inputs' own dtype through
`F.scaled_dot_product_attention`, which accumulates in float32 inside the kernel; log-weights
enter as an additive bias (log space), so float16/bfloat16 never see exp(logit) outside it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .checks import check_queries
from .summary import KVSummary

# Largest number of mask entries materialised at once (per call); queries are processed in
# chunks below it so a long causal block never holds a full [H, q, n] mask.
_MAX_LOGITS = 1 << 25


def visible_slots(positions: torch.Tensor, query_positions: torch.Tensor | None) -> int:
    """Number of leading slots to keep: every slot after the last one visible to some query is dropped.

    Reads values on the host (one sync): for offline attention over long contexts, not decoding.
    """
    if query_positions is None or positions.shape[-1] == 0:
        return positions.shape[-1]
    seen = (positions <= query_positions.max()).flatten(0, 1).any(0).nonzero()
    return int(seen.max()) + 1 if seen.numel() else 0


def _grouped_sdpa(q, keys, values, mask, scale):
    """SDPA with the GQA group folded into the query axis (no copy of keys/values).

    q [B, H_q, c, d]; keys/values [B, H_kv, n, *]; mask None, or additive/boolean broadcastable to
    [B, H_kv, c, n] (one row per KV head and query). Returns [B, H_q, c, d_v].
    """
    b, hq, c, d = q.shape
    hkv, n = keys.shape[1], keys.shape[2]
    group = hq // hkv
    folded = q.reshape(b, hkv, group * c, d)
    if mask is not None and c > 1 and group > 1:
        mask = mask.expand(b, hkv, c, n).unsqueeze(2).expand(b, hkv, group, c, n).reshape(b, hkv, group * c, n)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(b, hq, c, values.shape[-1])


def _slot_mask(log_weights, hidden, dtype):
    """Additive mask from log-weights [B, H_kv, n] and a hidden (causal) pattern broadcastable to
    [B, H_kv, c, n]; either may be None. A boolean mask when there are no weights."""
    if log_weights is None:
        return None if hidden is None else ~hidden
    bias = log_weights.to(dtype)[:, :, None, :]
    return bias if hidden is None else bias.masked_fill(hidden, float("-inf"))


def _with_normalizer(summary: KVSummary):
    """(keys, values, log_weights, positions, (n, m)): the n numerator slots followed by the m normalizer slots.

    Values get one extra column: 0 on numerator slots, 1 on normalizer slots (whose values are 0),
    so one softmax over the union gives N/Z and Z_den/Z in its last column, and their ratio is
    N/Z_den: numerator and denominator in log space inside one kernel call. Costs one copy of
    the slots in their own dtype.
    """
    den = summary.normalizer
    v = summary.values
    b, h, n, dv = v.shape
    m = den.keys.shape[2]
    values = torch.cat(
        [F.pad(v, (0, 1)), F.pad(v.new_ones(b, h, m, 1), (dv, 0))], dim=2
    )
    keys = torch.cat([summary.keys, den.keys.to(summary.keys.dtype)], dim=2)
    log_weights = torch.cat([summary.log_weights, den.log_weights.to(summary.log_weights.dtype)], dim=2)
    positions = torch.cat([summary.positions, den.positions], dim=2)
    return keys, values, log_weights, positions, (n, m)


def _attend(q, keys, values, mask, scale, split):
    """SDPA over the slots, and the normalizer ratio when `split` (numerator, normalizer slot counts) is given."""
    out = _grouped_sdpa(q, keys, values, mask, scale)
    if split is not None:
        den = out[..., -1:].float()
        out = (out[..., :-1].float() / den).to(q.dtype)
    return out if mask is None and split is None else out.nan_to_num(0.0, posinf=0.0, neginf=0.0)


def weighted_attention(
    queries: torch.Tensor,
    summary: KVSummary,
    scale: float | None = None,
    query_positions: torch.Tensor | None = None,
    causal_tail: bool = False,
) -> torch.Tensor:
    """Attention of queries over a summary, in the queries' dtype.

    queries [B, H_q, q, d] with H_q a multiple of H_kv (grouped-query attention: query head h
    reads KV head h // (H_q / H_kv)); scale defaults to 1/sqrt(d). Causality, at most one of:
    - query_positions [q] or [B, q]: a query attends only to slots whose position is <= its own;
    - causal_tail=True: the summary's last q slots are the queries' own tokens in order (and so
      are the normalizer's last q, when there is one), every other slot precedes them. This is
      how a cache hands over its state plus the new block: decided from shapes, so decoding needs
      no host synchronisation.
    A query with no visible slot gets 0. Returns [B, H_q, q, d_v].

    An eviction-only summary (`summary.eviction_only`) needs no bias: a decode step (q = 1) or a
    non-causal call is one plain SDPA call with no mask, a prefill (all slots are the queries')
    is SDPA with is_causal. A weighted summary adds its log-weights as a bias in the queries'
    dtype (its rounding, |log w|·2^-8 in bfloat16, is below that of the bfloat16 keys' logits).
    A normalizer is folded into the same call (see `_with_normalizer`); only the per-query
    ratio is formed in float32.
    """
    check_queries(queries, summary.keys, "the summary's keys")
    b, hq, nq, d = queries.shape
    hkv = summary.keys.shape[1]
    if query_positions is not None and causal_tail:
        raise ValueError("pass query_positions or causal_tail=True, not both")
    if causal_tail and summary.num_slots < nq:
        raise ValueError(f"causal_tail=True needs the queries' own {nq} tokens as the last slots; the summary has {summary.num_slots}")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    plain = summary.eviction_only and summary.normalizer is None
    keys, values = summary.keys.to(queries.dtype), summary.values.to(queries.dtype)
    if plain and (query_positions is None and (not causal_tail or nq == 1)):
        return _grouped_sdpa(queries, keys, values, None, scale)
    if plain and causal_tail and nq == summary.num_slots:
        return F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    log_weights, positions, split = summary.log_weights, summary.positions, None
    if summary.normalizer is not None:
        keys, values, log_weights, positions, split = _with_normalizer(summary.to(queries.dtype))
    weights = None if plain else log_weights
    if query_positions is None:
        return _causal_tail_attention(queries, keys, values, weights, scale, causal_tail, split)
    query_positions = query_positions.to(positions.device).long().expand(b, nq)
    chunk = max(1, _MAX_LOGITS // max(1, b * hq * keys.shape[2]))
    outs = []
    for start in range(0, nq, chunk):
        qpos = query_positions[:, start : start + chunk]
        n = keys.shape[2] if split is not None else visible_slots(positions, qpos)
        hidden = positions[:, :, None, :n] > qpos[:, None, :, None]
        mask = _slot_mask(weights[:, :, :n] if weights is not None else None, hidden, queries.dtype)
        outs.append(_attend(queries[:, :, start : start + chunk], keys[:, :, :n], values[:, :, :n], mask, scale, split))
    return torch.cat(outs, dim=2)


def _causal_tail_attention(queries, keys, values, log_weights, scale, causal_tail, split):
    """weighted_attention without query_positions: non-causal, or causal within the last q slots
    (of each part when `split` = (numerator slots, normalizer slots))."""
    nq, n = queries.shape[2], keys.shape[2]
    if not causal_tail or nq == 1:
        return _attend(queries, keys, values, _slot_mask(log_weights, None, queries.dtype), scale, split)
    # slot j holds tail token j - first[j], where first[j] is where its part's tail starts
    slot = torch.arange(n, device=keys.device)
    first = torch.full((n,), n - nq, device=keys.device)
    if split is not None:
        first[: split[0]] = split[0] - nq
    chunk = max(1, _MAX_LOGITS // max(1, queries.shape[0] * queries.shape[1] * n))
    outs = []
    for start in range(0, nq, chunk):
        query = torch.arange(start, min(nq, start + chunk), device=keys.device)
        hidden = (slot - first)[None, :] > query[:, None]
        mask = _slot_mask(log_weights, hidden[None, None], queries.dtype)
        outs.append(_attend(queries[:, :, start : start + chunk], keys, values, mask, scale, split))
    return torch.cat(outs, dim=2)


def exact_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None = None, causal_offset: int | None = None
) -> torch.Tensor:
    """Reference attention over every token (the 'Attn' that relative errors are measured against).

    queries [B,H_q,q,d], keys/values [B,H_kv,n,d]. causal_offset: position of the first query
    relative to the first key (query i sees keys <= causal_offset + i); None for non-causal.
    """
    n, nq = keys.shape[2], queries.shape[2]
    summary = KVSummary.exact(keys, values, torch.arange(n, device=keys.device))
    if causal_offset is None or causal_offset == n - nq:
        return weighted_attention(queries, summary, scale, causal_tail=causal_offset is not None)
    qpos = torch.arange(nq, device=keys.device) + causal_offset
    return weighted_attention(queries, summary, scale, qpos)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """‖approx − exact‖_F / ‖exact‖_F, in float64."""
    return float((approx.double() - exact.double()).norm() / exact.double().norm())
