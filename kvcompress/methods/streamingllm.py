"""StreamingLLM: attention sinks plus a recent window.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024, arXiv:2309.17453.
"""

from dataclasses import dataclass

import torch

from .base import ScoreMethod
from .registry import register
from .tokens import Tokens


@register
@dataclass
class StreamingLLM(ScoreMethod):
    """Keep the first `sink` tokens (4 by default, as in the paper) and the most recent ones.

    Within the middle the `budget` most recent tokens are kept, so the effective window is
    window + budget.
    """

    name = "streamingllm"
    default_sink = 4
    default_window = 64

    def score(self, tokens: Tokens, generator: torch.Generator) -> torch.Tensor:
        return tokens.positions.double()  # exact for every position below 2^53 (float32 rounds above 2^24)
