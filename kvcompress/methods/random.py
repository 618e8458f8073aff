"""Uniform random eviction: the sampling baseline of BalanceKV ("BalanceKV: KV Cache Compression through
Discrepancy Theory", arXiv:2502.07861) and kvpress's RandomPress."""

from dataclasses import dataclass

import torch

from ..summary import KVSummary
from .base import ScoreMethod
from .registry import register
from .tokens import Tokens


@register
@dataclass
class Random(ScoreMethod):
    """Keep `budget` tokens per head drawn uniformly without replacement (seeded by `generator`).

    weighted: True gives each kept slot log-weight log(n / budget), the unbiased uniform-sampling
    estimator the coreset papers compare against; False (the default) is plain eviction.
    """

    name = "random"
    randomized = True
    weighted: bool = False

    def score(self, tokens: Tokens, generator: torch.Generator) -> torch.Tensor:
        return torch.rand(tokens.positions.shape, generator=generator, device=generator.device, dtype=torch.float32).to(tokens.keys.device)

    def compress(self, tokens: Tokens, budget: int, generator: torch.Generator) -> KVSummary:
        summary = super().compress(tokens, budget, generator)
        if self.weighted and tokens.length > budget:
            summary.log_weights.fill_(float(torch.tensor(tokens.length / budget, dtype=torch.float32).log()))
        return summary
