"""KeyDiff: evict the keys most similar to the others, with bounded-memory block prompt processing.

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments", arXiv:2504.15364.

Score (Eq. 8): s_i = −cos(k_i, μ(K̂)) with μ(K̂) the mean of the normalised keys held, the
anchor; the `budget` highest-scoring (least typical) tokens per KV head are kept. Anchor and
score are O(n·d) time and memory: no n×n matrix and no attention weights.

Block prompt processing (Eq. 6): as a stream (`kvc.stream("keydiff", budget=N)`, or
`generate(..., mode="chunked")`), new tokens are appended to the kept ones and the policy evicts
over everything held, within N slots per head, the block being appended included (the block-wise
state of `methods.base`, `budget.stream_split`): whenever the next tokens do not fit, what is held
is evicted back to the target floor(N / (1 + slack)), and a block larger than the room left is
appended in pieces. By default (slack 0.5) the target is 2N/3, linear total work; slack=0 evicts
back to N - 1, one eviction per token once N are held. The paper's protocol (keep N', append a
block of B, evict back to N') is budget N' + B with slack B/N' (each eviction runs as the next
block arrives). In every case stored KV stays within sink + N (+ window) per head, whatever the
prompt length. One-shot `compress` scores all tokens at once (the paper's B = T case) unless
`block_size` asks for the same block recursion offline.

Ablations of the paper (Sec. 4.3, Tables 2–3):
- anchor="median": coordinate-wise median of the normalised keys instead of their mean.
- anchor="pairwise": the exact objective −CosSim(K)·1 of Eq. 7 (each token's summed
  similarity to every held token), O(n²) time, computed in row chunks; refused above
  PAIRWISE_MAX_TOKENS tokens per call. With metric="cosine" it ranks tokens exactly as the
  normalised-mean anchor does (Σ_j cos(k_i, k_j) = n·‖μ(K̂)‖·cos(k_i, μ(K̂))), so it serves as the
  reference that the O(n·d) score reproduces.
- metric="dot": s_i = −<k_i, anchor> (magnitude counts); metric="euclidean": s_i = ‖k_i − anchor‖.
  For pairwise, the same metric between every pair of raw keys.
- normalize_anchor=False: the anchor is the mean (or median) of the raw keys, μ(K), which the paper
  reports as an equally accurate replacement for μ(K̂); it equals μ(K̂) for unit-norm keys.

Defaults follow the paper: every token is scored (sink 0, window 0: KeyDiff argues that key
diversity recovers the attention sinks itself).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..checks import as_count, check_bool
from ..summary import KVSummary
from .base import ScoreMethod
from .registry import register
from .tokens import Tokens

ANCHORS = ("mean", "median", "pairwise")
METRICS = ("cosine", "dot", "euclidean")
PAIRWISE_MAX_TOKENS = 8192
_PAIRWISE_CHUNK_ELEMENTS = 1 << 24
_EPS = 1e-6


def anchor_vector(keys: torch.Tensor, anchor: str = "mean", normalize: bool = True) -> torch.Tensor:
    """[B,H,1,d] anchor of keys [B,H,n,d] (float32): mean or coordinate-wise median, of the unit keys if normalize."""
    base = F.normalize(keys.float(), dim=-1, eps=_EPS) if normalize else keys.float()
    if anchor == "mean":
        return base.mean(dim=2, keepdim=True)
    if anchor == "median":
        return base.median(dim=2, keepdim=True).values
    raise ValueError(f"anchor must be 'mean' or 'median' for an anchor vector, got {anchor!r}")


def _similarity(a: torch.Tensor, b: torch.Tensor, metric: str) -> torch.Tensor:
    """[B,H,m,d] x [B,H,n,d] -> [B,H,m,n] diversity contributions: −cos, −dot or euclidean distance."""
    if metric == "cosine":
        return -(F.normalize(a, dim=-1, eps=_EPS) @ F.normalize(b, dim=-1, eps=_EPS).transpose(-1, -2))
    if metric == "dot":
        return -(a @ b.transpose(-1, -2))
    return torch.cdist(a, b)


def anchor_scores(keys: torch.Tensor, anchor: torch.Tensor, metric: str = "cosine") -> torch.Tensor:
    """[B,H,n] KeyDiff scores of keys [B,H,n,d] against anchor [B,H,1,d] (higher = more distinct, kept)."""
    return _similarity(keys.float(), anchor.float(), metric).squeeze(-1)


def pairwise_scores(keys: torch.Tensor, metric: str = "cosine") -> torch.Tensor:
    """[B,H,n] exact pairwise objective of the paper's Eq. 7: Σ_j diversity(k_i, k_j) over every held token.

    O(n²) time; rows are processed in chunks so memory stays at one chunk × n. Refuses
    n > PAIRWISE_MAX_TOKENS.
    """
    b, h, n, _ = keys.shape
    if n > PAIRWISE_MAX_TOKENS:
        raise ValueError(
            f"anchor='pairwise' is O(n^2) and takes at most {PAIRWISE_MAX_TOKENS} tokens per call, got {n}; "
            "use anchor='mean' (same ranking for metric='cosine') or a smaller budget/block"
        )
    k = keys.float()
    chunk = max(1, _PAIRWISE_CHUNK_ELEMENTS // max(1, b * h * n))
    return torch.cat([_similarity(k[:, :, i : i + chunk], k, metric).sum(-1) for i in range(0, n, chunk)], dim=-1)


@register
@dataclass
class KeyDiff(ScoreMethod):
    """Keep the `budget` keys least similar to the anchor of the held keys, per KV head.

    anchor: "mean" (default, the paper's Eq. 8) | "median" | "pairwise" (exact O(n²) Eq. 7, at most
    PAIRWISE_MAX_TOKENS tokens per call); metric: "cosine" (default) | "dot" | "euclidean";
    normalize_anchor: build the anchor from unit keys (μ(K̂), True, the default) or raw keys (μ(K), False;
    refused with anchor="pairwise", which builds no anchor vector);
    block_size: None (default) scores all tokens of a one-shot call at once, an integer >= 1 runs the block
    recursion of Eq. 6 over them, blocks of that many tokens, as chunked prefill does (the block-wise stream with its default
    re-compression slack, within `budget` throughout, compacted at the end).
    """

    name = "keydiff"
    default_sink = 0
    default_window = 0
    anchor: str = "mean"
    metric: str = "cosine"
    normalize_anchor: bool = True
    block_size: int | None = None

    def __post_init__(self):
        if self.anchor not in ANCHORS:
            raise ValueError(f"anchor must be one of {ANCHORS}, got {self.anchor!r}")
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {self.metric!r}")
        check_bool("normalize_anchor", self.normalize_anchor)
        if self.anchor == "pairwise" and not self.normalize_anchor:
            raise ValueError("normalize_anchor=False builds an anchor vector from the raw keys, which anchor='pairwise' (every "
                             "token against every other, no anchor vector) does not use: use anchor='mean' or 'median' with it")
        self.block_size = as_count("block_size", self.block_size, 1, optional=True)

    def score(self, tokens: Tokens, generator: torch.Generator) -> torch.Tensor:
        if self.anchor == "pairwise":
            return pairwise_scores(tokens.keys, self.metric)
        return anchor_scores(tokens.keys, anchor_vector(tokens.keys, self.anchor, self.normalize_anchor), self.metric)

    def compress(self, tokens: Tokens, budget: int, generator: torch.Generator) -> KVSummary:
        if self.block_size is None or tokens.length <= budget:
            return super().compress(tokens, budget, generator)
        state = replace(self, block_size=None).new_stream(budget, generator)
        for start in range(0, tokens.length, self.block_size):
            state.absorb(tokens.slice(start, start + self.block_size))
        state.compact()
        return state.summary()
