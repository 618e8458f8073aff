"""H2O: heavy-hitter oracle, keep the tokens with the largest accumulated attention.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models", NeurIPS 2023,
arXiv:2306.14048.
"""

from dataclasses import dataclass

import torch

from .base import ScoreMethod
from .registry import register
from .requirements import Requirements
from .tokens import Tokens, attention_mass


@register
@dataclass
class H2O(ScoreMethod):
    """Score = attention received, summed over every query given (causally when query positions are
    known), softmax over every key each query sees (sink and window included), averaged over the
    query heads of each KV head.

    Where the mass comes from (its `requirements` name "attention_mass"): a model's prefill in prefill mode computes
    it as a by-product of its own attention (`integration.attention.causal_attention_with_mass`)
    and hands it over as `tokens.attention_mass`, so compression adds only the top-k. Called
    without it (the pure-tensor API `kvc.compress`, a stream, a padded batch) H2O computes it
    itself with `attention_mass`: in query chunks at the model's scale, at most one chunk of
    scores in memory, at the cost of the QK product and exponentials of one more attention pass,
    O(n_q · n · d). In a stream the sum restarts with each block: the state keeps tokens, not
    running scores."""

    name = "h2o"
    requirements = Requirements(inputs={"queries", "attention_mass"})

    def score(self, tokens: Tokens, generator: torch.Generator) -> torch.Tensor:
        return tokens.attention_mass if tokens.attention_mass is not None else attention_mass(tokens)
