"""Weighted attention over a KVSummary (DESIGN.md §1).

out(q) = Σ_i w_i exp(s<q,k_i>) v_i / Σ_j w'_j exp(s<q,k'_j>), with (k', w') the normalizer when
present, else the same slots; computed in log space with float32 accumulators for any input dtype.
"""

from __future__ import annotations

import math

import torch

from .summary import KVSummary

# Largest number of float32 logits materialised at once (per call); queries are processed in
# chunks below it so a 4k-token prefill never holds a full [H, q, n] score tensor.
_MAX_LOGITS = 1 << 25


def _masked_logits(q, keys, log_weights, positions, scale, query_positions):
    """q [B,Hkv,g,c,d] (float32), keys [B,Hkv,n,d] -> [B,Hkv,g,c,n] logits + log-weights, causal -inf."""
    logits = torch.einsum("bhgqd,bhnd->bhgqn", q, keys.float()) * scale
    logits = logits + log_weights.float()[:, :, None, None, :]
    if query_positions is not None:
        hidden = positions[:, :, None, None, :] > query_positions[:, None, None, :, None]
        logits = logits.masked_fill(hidden, float("-inf"))
    return logits


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
    """
    b, hq, nq, d = queries.shape
    hkv = summary.keys.shape[1]
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    group = hq // hkv
    if query_positions is not None:
        query_positions = query_positions.to(summary.positions.device).long().expand(b, nq)
    den = summary.denominator()
    n_slots = summary.num_slots + (den.keys.shape[2] if summary.normalizer is not None else 0)
    chunk = max(1, _MAX_LOGITS // max(1, b * hq * n_slots))
    q = queries.float().reshape(b, hkv, group, nq, d)
    values = summary.values.float()
    outs = []
    for start in range(0, nq, chunk):
        qc = q[:, :, :, start : start + chunk]
        qpos = query_positions[:, start : start + chunk] if query_positions is not None else None
        logits = _masked_logits(qc, summary.keys, summary.log_weights, summary.positions, scale, qpos)
        if summary.normalizer is None:
            log_den = torch.logsumexp(logits, dim=-1, keepdim=True)
            probs = torch.exp(logits - log_den).nan_to_num(0.0)
            out = torch.einsum("bhgqn,bhnd->bhgqd", probs, values)
        else:
            den_logits = _masked_logits(qc, den.keys, den.log_weights, den.positions, scale, qpos)
            log_den = torch.logsumexp(den_logits, dim=-1, keepdim=True)
            top = logits.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
            num = torch.einsum("bhgqn,bhnd->bhgqd", torch.exp(logits - top), values)
            out = num * torch.exp(top - log_den).nan_to_num(0.0, posinf=0.0)
        outs.append(out)
    out = torch.cat(outs, dim=3).reshape(b, hq, nq, -1)
    return out.to(queries.dtype)


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
