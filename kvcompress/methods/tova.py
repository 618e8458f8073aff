"""TOVA: keep the tokens the current query attends to most.

Oren et al., "Transformers are Multi-State RNNs", EMNLP 2024.
"""

from dataclasses import dataclass

import torch

from .base import ScoreMethod, Tokens, attention_mass, register


@register
@dataclass
class TOVA(ScoreMethod):
    """Score = attention of the last query given, averaged over the query heads of each KV group."""

    name = "tova"
    needs_queries = True

    def score(self, tokens: Tokens, generator: torch.Generator) -> torch.Tensor:
        return attention_mass(tokens, last=1)
