"""Knorm: keep the keys with the smallest L2 norm.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP 2024,
arXiv:2406.11430.
"""

from dataclasses import dataclass

import torch

from .base import ScoreMethod
from .registry import register
from .tokens import Tokens


@register
@dataclass
class Knorm(ScoreMethod):
    """Score = -||k|| (low-norm keys draw high attention in the paper's analysis)."""

    name = "knorm"

    def score(self, tokens: Tokens, generator: torch.Generator) -> torch.Tensor:
        return -tokens.keys.float().norm(dim=-1)
