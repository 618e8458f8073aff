"""Attention matching: refit the log-weights (and values) of a kept subset so it attends like the whole middle.

Zweiger, Fu, Guo and Kim, "Fast KV Compaction via Attention Matching", arXiv:2602.16284.

A method that keeps a subset S of a head's middle tokens (sink and window stay exact beside it) changes two things
for every later query q: the middle's mass, Σ_j exp(s<q, k_j>), its share of the softmax normaliser against the
sink, the window and the tokens generated later, shrinks to the kept tokens' share; and its local output, the
middle's own softmax average of the values, becomes the average over S alone. The paper's observation is that both
can be put back for a set of reference queries q_i without moving any key, since a kept slot may stand for more
than one token (a log-weight, `KVSummary.log_weights`) and may hold another value:

- mass: weights w_j = exp(log_weight_j) >= 0 with Σ_{j in S} w_j exp(s<q_i, k_j>) ≈ Σ_j exp(s<q_i, k_j>). Divided
  by its right side this reads Σ_{j in S} p_ij w_j ≈ 1, with p_ij the middle's own softmax probability of key j for
  query i: a non-negative least-squares problem in w (solved here by accelerated projected gradient descent from w = 1,
  the plain kept subset, `MASS_STEPS` steps of size 1/λ_max);
- output: with w fixed, values C with Σ_{j in S} a_ij C_j ≈ Σ_j p_ij v_j, where a_ij is the kept slots' softmax
  (log-weights included) for query i: an ordinary least-squares problem, solved with a ridge toward the kept
  tokens' own values (weight `VALUE_RIDGE` times the mean diagonal), so a slot no reference query reads keeps
  its value.

The reference queries are the ones a method is given (`Tokens.queries`, [B, H_q, q, d]; for KVzip the context's
reconstruction queries, the paper's "repeat-prefill" queries); every one of them follows every middle token. A KV
head is fitted on the queries of all its query heads together. The keys stay the kept tokens' own (the paper's
subset selection; which subset is the method's choice).

Logits, probabilities and the accumulated Gram matrices are float32, formed over blocks of queries of at most
`MAX_LOGITS` scores (the kept columns are held for every query at once: m·t floats per head); the values'
solve runs in float64, by a Cholesky factorisation of its ridged normal equations. The refitted values are stored in the values' dtype. A scorer that formed the reference
queries' normalisers over the middle while scoring (KVzip's reconstruction) hands them on, and the mass fit then
forms the kept keys' logits only.
"""

from __future__ import annotations

import torch

from ..summary import take_slots
from .kvzip import MAX_LOGITS
from .tokens import Tokens

MASS_STEPS = 200  # projected gradient steps of the mass fit
VALUE_RIDGE = 1e-3  # the values' ridge toward the kept tokens' own, relative to the mean diagonal of the normal equations
MIN_WEIGHT = 1e-3  # the smallest weight a kept slot is given (log-weight about -6.9): every kept slot stays attended
GRAM_BLOCK = 256  # columns per block of a Gram product (formed on and above the diagonal only)
REFERENCE_QUERIES = 16384  # the most reference queries a KV head is fitted on (evenly spaced among its rows; bounds memory)


