"""Weighted attention over a KVSummary (docs/design.md, "One summary for every method").

out(q) = Σ_i w_i exp(s<q,k_i>) v_i / Σ_j w'_j exp(s<q,k'_j>), with (k', w') the normalizer when
present, else the same slots. Everything runs in the inputs' own dtype through
`F.scaled_dot_product_attention`, which accumulates in float32 inside the kernel; log-weights
enter as an additive bias (log space), so float16/bfloat16 never see exp(logit) outside it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .checks import check_bool, check_kv, check_queries, check_scale, describe
from .ragged import RaggedSummary, concat_parts
from .summary import KVSummary

# Largest number of mask entries materialised at once (per call); queries are processed in
# chunks below it so a long causal block never holds a full [H, q, n] mask.
_MAX_LOGITS = 1 << 25


# Logits exponentiated outside SDPA (`exp_rows_`, `received_attention`) are scaled by this factor
# beforehand, folded into the attention scale so it costs no extra pass: exp(x) = 2^(x·log2 e), and on
# the CPU torch's base-2 exponential runs several times faster than its natural one (0.12 against
# 0.56 ns per float32 on one AVX-512 core), with the same accuracy (within 1e-7 relative).
LOG2_E = math.log2(math.e)


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
    A query with no visible slot gets 0. Returns [B, H_q, q, d_v]. Shapes and dtypes are checked, values are not (this
    is the decode path, where reading them is a device sync per layer and step): a summary holding NaN or +inf (which
    no method of the library builds) gives an undefined result, where `exact_attention` refuses such inputs.

    An eviction-only summary (`summary.eviction_only`) needs no bias: a decode step (q = 1) or a
    non-causal call is one plain SDPA call with no mask, a prefill (all slots are the queries')
    is SDPA with is_causal. A weighted summary adds its log-weights as a bias in the queries'
    dtype (its rounding, |log w|·2^-8 in bfloat16, is below that of the bfloat16 keys' logits).
    A normalizer is folded into the same call (see `_with_normalizer`); only the per-query
    ratio is formed in float32.
    """
    if not isinstance(summary, KVSummary):
        raise ValueError(f"summary must be a KVSummary (kvc.compress returns one), got {type(summary).__name__}")
    check_queries(queries, summary.keys, "the summary's keys")
    b, hq, nq, d = queries.shape
    scale = check_scale(scale)
    if query_positions is not None and causal_tail:
        raise ValueError("pass query_positions or causal_tail=True, not both")
    check_bool("causal_tail", causal_tail)
    if query_positions is not None and (not isinstance(query_positions, torch.Tensor) or query_positions.is_floating_point()
                                        or query_positions.dtype == torch.bool or tuple(query_positions.shape) not in ((nq,), (b, nq))):
        raise ValueError(f"query_positions must be an integer tensor [q] = [{nq}] or [B, q] = [{b}, {nq}], got {describe(query_positions)}")
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
    if split is None and _flash_fits(queries, values):
        return _held_then_block_attention(queries, keys, values, log_weights, scale)
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


