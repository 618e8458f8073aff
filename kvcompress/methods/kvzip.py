"""KVzip: keep the context tokens the model needs to reconstruct the context.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv:2505.23416.

The idea: once a context is prefilled, the model is asked to repeat it. The forward over that
repetition (a short repeat instruction, then the context's own tokens again, with the whole
context cache in place) reads the context through attention; a KV pair that no reconstruction
query looks at is one the model can do without for any later question, so the score is not tied
to one question (query-agnostic). Each context KV pair gets the largest attention probability it
receives from any reconstruction query, over the queries and over the query heads of its KV group;
the top `budget` per head are kept. Long contexts are reconstructed in chunks (`reconstruction_chunk_size`
tokens of the context per forward, each forward over [instruction + chunk] with the context cache
in place), which bounds the forward's memory; each chunk's queries see the context and their own
forward's keys, not the earlier chunks'.

Which queries score a token (`scoring`): "context" lets every reconstruction query score every context
token, its softmax over the whole context and its own forward's keys; "chunk" is the paper's chunked
scoring (its Sec. 3, and kvpress's KVzipPress): the queries that repeat a chunk score only that chunk's
tokens, their softmax over those tokens, the sink and their own forward's keys. With one chunk the two agree.

What a kept token is worth can also weigh its value (`value_norm`), as Guo et al., "Attention Score is not All You
Need for Token Importance Indicator in KV Cache Reduction: Value Also Matters" (EMNLP 2024) argue: a token's share of an
attention output is its probability times its value vector, so a token that draws attention but carries a small value
changes little. "absolute" adds log ‖v‖₁ to each token's log score (probability times the value's ℓ1 norm, the paper's
product); "relative" adds log(‖v‖₁ / the mean ‖v‖₁ of its head's scored tokens), which reorders a head's tokens the same
way but leaves each head's scores on the probability's scale (so budgets shared across heads and layers by score,
AdaKV's, are shared as without it). "none" (the default) is KVzip's score alone.

Contract of `score(tokens)`:
- tokens.queries [B, H_q, q, d], post-RoPE: the reconstruction queries. Every one of them comes
  after every context token, so `tokens.query_positions` is ignored (nothing in the context is
  hidden from them).
- The softmax normaliser of a query runs over everything it attends to: the context keys
  (tokens.keys [B, H_kv, n, d] and `tokens.exact_keys`, the sink and window kept beside them), and
  the reconstruction forward's own causal keys, given as their log-sum-exp per query,
  `tokens.extra_lse` [B, H_q, q] float32 (`own_lse` computes it; None: the context keys only).
- Returns [B, H_kv, n] float32: the log of the largest probability (log space: the same order as
  the probability, and no underflow to ties of 0 for keys far below the top ones).
Logits are formed in float32 (float16/bfloat16 inputs never see exp outside float32) and the
normaliser is a log-sum-exp (max-shifted); queries go in chunks of at most `reconstruction_chunk_size` and of
about `max_logits` scores, so memory does not grow with the number of queries.

At the tensor level (`kvc.compress("kvzip", keys, values, queries, ...)`) the caller's queries ARE
the reconstruction queries: their own keys are unknown there, so each query's normaliser is the
context keys only. In a model, `kvc.generate` (mode "prefill") runs the reconstruction forward
itself (`kvcompress.integration.reconstruction`) and counts its time as compression time. The
method needs the whole context at once: it runs in mode "prefill" only, and has no stream
(chunked and decode modes, `kvc.stream`, are refused with an error).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import as_count
from .base import ScoreMethod, StreamState
from .registry import register
from .requirements import Requirements
from .tokens import Tokens

# Largest number of float32 scores formed at once (per call) by `own_lse` and `reconstruction_scores`.
MAX_LOGITS = 1 << 22
DEFAULT_CHUNK_SIZE = 2048  # the paper's reconstruction chunk (tokens of the context per forward)
SCORINGS = ("context", "chunk")
VALUE_NORMS = ("none", "absolute", "relative")


def own_lse(queries: torch.Tensor, keys: torch.Tensor, scale: float, offset: int = 0, max_logits: int = MAX_LOGITS) -> torch.Tensor:
    """[B, H_q, q] float32: log Σ_j exp(scale·<q_i, k_j>) over a forward's own keys, causally.

    queries [B, H_q, q, d] (H_q a multiple of H_kv: query head h reads KV head h // (H_q / H_kv)),
    keys [B, H_kv, offset + q, d]: query i sees keys 0 .. offset + i (the `offset` keys before the
    first query, e.g. a repeat instruction, and the queries' own tokens up to itself).
    """
    b, hq, nq, d = queries.shape
    hkv, m = keys.shape[1], keys.shape[2]
    if m != offset + nq:
        raise ValueError(f"own_lse: {nq} queries after {offset} earlier keys need {offset + nq} keys, got {m}")
    group = hq // hkv
    q = (queries.float() * scale).reshape(b, hkv, group, nq, d)
    k = keys.float().unsqueeze(2)  # [B, H_kv, 1, m, d]
    chunk = max(1, max_logits // max(1, b * hq * m))
    out = []
    for start in range(0, nq, chunk):
        stop = min(nq, start + chunk)
        seen = offset + stop
        logits = torch.matmul(q[:, :, :, start:stop], k[:, :, :, :seen].transpose(-1, -2))  # [B, H_kv, group, c, seen]
        hidden = torch.arange(seen, device=keys.device)[None, :] > offset + torch.arange(start, stop, device=keys.device)[:, None]
        out.append(logits.masked_fill_(hidden, float("-inf")).logsumexp(-1))
    return torch.cat(out, dim=3).reshape(b, hq, nq)


def reconstruction_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    exact_keys: torch.Tensor | None = None,
    extra_lse: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    max_logits: int = MAX_LOGITS,
    chunk_local: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scores [B, H_kv, n] float32: log max over queries and group heads of softmax(scale·<q, k>) on each key of
    `keys`; middle_lse [B, H_kv, group·q] float32: each query's log-sum-exp over `keys` alone, a KV head's rows its
    query heads' queries head by head, or None with chunk_local, whose blocks see a chunk's keys only).

    queries [B, H_q, q, d] see every key; the normaliser of each query is over keys [B, H_kv, n, d],
    exact_keys [B, H_kv, m, d] (None: none) and the keys behind extra_lse [B, H_q, q] (their
    log-sum-exp; None: none). Float32 logits, log-sum-exp normaliser, queries in chunks.

    chunk_local (positions [n] of `keys`, exact_positions [m] of `exact_keys` or None; the same for every row and
    head): the paper's chunked scoring instead. Query j repeats context position j (q is the whole context's
    length), and the queries of a reconstruction chunk (positions c·chunk_size .. (c+1)·chunk_size - 1) score only
    the keys at those positions, normalised over them, the exact keys at those positions or before the first key
    of `keys` (the sink) and extra_lse's keys; a key's score comes from its own chunk's queries alone. Only the
    chunk's keys enter each block's logits.
    """
    b, hq, nq, d = queries.shape
    hkv, n = keys.shape[1], keys.shape[2]
    group = hq // hkv
    k = keys.float()
    ex = exact_keys.float() if exact_keys is not None and exact_keys.shape[2] else None
    width = n + (ex.shape[2] if ex is not None else 0)
    q = (queries.float() * scale).reshape(b, hkv, group, nq, d)
    lse_extra = extra_lse.float().reshape(b, hkv, group, nq) if extra_lse is not None else None
    step = max(1, min(chunk_size, max_logits // max(1, b * hq * width)))
    best = torch.full((b, hkv, n), float("-inf"), device=keys.device, dtype=torch.float32)
    middle_lse = torch.empty(b, hkv, group, nq, device=keys.device, dtype=torch.float32) if chunk_local is None else None
    for first in range(0, nq, chunk_size):
        scored, block_keys, block_exact = slice(None), k, ex
        if chunk_local is not None:
            scored, seen = _chunk_indices(*chunk_local, first, chunk_size)
            block_keys, block_exact = k[:, :, scored], (ex[:, :, seen] if ex is not None else None)
        for start in range(first, min(first + chunk_size, nq), step):
            stop = min(start + step, first + chunk_size, nq)
            rows = q[:, :, :, start:stop].reshape(b, hkv, group * (stop - start), d)
            logits = torch.matmul(rows, block_keys.transpose(-1, -2))  # [B, H_kv, rows, keys scored]
            lse = logits.logsumexp(-1)
            if middle_lse is not None:
                middle_lse[:, :, :, start:stop] = lse.view(b, hkv, group, stop - start)
            if block_exact is not None and block_exact.shape[2]:
                lse = torch.logaddexp(lse, torch.matmul(rows, block_exact.transpose(-1, -2)).logsumexp(-1))
            if lse_extra is not None:
                lse = torch.logaddexp(lse, lse_extra[:, :, :, start:stop].reshape(b, hkv, -1))
            best[:, :, scored] = torch.maximum(best[:, :, scored], (logits - lse.unsqueeze(-1)).amax(-2))
    return best, (middle_lse.view(b, hkv, group * nq) if middle_lse is not None else None)


def _chunk_indices(positions: torch.Tensor, exact_positions: torch.Tensor | None, first: int, chunk_size: int):
    """(indices of the keys at positions first .. first + chunk_size - 1, indices of the exact keys there or before the
    first key of `positions`, the sink): positions [n], exact_positions [m] or None."""
    inside = (positions >= first) & (positions < first + chunk_size)
    if exact_positions is None:
        return inside.nonzero().squeeze(-1), None
    before = exact_positions < positions.min() if positions.numel() else torch.ones_like(exact_positions, dtype=torch.bool)
    seen = before | ((exact_positions >= first) & (exact_positions < first + chunk_size))
    return inside.nonzero().squeeze(-1), seen.nonzero().squeeze(-1)


@register
@dataclass
class KVzip(ScoreMethod):
    """Keep the tokens the context's reconstruction attends to most: each token's score is the largest
    attention probability any reconstruction query gives it (max over queries and the query heads of its
    KV group), normalised over the context and the reconstruction's own causal keys (module docstring).

    reconstruction_chunk_size: tokens of the context reconstructed per forward in a model, an integer >= 1
    (default 2048, the paper's 2k); the scoring also takes at most this many queries at a time.
    scoring: "context" (the default: every reconstruction query scores every token) or "chunk" (a chunk's
    queries score only the tokens they repeat, the paper's; it needs one query per context token, query j
    repeating position j, as the model's reconstruction gives).
    value_norm: "none" (the default), "absolute" or "relative", how a token's value norm weighs its score
    (module docstring). Runs in mode "prefill" only.
    """

    name = "kvzip"
    requirements = Requirements(inputs={"queries", "reconstruction"}, modes=("prefill",))
    default_sink = 4
    default_window = 0  # the reconstruction scores every context token; no exact window is needed
    reconstruction_chunk_size: int = DEFAULT_CHUNK_SIZE
    scoring: str = "context"
    value_norm: str = "none"

    def __post_init__(self):
        self.reconstruction_chunk_size = as_count("reconstruction_chunk_size", self.reconstruction_chunk_size, 1)
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS} (which reconstruction queries score a context token: every one, "
                             f"or its own chunk's), got {self.scoring!r}")
        if self.value_norm not in VALUE_NORMS:
            raise ValueError(f"value_norm must be one of {VALUE_NORMS} (how a token's value norm weighs its score: not at all, "
                             f"times its l1 norm, or times its l1 norm over its head's mean), got {self.value_norm!r}")

    def check_mode(self, mode: str) -> None:
        if mode not in self.requirements.modes:
            raise ValueError(
                f"method 'kvzip' runs in mode 'prefill' only, got mode={mode!r}: KVzip scores the context by reconstructing it "
                "whole after its prefill (query-agnostic context reconstruction), which a stream of blocks ('chunked', 'decode') "
                "never has; use mode='prefill'"
            )

    def new_stream(self, budget: int, generator: torch.Generator, slack: float | None = None) -> StreamState:
        raise ValueError(
            "method 'kvzip' has no stream: it scores the whole context with the queries of its reconstruction, run once after "
            "the context's prefill; use kvc.compress (with the reconstruction queries) or mode='prefill'"
        )

    def score(self, tokens: Tokens, generator: torch.Generator) -> torch.Tensor:
        return self.score_and_middle_lse(tokens, generator)[0]

    def score_and_middle_lse(self, tokens: Tokens, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(`score`, the middle's log-sum-exp per reconstruction query that scoring formed: scoring "context" only)."""
        chunk_local = None
        if self.scoring == "chunk":
            exact = 0 if tokens.exact_keys is None else tokens.exact_keys.shape[2]
            exact_positions = tokens.exact_positions if exact else None
            shared = all(p is None or bool((p == p[:1, :1]).all()) for p in (tokens.positions, exact_positions))
            if tokens.queries.shape[2] != tokens.length + exact or (exact and exact_positions is None) or not shared:
                raise ValueError(
                    f"kvzip with scoring='chunk' needs one reconstruction query per context token (query j repeats position j) "
                    f"and the tokens' positions, the same in every row and head: got {tokens.queries.shape[2]} queries for "
                    f"{tokens.length + exact} tokens; use scoring='context' for other queries"
                )
            chunk_local = (tokens.positions[0, 0], None if exact_positions is None else exact_positions[0, 0])
        scores, middle_lse = reconstruction_scores(tokens.queries, tokens.keys, tokens.scale, tokens.exact_keys,
                                                   tokens.extra_lse, self.reconstruction_chunk_size, chunk_local=chunk_local)
        if self.value_norm != "none":
            scores = scores + log_value_norms(tokens.values, relative=self.value_norm == "relative")
        return scores, middle_lse


def log_value_norms(values: torch.Tensor, relative: bool) -> torch.Tensor:
    """[B, H, n] float32: log ‖v‖₁ of each value of values [B, H, n, d_v] (formed in float32; a zero value gives the
    smallest normal float32's log, not -inf), less the log of its head's mean ‖v‖₁ when `relative`."""
    norms = values.float().abs().sum(-1).clamp_min(torch.finfo(torch.float32).tiny)
    if relative and norms.shape[-1]:
        norms = norms / norms.mean(-1, keepdim=True)
    return norms.log()
