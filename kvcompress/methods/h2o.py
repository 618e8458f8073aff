"""H2O: heavy-hitter oracle, keep the tokens with the largest accumulated attention.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models", NeurIPS 2023.
"""

from dataclasses import dataclass

import torch

from .base import ScoreMethod, Tokens, attention_mass, register


@register
@dataclass
class H2O(ScoreMethod):
    """Score = attention received, summed over every query given (causally when query positions are
    known), averaged over the query heads of each KV group. In a stream the sum restarts with
    each block: the state keeps tokens, not running scores."""

    name = "h2o"
    needs_queries = True

    def score(self, tokens: Tokens, generator: torch.Generator) -> torch.Tensor:
        return attention_mass(tokens)
