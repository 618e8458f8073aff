"""Hybrid: a score method's top tokens kept exactly, the rest summarised by a weighted coreset, in one budget.

A composition of two registered methods (DESIGN.md §7, "Composition"), through their public
`Method` interfaces only:

- the score method (e.g. KeyDiff, seed 004; Compactor, seed 002) picks `n_exact =
  round(exact_fraction · budget)` tokens per head, kept with log-weight 0;
- the coreset (BalanceKV, seed 000; Thinformer Express, seed 003) summarises every other token in
  the remaining `budget − n_exact` slots, with weights that add up to the tokens it covers.

So the weights of the whole summary add up to the tokens seen, eviction keeps the rare tokens that
retrieval needs (a needle), and the attention error on the part the coreset covers is the
coreset's own (its bound applies to that part: the exact part adds no error).

One-shot: the score method selects over all tokens, the coreset compresses the rest once.
Streamed: the exact set is re-selected block by block over (exact set + new block), as block
prompt processing does (seed 004 Eq. 6); the tokens it lets go are absorbed by the coreset's own
stream (`coreset` method's `new_stream`), so nothing leaves the summary unweighted. Stored slots
stay within n_exact + the coreset stream's budget between updates (plus the block in progress).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..summary import KVSummary, concat, take_slots
from .base import Method, StreamState, Tokens, build_method, cat_tokens, register

_COMPOSED_PARAMS = ("sink", "window")


def _positions_mask(tokens: Tokens, kept: KVSummary) -> torch.Tensor:
    """[B,H,n] bool: True for the tokens whose positions a plain-kept summary holds (both ascending per head)."""
    index = torch.searchsorted(tokens.positions.contiguous(), kept.positions.contiguous()).clamp_max(tokens.length - 1)
    found = tokens.positions.gather(2, index) == kept.positions
    return torch.zeros_like(tokens.positions, dtype=torch.bool).scatter(2, index, found)


def _select(tokens: Tokens, mask: torch.Tensor, count: int) -> Tokens:
    """The `count` tokens per head where mask is True, in their original order (every head has `count`)."""
    index = (~mask).to(torch.int8).argsort(dim=-1, stable=True)[..., :count]
    pre = take_slots(tokens.pre_rope_keys, index) if tokens.pre_rope_keys is not None else None
    return replace(tokens, keys=take_slots(tokens.keys, index), values=take_slots(tokens.values, index), positions=take_slots(tokens.positions, index), pre_rope_keys=pre)


def _by_position(summary: KVSummary) -> KVSummary:
    """The numerator slots reordered by original position (the normalizer, if any, is left as it is)."""
    order = summary.positions.argsort(dim=-1)
    return replace(summary, keys=take_slots(summary.keys, order), values=take_slots(summary.values, order),
                   log_weights=take_slots(summary.log_weights, order), positions=take_slots(summary.positions, order))


@register
@dataclass
class Hybrid(Method):
    """Top tokens of `score` exact (weight 1) + a `coreset` summary of the rest, in one budget per head.

    score: any registered method that keeps plain tokens (log-weight 0, no normalizer), e.g.
    "keydiff", "compactor", "knorm", "snapkv"; coreset: any registered method whose weights add up
    to the tokens it covers, e.g. "balancekv", "express". exact_fraction in [0, 1): share of the
    budget kept exactly (n_exact = round(exact_fraction · budget); the coreset gets at least one
    slot, so the weights always cover every token). score_params / coreset_params: parameters of
    the two methods (dicts, checked by their own constructors). The default exact_fraction = 0.75
    was chosen among 0.25 / 0.5 / 0.75 on training samples disjoint from the reported ones
    (benchmarks/hybrid_tuning.py: needle and line at 2k, ratios 0.75 and 0.9, seeds 1000-1002).

    Sink and window are those of the composed call (the default: 4 sink + 64 window, the library
    default); the two parts see only the middle.
    """

    name = "hybrid"
    randomized = True  # through its coreset (BalanceKV and Express draw random signs)
    score: str = "keydiff"
    coreset: str = "balancekv"
    exact_fraction: float = 0.75
    score_params: dict | None = None
    coreset_params: dict | None = None

    def __post_init__(self):
        if isinstance(self.exact_fraction, bool) or not isinstance(self.exact_fraction, (int, float)) or not 0.0 <= self.exact_fraction < 1.0:
            raise ValueError(f"exact_fraction must be a number in [0, 1), got {self.exact_fraction!r}")
        for role, value in (("score", self.score), ("coreset", self.coreset)):
            if not isinstance(value, str) or value == self.name:
                raise ValueError(f"{role} must be the name of another registered method, got {value!r}")
        for role, params in (("score_params", self.score_params), ("coreset_params", self.coreset_params)):
            if params is not None and not isinstance(params, dict):
                raise ValueError(f"{role} must be a dict of method parameters or None, got {params!r}")
            bad = sorted(set(params or {}) & set(_COMPOSED_PARAMS))
            if bad:
                raise ValueError(f"{role} cannot set {bad}: sink and window belong to the hybrid call")
        self.score_method = build_method(self.score, **(self.score_params or {}))
        self.coreset_method = build_method(self.coreset, **(self.coreset_params or {}))
        self.needs_queries = self.score_method.needs_queries or self.coreset_method.needs_queries
        self.needs_pre_rope_keys = self.score_method.needs_pre_rope_keys or self.coreset_method.needs_pre_rope_keys

    def split_budget(self, budget: int) -> tuple[int, int]:
        """(exact slots, coreset slots) per head; the coreset always gets at least one."""
        n_exact = min(round(self.exact_fraction * budget), budget - 1)
        return n_exact, budget - n_exact

    def check_inputs(self, tokens: Tokens) -> None:
        self.score_method.check_inputs(tokens)
        self.coreset_method.check_inputs(tokens)

    def top(self, tokens: Tokens, n_exact: int, generator: torch.Generator) -> tuple[Tokens, Tokens]:
        """(the score method's `n_exact` kept tokens per head, every other token), both in original order."""
        if n_exact == 0:
            return tokens.slice(0, 0), tokens
        kept = self.score_method.compress(tokens, n_exact, generator)
        if kept.normalizer is not None or not bool((kept.log_weights == 0).all()) or kept.num_slots != n_exact:
            raise ValueError(
                f"score={self.score!r} must keep exactly {n_exact} plain tokens per head (log-weight 0, no normalizer); "
                "use an eviction method such as 'keydiff', 'compactor' or 'knorm'"
            )
        mask = _positions_mask(tokens, kept)
        return _select(tokens, mask, n_exact), _select(tokens, ~mask, tokens.length - n_exact)

    def compress(self, tokens: Tokens, budget: int, generator: torch.Generator) -> KVSummary:
        if tokens.length <= budget:
            return tokens.exact()
        n_exact, n_coreset = self.split_budget(budget)
        exact, rest = self.top(tokens, n_exact, generator)
        coreset = self.coreset_method.compress(rest, n_coreset, generator)
        return _by_position(concat([exact.exact(), coreset]))

    def new_stream(self, budget: int, generator: torch.Generator) -> "HybridState":
        return HybridState(self, budget, generator)


class HybridState(StreamState):
    """Streamed hybrid: an exact set re-selected after each block, its evictions absorbed by the coreset's stream."""

    def __init__(self, method: Hybrid, budget: int, generator: torch.Generator):
        self.method, self.generator = method, generator
        self.n_exact, n_coreset = method.split_budget(budget)
        self.coreset = method.coreset_method.new_stream(n_coreset, generator)
        self.exact: Tokens | None = None

    def absorb(self, tokens: Tokens) -> None:
        buffer = tokens if self.exact is None else cat_tokens([self.exact, tokens])
        if buffer.length <= self.n_exact:
            self.exact = buffer
            return
        self.exact, evicted = self.method.top(buffer, self.n_exact, self.generator)
        self.coreset.absorb(evicted)

    def summary(self) -> KVSummary | None:
        parts = [p for p in (self.exact.exact() if self.exact is not None and self.exact.length else None, self.coreset.summary()) if p is not None]
        return _by_position(concat(parts)) if parts else None

    def nbytes(self) -> int:
        exact = self.exact.exact().nbytes() if self.exact is not None else 0
        return exact + self.coreset.nbytes()