def kept_attention(tokens: Tokens, index: torch.Tensor, real: torch.Tensor, outputs: bool,
                   middle_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(kept [B, H_kv, m, t], local [B, H_kv, m, d_v] or None) float32: for each reference query (a KV head's rows
    are the queries of its query heads, of which m <= `REFERENCE_QUERIES` evenly spaced ones are taken), its softmax
    over the middle's keys at the kept slots `index` [B, H_kv, t] (padding slots, real False, 0), and (`outputs`) the
    middle's local output, that softmax's average of every value. The softmax's normaliser is a log-sum-exp over
    every middle key, formed over blocks of queries of at most `MAX_LOGITS` scores, or taken from middle_lse
    [B, H_kv, group·q] (every query's, as the scorer formed it: `ScoreMethod.score_and_middle_lse`); then only the
    kept keys' logits are formed, unless `outputs` needs every value's weight."""
    b, hq, nq, d = tokens.queries.shape
    hkv, n = tokens.keys.shape[1], tokens.keys.shape[2]
    group = hq // hkv
    queries = tokens.queries.float().reshape(b, hkv, group * nq, d)
    stride = -(-group * nq // REFERENCE_QUERIES)
    queries = queries[:, :, ::stride] * tokens.scale
    if middle_lse is not None:
        middle_lse = middle_lse[:, :, ::stride].unsqueeze(-1)
    keys, values = tokens.keys.float().transpose(-1, -2), tokens.values.float()
    kept_keys = take_slots(tokens.keys, index).float().transpose(-1, -2)
    rows = max(1, MAX_LOGITS // max(1, b * hkv * n))
    kept, local = [], []
    for start in range(0, queries.shape[2], rows):
        block = queries[:, :, start : start + rows]
        logits = torch.matmul(block, keys) if outputs or middle_lse is None else None
        lse = logits.logsumexp(-1, keepdim=True) if middle_lse is None else middle_lse[:, :, start : start + rows]
        kept.append((torch.matmul(block, kept_keys) - lse).exp_() * real.unsqueeze(2))
        if outputs:
            local.append(logits.sub_(lse).exp_() @ values)
    return torch.cat(kept, 2), (torch.cat(local, 2) if outputs else None)


def fit_log_weights(kept: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, t] float32: the log-weights of the kept slots (kept [B, H_kv, m, t], `kept_attention`'s; real
    [B, H_kv, t] False for padding, which comes after a head's kept slots and gets log-weight -inf) that best restore
    the middle's mass for the reference queries: min over w >= `MIN_WEIGHT` of Σ_i (Σ_j kept_ij w_j - 1)^2 (module
    docstring). Each head is solved over its own slots (heads keep very different numbers of them)."""
    gram, target = _gram(kept, real), kept.sum(2)
    log_weights = torch.full(real.shape, float("-inf"), device=kept.device, dtype=torch.float32)
    for row, heads in enumerate(real.sum(-1).tolist()):
        for head, count in enumerate(heads):
            weights = _mass_weights(gram[row, head, :count, :count], target[row, head, :count])
            log_weights[row, head, :count] = weights.log()
    return log_weights


def _mass_weights(gram: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[t]: argmin over w >= `MIN_WEIGHT` of wᵀ·gram·w - 2·targetᵀ·w (gram [t, t] symmetric positive semi-definite),
    by accelerated projected gradient (FISTA's momentum, `MASS_STEPS` steps of size 1/λ_max) from w = 1."""
    step = 1.0 / _largest_eigenvalue(gram).clamp_min(1e-12)
    weights = previous = torch.ones_like(target)
    for k in range(MASS_STEPS):
        ahead = weights + (k / (k + 3)) * (weights - previous)
        previous = weights
        weights = (ahead - step * (gram @ ahead - target)).clamp_min(MIN_WEIGHT)
    return weights


def _gram(matrix: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """[B, H, t, t]: matrixᵀ·matrix per head for matrix [B, H, m, t] whose columns past each head's real slots (real
    [B, H, t], a prefix of each head's) are zero: each head's product is formed over its own slots only, the rest
    left 0. The product is symmetric: it is formed in blocks of `GRAM_BLOCK` columns, those on and above the diagonal,
    and the ones below are their transposes."""
    out = matrix.new_zeros(*matrix.shape[:2], matrix.shape[-1], matrix.shape[-1])
    for row, heads in enumerate(real.sum(-1).tolist()):
        for head, count in enumerate(heads):
            columns = matrix[row, head, :, :count]
            for first in range(0, count, GRAM_BLOCK):
                stop = min(first + GRAM_BLOCK, count)
                block = columns[:, first:stop].transpose(0, 1) @ columns[:, first:]
                out[row, head, first:stop, first:count] = block
                out[row, head, stop:count, first:stop] = block[:, stop - first :].transpose(0, 1)
    return out


def _largest_eigenvalue(gram: torch.Tensor, iterations: int = 30) -> torch.Tensor:
    """The largest eigenvalue of the symmetric positive semi-definite gram [t, t] (power iteration, 1.05 times the
    estimate so a step of its inverse never overshoots)."""
    vector = torch.ones(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    for _ in range(iterations):
        vector = gram @ vector
        vector = vector / vector.norm().clamp_min(torch.finfo(gram.dtype).tiny)
    return 1.05 * (vector @ (gram @ vector))


def fit_values(kept: torch.Tensor, local: torch.Tensor, own: torch.Tensor, real: torch.Tensor,
               log_weights: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, t, d_v] float32: the values of the kept slots whose attention, with `log_weights` [B, H_kv, t],
    best reproduces the middle's local output for the reference queries (kept [B, H_kv, m, t] and local
    [B, H_kv, m, d_v], `kept_attention`'s), ridged toward their own values own [B, H_kv, t, d_v]; padding slots
    (real False) get 0 (module docstring)."""
    attention = kept * log_weights.exp().unsqueeze(2)
    attention = attention / attention.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    gram = _gram(attention, real).double()
    moment = (attention.transpose(-1, -2) @ local).double()
    ridge = (VALUE_RIDGE * gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-12))[..., None, None]
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    # positive definite (a Gram matrix plus a positive ridge): Cholesky, half the work of the LU a general solve does (and
    # the batched LU solve of the CPU build breaks at 2 threads on some widths, tests/test_attention_matching.py)
    factor = torch.linalg.cholesky(gram + ridge * eye)
    fitted = torch.cholesky_solve(moment + ridge * own.double(), factor)
    return fitted.float().masked_fill(~real.unsqueeze(-1), 0)


def refit_kept(tokens: Tokens, index: torch.Tensor, real: torch.Tensor, own: torch.Tensor, values: bool,
               middle_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_weights [B, H_kv, t] float32, values [B, H_kv, t, d_v] in the values' dtype) of the kept slots `index`
    [B, H_kv, t] of `tokens` (real [B, H_kv, t] False for padding: log-weight -inf, value 0), whose own values are
    own [B, H_kv, t, d_v]: the log-weights fitted to the middle's mass for `tokens.queries`, and the values fitted to
    its output (`values`) or `own` as given. middle_lse: the queries' normalisers over the middle, if the scorer
    formed them (`kept_attention`)."""
    kept, local = kept_attention(tokens, index, real, outputs=values, middle_lse=middle_lse)
    log_weights = fit_log_weights(kept, real)
    if not values:
        return log_weights, own
    return log_weights, fit_values(kept, local, own.float(), real, log_weights).to(own.dtype)
