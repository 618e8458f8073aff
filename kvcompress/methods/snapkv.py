"""SnapKV: keep the tokens the last queries attend to.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024,
arXiv:2404.14469.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..checks import as_count
from .base import ScoreMethod
from .registry import register
from .requirements import Requirements
from .tokens import Tokens, attention_mass


def check_observation(observation_window, kernel_size) -> tuple[int, int]:
    """(observation_window, kernel_size) checked: counts >= 1, the kernel odd (pooling centred on each token)."""
    window, kernel = as_count("observation_window", observation_window, 1), as_count("kernel_size", kernel_size, 1)
    if kernel % 2 == 0:
        raise ValueError(f"kernel_size must be odd (pooling centred on each token), got {kernel}")
    return window, kernel


def pooled_observation_scores(tokens: Tokens, observation_window: int, kernel_size: int) -> torch.Tensor:
    """[B,H_kv,n]: attention of the last `observation_window` queries, GQA-averaged, average-pooled along tokens."""
    mass = attention_mass(tokens, last=observation_window)
    b, h, n = mass.shape
    pooled = F.avg_pool1d(mass.reshape(b * h, 1, n), kernel_size, stride=1, padding=kernel_size // 2, count_include_pad=False)
    return pooled.reshape(b, h, -1)[..., :n]


@register
@dataclass
class SnapKV(ScoreMethod):
    """Score each token by the attention it receives from the last `observation_window` (32) queries,
    averaged over the query heads of its KV group, smoothed by 1-D average pooling (`kernel_size` 7).

    The softmax runs over every key the observation queries see, sink and window included (the
    paper's definition); the observation queries are the most recent queries given (in a model:
    those of the context's last tokens, i.e. the exact window).

    observation_window: how many of the latest queries vote, an integer >= 1 (default 32).
    kernel_size: width of the average pooling along the tokens, an odd integer >= 1 so the pooling is
    centred on each token (default 7; 1: no pooling).
    """

    name = "snapkv"
    requirements = Requirements(inputs={"queries"})
    observation_window: int = 32
    kernel_size: int = 7

    def __post_init__(self):
        self.observation_window, self.kernel_size = check_observation(self.observation_window, self.kernel_size)

    @property
    def queries_read(self) -> int:
        return self.observation_window

    def score(self, tokens: Tokens, generator: torch.Generator) -> torch.Tensor:
        return pooled_observation_scores(tokens, self.observation_window, self.kernel_size)
