"""TOVA: keep the tokens the current query attends to most.

Oren et al., "Transformers are Multi-State RNNs", EMNLP 2024, arXiv:2401.06104 (Sec. 3, the TOVA policy: at each
step, drop the tokens with the lowest attention from the current query, averaged over the layer's
heads; no protected sink or recent window). kvpress's TOVAPress scores the same way, with the last
token of what it compresses: with the question kept out of compression, the last context token.
"""

from dataclasses import dataclass

import torch

from ..attention import AVERAGES
from .base import ScoreMethod
from .registry import register
from .requirements import Requirements
from .tokens import Tokens, attention_mass


@register
@dataclass
class TOVA(ScoreMethod):
    """Score = attention of the last query given, softmax over every key it sees (sink and window
    included), averaged over all query heads of the layer (`average="layer"`, the paper's
    definition: every KV head keeps the same tokens). `average="group"` averages over the query
    heads of each KV head instead (per-head choices). average: "layer" (the default) or "group".

    Defaults sink 0, window 0, as the paper: every token, the scoring query's own included,
    competes on its score (kvpress forces the last token in; `window=1` does the same).
    """

    name = "tova"
    requirements = Requirements(inputs={"queries"})
    default_sink = 0
    default_window = 0
    average: str = "layer"

    def __post_init__(self):
        if self.average not in AVERAGES:
            raise ValueError(f"average must be one of {AVERAGES}, got {self.average!r}")

    def score(self, tokens: Tokens, generator: torch.Generator) -> torch.Tensor:
        return attention_mass(tokens, last=1, average=self.average)

    @property
    def queries_read(self) -> int:
        return 1
