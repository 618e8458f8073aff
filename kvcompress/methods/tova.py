"""TOVA: keep the tokens the current query attends to most.

Oren et al., "Transformers are Multi-State RNNs", EMNLP 2024 (Sec. 3.2: the attention of the last
query, averaged over the layer's heads; kvpress's TOVAPress does the same).
"""

from dataclasses import dataclass

import torch

from .base import AVERAGES, ScoreMethod, Tokens, attention_mass, register


@register
@dataclass
class TOVA(ScoreMethod):
    """Score = attention of the last query given, softmax over every key it sees (sink and window
    included), averaged over all query heads of the layer (`average="layer"`, the paper's
    definition: every KV head keeps the same tokens). `average="group"` averages over the query
    heads of each KV head instead (per-head choices)."""

    name = "tova"
    needs_queries = True
    average: str = "layer"

    def __post_init__(self):
        if self.average not in AVERAGES:
            raise ValueError(f"average must be one of {AVERAGES}, got {self.average!r}")

    def score(self, tokens: Tokens, generator: torch.Generator) -> torch.Tensor:
        return attention_mass(tokens, last=1, average=self.average)
