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
    known), softmax over every key each query sees (sink and window included), averaged over the
    query heads of each KV head. The mass is accumulated in query chunks at the model's scale
    (`attention_mass`): cost is that of the QK product of the queries given, O(n_q · n · d), with
    at most one chunk of scores in memory. In a stream the sum restarts with each block: the state
    keeps tokens, not running scores."""

    name = "h2o"
    needs_queries = True

    def score(self, tokens: Tokens, generator: torch.Generator) -> torch.Tensor:
        return attention_mass(tokens)
