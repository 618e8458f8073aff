"""Weighted attention over a KVSummary (DESIGN.md §1).

out(q) = Σ_i w_i exp(s<q,k_i>) v_i / Σ_j w'_j exp(s<q,k'_j>), with (k', w') the normalizer when
present, else the same slots; computed in log space with float32 accumulators for any input dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .checks import check_queries
from .summary import KVSummary

# Largest number of float32 logits materialised at once (per call); queries are processed in
# chunks below it so a 4k-token prefill never holds a full [H, q, n] score tensor.
_MAX_LOGITS = 1 << 25


def _bias(log_weights, positions, query_positions, group):
    """[B, H_q, c, n] additive bias: log-weights, and -inf where a slot lies after the query (causal)."""
    bias = log_weights.float()[:, :, None, :]
    if query_positions is not None:
        hidden = positions[:, :, None, :] > query_positions[:, None, :, None]
        bias = bias.masked_fill(hidden, float("-inf"))
    return bias.repeat_interleave(group, dim=1)


def _logits(q, keys, log_weights, positions, scale, query_positions, group):
    """q [B,H_q,c,d] float32 -> [B,H_q,c,n] scaled logits plus log-weights, causal -inf."""
    b, hq, c, d = q.shape
    hkv, n = keys.shape[1], keys.shape[2]
    logits = torch.matmul(q.reshape(b, hkv, group * c, d), keys.float().transpose(-1, -2)).view(b, hq, c, n) * scale
    return logits + _bias(log_weights, positions, query_positions, group)


def visible_slots(positions: torch.Tensor, query_positions: torch.Tensor | None) -> int:
    """Number of leading slots to keep: every slot after the last one visible to some query is dropped."""
    if query_positions is None or positions.shape[-1] == 0:
        return positions.shape[-1]
    seen = (positions <= query_positions.max()).flatten(0, 1).any(0).nonzero()
    return int(seen.max()) + 1 if seen.numel() else 0


def _plain_causal(summary: KVSummary, query_positions: torch.Tensor | None) -> bool:
    """True when the slots are exactly the queries' own tokens, unweighted: ordinary causal self-attention (a prefill)."""
    nq = query_positions.shape[-1] if query_positions is not None else 0
    return (
        nq > 1
        and summary.normalizer is None
        and summary.num_slots == nq
        and bool((summary.log_weights == 0).all())
        and bool((summary.positions == query_positions[:, None, :]).all())
    )


def weighted_attention(
    queries: torch.Tensor,
    summary: KVSummary,
    scale: float | None = None,
    query_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of queries over a summary.

    queries [B, H_q, q, d] with H_q a multiple of H_kv (grouped-query attention: query head h
    reads KV head h // (H_q / H_kv)); scale defaults to 1/sqrt(d). query_positions [q] or [B, q]:
    when given, a query attends only to slots whose position is <= its own (causal). A query with
    no visible slot gets 0. Returns [B, H_q, q, d_v] in the queries' dtype.

    Without a normalizer this is SDPA with the log-weights (and causality) as an additive bias;
    with one, numerator and denominator are separate log-sum-exps. Queries go in chunks so no
    more than about _MAX_LOGITS scores exist at once, and slots after the last one a chunk can
    see are skipped.
    """
    check_queries(queries, summary.keys, "the summary's keys")
    b, hq, nq, d = queries.shape
    hkv = summary.keys.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    group = hq // hkv
    if query_positions is not None:
        query_positions = query_positions.to(summary.positions.device).long().expand(b, nq)
    if _plain_causal(summary, query_positions):
        out = F.scaled_dot_product_attention(
            queries.float(), summary.keys.float(), summary.values.float(), is_causal=True, scale=scale, enable_gqa=True
        )
        return out.to(queries.dtype)
    den = summary.denominator()
    n_slots = summary.num_slots + (den.keys.shape[2] if summary.normalizer is not None else 0)
    chunk = max(1, _MAX_LOGITS // max(1, b * hq * n_slots))
    q = queries.float()
    outs = []
    for start in range(0, nq, chunk):
        qc = q[:, :, start : start + chunk]
        qpos = query_positions[:, start : start + chunk] if query_positions is not None else None
        n = visible_slots(summary.positions, qpos)
        keys, values = summary.keys[:, :, :n], summary.values[:, :, :n].float()
        log_weights, positions = summary.log_weights[:, :, :n], summary.positions[:, :, :n]
        if summary.normalizer is None:
            bias = _bias(log_weights, positions, qpos, group).expand(b, hq, qc.shape[2], n)
            out = F.scaled_dot_product_attention(qc, keys.float(), values, attn_mask=bias, scale=scale, enable_gqa=True)
            outs.append(out.nan_to_num(0.0))
            continue
        logits = _logits(qc, keys, log_weights, positions, scale, qpos, group)
        den_logits = _logits(qc, den.keys, den.log_weights, den.positions, scale, qpos, group)
        log_den = torch.logsumexp(den_logits, dim=-1, keepdim=True)
        top = logits.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
        num = torch.matmul(torch.exp(logits - top).view(b, hkv, -1, n), values).view(b, hq, qc.shape[2], -1)
        outs.append(num * torch.exp(top - log_den).nan_to_num(0.0, posinf=0.0))
    return torch.cat(outs, dim=2).to(queries.dtype)


def exact_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None = None, causal_offset: int | None = None
) -> torch.Tensor:
    """Reference attention over every token (the 'Attn' that relative errors are measured against).

    queries [B,H_q,q,d], keys/values [B,H_kv,n,d]. causal_offset: position of the first query
    relative to the first key (query i sees keys <= causal_offset + i); None for non-causal.
    """
    n = keys.shape[2]
    positions = torch.arange(n, device=keys.device)
    qpos = None
    if causal_offset is not None:
        qpos = torch.arange(queries.shape[2], device=keys.device) + causal_offset
    return weighted_attention(queries, KVSummary.exact(keys, values, positions), scale, qpos)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """‖approx − exact‖_F / ‖exact‖_F, in float64."""
    return float((approx.double() - exact.double()).norm() / exact.double().norm())
