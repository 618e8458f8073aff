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
`MAX_LOGITS` scores; the two small solves run in float64. The refitted values are stored in the values' dtype.
"""

from __future__ import annotations

import torch

from .kvzip import MAX_LOGITS
from .tokens import Tokens

MASS_STEPS = 200  # projected gradient steps of the mass fit
VALUE_RIDGE = 1e-3  # the values' ridge toward the kept tokens' own, relative to the mean diagonal of the normal equations
MIN_WEIGHT = 1e-3  # the smallest weight a kept slot is given (log-weight about -6.9): every kept slot stays attended


def _query_blocks(tokens: Tokens):
    """Yield p [B, H_kv, r, n] float32: each block of reference queries' softmax over the middle's keys (a KV head's
    rows are the queries of its query heads)."""
    b, hq, nq, d = tokens.queries.shape
    hkv, n = tokens.keys.shape[1], tokens.keys.shape[2]
    group = hq // hkv
    queries = (tokens.queries.float() * tokens.scale).reshape(b, hkv, group * nq, d)
    keys = tokens.keys.float().transpose(-1, -2)
    rows = max(1, MAX_LOGITS // max(1, b * hkv * n))
    for start in range(0, group * nq, rows):
        yield torch.matmul(queries[:, :, start : start + rows], keys).softmax(-1)


def _columns(p: torch.Tensor, index: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """p [B, H, r, n] -> [B, H, r, t]: the columns of the kept slots `index` [B, H, t]; padding slots (real False) 0."""
    picked = p.gather(-1, index.unsqueeze(2).expand(-1, -1, p.shape[2], -1))
    return picked * real.unsqueeze(2)


def fit_log_weights(tokens: Tokens, index: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, t] float32: the log-weights of the kept slots `index` [B, H_kv, t] (real [B, H_kv, t] False for
    padding, whose log-weight is -inf) that best restore the middle's mass for the reference queries (module
    docstring), each weight at least `MIN_WEIGHT`."""
    t = index.shape[-1]
    gram = torch.zeros(*index.shape[:2], t, t, device=index.device)
    target = torch.zeros(index.shape, device=index.device)
    for p in _query_blocks(tokens):
        kept = _columns(p, index, real)
        gram += kept.transpose(-1, -2) @ kept
        target += kept.sum(2)
    gram, target = gram.double(), target.double()
    step = (1.0 / _largest_eigenvalue(gram).clamp_min(1e-12)).unsqueeze(-1)
    weights = previous = real.double().clamp_min(MIN_WEIGHT)
    for k in range(MASS_STEPS):  # accelerated projected gradient (FISTA's momentum)
        ahead = weights + (k / (k + 3)) * (weights - previous)
        previous = weights
        weights = (ahead - step * ((gram @ ahead.unsqueeze(-1)).squeeze(-1) - target)).clamp_min(MIN_WEIGHT)
    return weights.log().float().masked_fill(~real, float("-inf"))


def _largest_eigenvalue(gram: torch.Tensor, iterations: int = 30) -> torch.Tensor:
    """[B, H]: the largest eigenvalue of each symmetric positive semi-definite gram [B, H, t, t] (power iteration,
    1.05 times the estimate so a step of its inverse never overshoots)."""
    vector = torch.ones(gram.shape[:-1], dtype=gram.dtype, device=gram.device)
    for _ in range(iterations):
        vector = (gram @ vector.unsqueeze(-1)).squeeze(-1)
        vector = vector / vector.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    return 1.05 * (vector * (gram @ vector.unsqueeze(-1)).squeeze(-1)).sum(-1)


def fit_values(tokens: Tokens, index: torch.Tensor, real: torch.Tensor, log_weights: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, t, d_v] in the values' dtype: the values of the kept slots `index` (with `log_weights`, both
    [B, H_kv, t]; padding slots get 0) whose attention best reproduces the middle's local output for the reference
    queries, ridged toward the kept tokens' own values (module docstring)."""
    t = index.shape[-1]
    own = tokens.values.float().gather(2, index.unsqueeze(-1).expand(-1, -1, -1, tokens.values.shape[-1]))
    weights = log_weights.exp().unsqueeze(2)
    gram = torch.zeros(*index.shape[:2], t, t, device=index.device)
    moment = torch.zeros_like(own)
    values = tokens.values.float()
    for p in _query_blocks(tokens):
        kept = _columns(p, index, real) * weights
        kept = kept / kept.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        gram += kept.transpose(-1, -2) @ kept
        moment += kept.transpose(-1, -2) @ (p @ values)
    gram, moment, own = gram.double(), moment.double(), own.double()
    ridge = VALUE_RIDGE * gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-12)
    eye = torch.eye(t, dtype=gram.dtype, device=gram.device)
    fitted = torch.linalg.solve(gram + ridge[..., None, None] * eye, moment + ridge[..., None, None] * own)
    return fitted.masked_fill(~real.unsqueeze(-1), 0).to(tokens.values.dtype)