# The CPU flash-attention kernel, which also returns each query's log-sum-exp (torch >= 2.3); None where absent.
_FLASH_WITH_LOGSUMEXP = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _flash_fits(queries: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `_FLASH_WITH_LOGSUMEXP` serves these queries: it exists, they are on the CPU, the values' head dim is the
    keys' (the kernel takes one head size), and the dtype is one whose parts `_merge_parts` merges without losing
    precision (float64 takes the masked path, all in float64)."""
    return (_FLASH_WITH_LOGSUMEXP is not None and queries.device.type == "cpu" and values.shape[-1] == queries.shape[-1]
            and queries.dtype in (torch.float32, torch.float16, torch.bfloat16))


def _held_then_block_attention(queries, keys, values, log_weights, scale):
    """Causal-tail attention on the CPU without a per-query mask over the held slots. -> [B, H_q, q, d_v].

    queries [B,H_q,q,d]; keys/values [B,H_kv,n,*] whose last q slots are the queries' own block; log_weights
    [B,H_kv,n] or None. The two flash-attention calls of `_held_then_block_parts`, merged by their log-sum-exps in
    float32 (`_merge_parts`), which is the one softmax over all n slots; a query that sees nothing at all gets 0.
    """
    return _merge_parts(_held_then_block_parts(queries, keys, values, log_weights, scale), queries.dtype)


def _held_then_block_parts(queries, keys, values, log_weights, scale) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`_held_then_block_attention` before the merge: [(output [B,H_q,q,d_v], log-sum-exp [B,H_q,q] float32)] of the
    queries over the n - q held slots (the GQA group folded into the query axis, every slot visible, the log-weights
    one bias row per head broadcast over the queries: a view, the [B,H_kv,group·q,n] mask of the one-call form is
    never written; left out when nothing is held), then over their own block, causal. A head with no finite
    log-weight among its held slots contributes nothing (the kernel returns 0 and a log-sum-exp of 0 for such a row,
    so its log-sum-exp is set to -inf here), as does a block slot of log-weight -inf. A decode step (q = 1) sees every
    slot, its own included: one call over all n, one part."""
    b, hq, nq, d = queries.shape
    hkv, n = keys.shape[1], keys.shape[2]
    group, held = hq // hkv, n - nq
    if nq == 1:
        return [_every_slot_part(queries, keys, values, log_weights, scale)]
    own_keys, own_values = (t[:, :, held:].repeat_interleave(group, 1) for t in (keys, values))
    own_weights = None if log_weights is None else log_weights[:, :, held:]
    if own_weights is None or bool((own_weights == 0).all()):  # the block's own tokens, exact (one host read per block)
        own, own_lse = _FLASH_WITH_LOGSUMEXP(queries, own_keys, own_values, 0.0, True, scale=scale)
    else:
        hidden = torch.ones(nq, nq, dtype=torch.bool, device=queries.device).triu(1)
        own_bias = own_weights[:, :, None, :].to(queries.dtype).masked_fill(hidden, float("-inf")).repeat_interleave(group, 1)
        own, own_lse = _FLASH_WITH_LOGSUMEXP(queries, own_keys, own_values, 0.0, False, attn_mask=own_bias, scale=scale)
        unseen = torch.isneginf(own_weights).int().cummin(-1).values.bool()  # [B, H_kv, q]: its block's slots up to it all empty
        own_lse = own_lse.masked_fill(unseen.repeat_interleave(group, 1), float("-inf"))
    if held == 0:
        return [(own, own_lse)]
    held_part = _every_slot_part(queries, keys[:, :, :held], values[:, :, :held],
                                 None if log_weights is None else log_weights[:, :, :held], scale)
    return [held_part, (own, own_lse)]


def _every_slot_part(queries, keys, values, log_weights, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [B,H_q,q,d_v], log-sum-exp [B,H_q,q] float32) of the queries over keys/values [B,H_kv,n,*], every slot
    visible to every query: one flash-attention call, the GQA group folded into the query axis, the log-weights
    [B,H_kv,n] (or None) one bias row per head broadcast over the queries (a view). A head with no finite log-weight
    contributes nothing (log-sum-exp -inf)."""
    b, hq, nq, d = queries.shape
    hkv, n = keys.shape[1], keys.shape[2]
    group = hq // hkv
    folded = queries.reshape(b, hkv, group * nq, d)
    bias = None if log_weights is None else log_weights[:, :, None, :].to(queries.dtype).expand(b, hkv, group * nq, n)
    out, lse = _FLASH_WITH_LOGSUMEXP(folded, keys, values, 0.0, False, attn_mask=bias, scale=scale)
    if log_weights is not None:
        lse = lse.masked_fill(~torch.isfinite(log_weights).any(-1)[:, :, None], float("-inf"))
    return out.reshape(b, hq, nq, -1), lse.reshape(b, hq, nq)


def _packed_parts(queries, packed: RaggedSummary, scale) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(output [B,H_q,q,d_v], log-sum-exp [B,H_q,q] float32)]: the queries over a packed summary's slots, every one
    visible, read where they are stored: one flash-attention call per (batch row, KV head) over its run of packed rows
    (a view, no copy; the GQA group folded into the query axis), its log-weights one bias row. A head that keeps no
    slot contributes nothing (output 0, log-sum-exp -inf)."""
    b, hq, nq, d = queries.shape
    hkv = packed.counts.shape[1]
    group, dv = hq // hkv, packed.values.shape[-1]
    folded = queries.reshape(b, hkv, group * nq, d)
    out = queries.new_zeros(b, hkv, group * nq, dv)
    lse = torch.full((b, hkv, group * nq), float("-inf"), device=queries.device, dtype=torch.float32)
    keys, values = packed.keys.to(queries.dtype), packed.values.to(queries.dtype)
    start = 0
    for run, count in enumerate(packed.run_counts):  # the counts, read from the device once per packing
        if count:
            row, head = divmod(run, hkv)
            rows = slice(start, start + count)
            bias = None if packed.log_weights is None else \
                packed.log_weights[rows].to(queries.dtype).view(1, 1, 1, count).expand(1, 1, group * nq, count)
            o, l = _FLASH_WITH_LOGSUMEXP(folded[row : row + 1, head : head + 1], keys[rows].view(1, 1, count, d),
                                         values[rows].view(1, 1, count, dv), 0.0, False, attn_mask=bias, scale=scale)
            out[row, head], lse[row, head] = o[0, 0], l[0, 0]
        start += count
    return [(out.reshape(b, hq, nq, dv), lse.reshape(b, hq, nq))]


def _merge_parts(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """One softmax over the union of the parts' slots, from each part's output [B,H_q,q,d_v] and log-sum-exp [B,H_q,q]
    (-inf: the part shows the query nothing): outputs weighted by exp(lse - max lse), in float32. -> [B,H_q,q,d_v] in
    `dtype`; a query that sees nothing at all gets 0."""
    if len(parts) == 1:
        return parts[0][0].nan_to_num(0.0).to(dtype)
    lses = torch.stack([lse for _, lse in parts]).float()  # [parts, B, H_q, q]
    shares = lses.sub_(lses.amax(0).nan_to_num_(0.0, neginf=0.0)).exp_().unsqueeze(-1)
    merged = parts[0][0].float() * shares[0]
    for (out, _), share in zip(parts[1:], shares[1:]):
        merged.addcmul_(out.float(), share)
    return merged.div_(shares.sum(0)).nan_to_num_(0.0).to(dtype)


def packed_then_causal_attention(queries: torch.Tensor, packed: list[RaggedSummary], summary: KVSummary,
                                 scale: float | None = None) -> torch.Tensor:
    """`weighted_attention(queries, concat_parts([*packed, summary]), scale, causal_tail=True)` without unpacking the
    packed summaries: slots every query sees, stored head after head (`RaggedSummary`: a layer's kept tokens when its
    heads keep different numbers), then `summary`, whose last q slots are the queries' own block. On the CPU each
    packed summary is attended where it is stored (`_packed_parts`) and `summary` as `_held_then_block_attention`
    does, the parts merged by their log-sum-exps; elsewhere (no CPU flash kernel, or a normalizer) the packed slots
    are unpacked into one summary first. -> [B, H_q, q, d_v]."""
    check_queries(queries, summary.keys, "the summary's keys")
    if scale is None:
        scale = 1.0 / math.sqrt(queries.shape[-1])
    if not _flash_fits(queries, summary.values) or summary.normalizer is not None or any(
            p.values.shape[-1] != queries.shape[-1] for p in packed):
        return weighted_attention(queries, concat_parts([*packed, summary]), scale, causal_tail=True)
    if summary.num_slots < queries.shape[2]:
        raise ValueError(f"the summary must end with the queries' own {queries.shape[2]} tokens; it has {summary.num_slots} slots")
    log_weights = None if summary.eviction_only else summary.log_weights
    keys, values = summary.keys.to(queries.dtype), summary.values.to(queries.dtype)
    parts = [part for p in packed for part in _packed_parts(queries, p, scale)]
    return _merge_parts(parts + _held_then_block_parts(queries, keys, values, log_weights, scale), queries.dtype)


def exact_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None = None, causal_offset: int | None = None
) -> torch.Tensor:
    """Reference attention over every token (the 'Attn' that relative errors are measured against).

    queries [B,H_q,q,d], keys/values [B,H_kv,n,d]. causal_offset: position of the first query
    relative to the first key (query i sees keys <= causal_offset + i); None for non-causal.
    """
    check_kv(keys, values, queries)
    if causal_offset is not None and (isinstance(causal_offset, bool) or not isinstance(causal_offset, int)
                                      or abs(causal_offset) >= 2**62):
        raise ValueError(f"causal_offset must be an integer (the first query's position less the first key's, below 2**62 in "
                         f"size) or None, got {causal_offset!r}")
    n, nq = keys.shape[2], queries.shape[2]
    summary = KVSummary.exact(keys, values, torch.arange(n, device=keys.device))
    if causal_offset is None or causal_offset == n - nq:
        return weighted_attention(queries, summary, scale, causal_tail=causal_offset is not None)
    qpos = torch.arange(nq, device=keys.device) + causal_offset
    return weighted_attention(queries, summary, scale, qpos)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """‖approx − exact‖_F / ‖exact‖_F, in float64; an exact tensor of zeros is refused (no relative error exists)."""
    if (not isinstance(approx, torch.Tensor) or not isinstance(exact, torch.Tensor) or approx.shape != exact.shape
            or approx.device != exact.device or approx.is_complex() or exact.is_complex()):
        raise ValueError(f"approx and exact must be real tensors of one shape on one device, got {describe(approx)} and {describe(exact)}")
    scale = exact.double().norm()
    if scale == 0:
        raise ValueError(f"exact is all zeros ({describe(exact)}): the error relative to it is undefined; compare absolute errors")
    return float((approx.double() - exact.double()).norm() / scale)


AVERAGES = ("group", "layer")


def received_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    query_positions: torch.Tensor | None = None,
    exact_keys: torch.Tensor | None = None,
    exact_positions: torch.Tensor | None = None,
    average: str = "group",
    max_logits: int = 1 << 22,
) -> torch.Tensor:
    """[B, H_kv, n]: softmax attention of queries [B,H_q,n_q,d] on keys [B,H_kv,n,d], summed over queries.

    The softmax runs over every key the queries see: `keys` and `exact_keys` [B,H_kv,m,d] (the
    sink and window kept exactly beside them, at `exact_positions` [B,H_kv,m]), as attention itself
    does; a query sees only keys at or before its own position when `query_positions` [n_q] is
    given (keys at `positions` [B,H_kv,n], ascending). average: "group" means over the query heads
    of each KV head (GQA group); "layer" means over every query head of the layer, the same score
    for each KV head. Queries go in chunks of at most `max_logits` scores at the scale `scale` (one
    base-2 exponential per score, no softmax tensor beyond one chunk; the max shift is skipped when
    every logit is bounded well inside float32's exponent range).
    """
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {AVERAGES}, got {average!r}")
    qpos = query_positions
    b, hq, nq, d = queries.shape
    n_keys = keys.shape[2]
    hkv = keys.shape[1]
    group = hq // hkv
    keys = keys.float()
    exact_pos = exact_positions if exact_keys is not None else positions[:, :, :0]
    exact_keys = exact_keys.float() if exact_keys is not None else keys.new_zeros(b, hkv, 0, d)
    q = (queries.float() * (scale * LOG2_E)).reshape(b, hkv, group, nq, d).transpose(2, 3)  # [B, H_kv, n_q, group, d], base-2 logits
    mass = torch.zeros(b, hkv, n_keys, device=keys.device, dtype=torch.float32)
    # |logit| <= ‖q‖·max‖k‖ (Cauchy-Schwarz): below 80, and below 88 - ln(keys) so that a row's total of
    # n exponentials cannot overflow either (natural units; the logits here are base 2, `LOG2_E`), every
    # exp stays finite and non-zero in float32 and the per-query max shift can be skipped.
    norms = [k.norm(dim=-1).amax() for k in (keys, exact_keys) if k.shape[2]]  # no copy of the keys
    key_norm = torch.stack(norms).amax() if norms else keys.new_zeros(())
    bounded = float(q.norm(dim=-1).amax() * key_norm) < min(80.0, 88.0 - math.log(max(1, n_keys + exact_keys.shape[2]))) * LOG2_E
    chunk = max(1, max_logits // max(1, b * hq * (n_keys + exact_keys.shape[2])))
    for start in range(0, nq, chunk):
        qc = q[:, :, start : start + chunk]
        c = qc.shape[2]
        qp = qpos[start : start + chunk].to(keys.device) if qpos is not None else None
        n = visible_slots(positions, qp)
        rows = qc.reshape(b, hkv, c * group, d)
        logits = _masked_logits(rows, keys[:, :, :n], positions[:, :, :n], qp, group)
        exact_logits = _masked_logits(rows, exact_keys, exact_pos, qp, group)
        if not bounded:
            top = torch.maximum(_row_max(logits), _row_max(exact_logits)).clamp_min(torch.finfo(torch.float32).min).unsqueeze(-1)
            logits.sub_(top)
            exact_logits.sub_(top)
        total = logits.exp2_().sum(-1) + exact_logits.exp2_().sum(-1)
        inverse = torch.where(total > 0, total.reciprocal(), torch.zeros_like(total))
        mass[:, :, :n] += torch.matmul(inverse.unsqueeze(-2), logits).squeeze(-2)
    mass /= group
    if average == "layer":
        mass = mass.mean(dim=1, keepdim=True).expand(b, hkv, n_keys)
    return mass


# Unshifted exponentials are trusted while every row's total lies within [2^-limit, 2^limit]; a
# model's logits lie far inside float32's range (within ±40, ±58 in base 2, on the default model at 4k tokens).
TOTAL_LOG2_LIMIT = 100.0


def exp_rows_(logits: torch.Tensor, shifted: bool, inverse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax rows of base-2 logits [..., r, n] (natural logits times `LOG2_E`), unnormalised and
    in place: (2^(logits − shift), the reciprocal of each row's total [..., r, 1], written into
    `inverse` when given).

    shift is each row's max if `shifted` (every total then lies in [1, n]), else 0: one pass fewer,
    exact while the totals stay within 2^±TOTAL_LOG2_LIMIT; `totals_in_range` of the reciprocals
    tells the caller to redo the rows shifted otherwise (an overflow gives inf, NaN inputs NaN: both
    out of range).
    """
    if shifted:
        logits.sub_(logits.amax(-1, keepdim=True))
    probs = logits.exp2_()
    return probs, torch.sum(probs, -1, keepdim=True, out=inverse).reciprocal_()


def log2_range(inverse: torch.Tensor) -> torch.Tensor:
    """The largest |log2| of the row totals whose reciprocals `exp_rows_` gave, as a 0-d tensor (inf or NaN when one left float32's range)."""
    return inverse.log2().abs_().amax()


def totals_in_range(total_range: torch.Tensor) -> bool:
    """Whether the largest |log2| of a row total (`log2_range`, NaN included) allows the unshifted rows (one host read)."""
    return bool(total_range < TOTAL_LOG2_LIMIT)


def _row_max(x: torch.Tensor) -> torch.Tensor:
    """Max over the last axis, -inf for an empty one."""
    return x.amax(-1) if x.shape[-1] else x.new_full(x.shape[:-1], float("-inf"))


def _masked_logits(rows: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, query_positions, group: int) -> torch.Tensor:
    """rows [B,H_kv,c*group,d] (query-major) x keys [B,H_kv,n,d] -> [B,H_kv,c*group,n], -inf where a key lies after its query.

    Positions ascend along the slot axis, so only the slots after the first query's position are masked.
    """
    logits = torch.matmul(rows, keys.transpose(-1, -2))
    if query_positions is not None and keys.shape[2]:
        start = int((positions <= query_positions.min()).sum(-1).min())
        hidden = positions[:, :, None, start:] > query_positions.repeat_interleave(group)[None, None, :, None]
        logits[..., start:].masked_fill_(hidden, float("-inf"))
    return logits
