"""PyramidKV: layer budgets that shrink with depth, SnapKV scores inside each layer.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
arXiv:2406.02069.
"""

from dataclasses import dataclass

import torch

from ..checks import as_real
from ..summary import KVSummary
from .base import ScoreMethod
from .registry import register
from .requirements import Requirements
from .snapkv import check_observation, pooled_observation_scores
from .tokens import Tokens


def layer_budget(budget: int, layer_idx: int, num_layers: int, beta: float, available: int | None = None) -> int:
    """Budget of one layer: linear in depth from `high` (layer 0) down to `low` (last layer), mean `budget`.

    Unclamped, low = budget / beta and high = 2 * budget - low. When high exceeds the tokens
    `available` to a layer, high is clamped to it and the excess goes to the deeper layers:
    low = 2 * budget - high, so the mean stays `budget` (the paper's code does the same).
    """
    if num_layers <= 1:
        return budget
    low = max(1, round(budget / beta))
    high = 2 * budget - low
    if available is not None and high > available >= budget:
        high = available
        low = 2 * budget - high
    return max(1, round(high - (high - low) * layer_idx / (num_layers - 1)))


@register
@dataclass
class PyramidKV(ScoreMethod):
    """`budget` is the mean over layers; layer l keeps `layer_budget(budget, l, L, beta, n)` of its n
    compressible tokens (beta = 20 as in the paper's code): budgets fall linearly with depth and
    are clamped to n, the excess redistributed to deeper layers. It needs the layer
    (`Tokens.layer_idx`, `Tokens.num_layers`): a cache gives it, `kvc.compress` takes it as
    `layer=(layer_idx, num_layers)`, and without it PyramidKV refuses to run (it would be SnapKV).
    Lower layers may therefore hold more than `budget` slots; the total over layers is L * budget
    (up to rounding). Scores are SnapKV's (`pooled_observation_scores`).

    beta: the ratio of the first layer's budget to the last's before clamping, a number >= 1 (default 20.0;
    1 gives every layer the same budget).
    observation_window: how many of the latest queries vote, an integer >= 1 (default 32).
    kernel_size: width of the average pooling over their attention, an odd integer >= 1 (default 7).
    """

    name = "pyramidkv"
    requirements = Requirements(inputs={"queries"})
    keeps_a_layer_share = True  # a stream refills to its layer's share, so the layers' streams store L·budget together
    beta: float = 20.0
    observation_window: int = 32
    kernel_size: int = 7

    def __post_init__(self):
        self.beta = as_real("beta", self.beta, "the ratio of the first layer's budget to the last's", minimum=1.0)
        self.observation_window, self.kernel_size = check_observation(self.observation_window, self.kernel_size)

    def score(self, tokens: Tokens, generator: torch.Generator) -> torch.Tensor:
        return pooled_observation_scores(tokens, self.observation_window, self.kernel_size)

    @property
    def queries_read(self) -> int:
        return self.observation_window

    def check_inputs(self, tokens: Tokens) -> None:
        super().check_inputs(tokens)
        if tokens.layer_idx is None or tokens.num_layers is None:
            raise ValueError(
                "method 'pyramidkv' sets each layer's budget by its depth: pass layer=(layer_idx, num_layers) to kvc.compress "
                "(or layer_idx and num_layers to a stream's update); a cache passes them itself"
            )

    def compress(self, tokens: Tokens, budget: int, generator: torch.Generator) -> KVSummary:
        budget = layer_budget(budget, tokens.layer_idx, tokens.num_layers, self.beta, tokens.length)
        return super().compress(tokens, budget, generator)

    def compress_held(self, tokens: Tokens, target: int, generator: torch.Generator) -> KVSummary:
        """In a stream: the layer's share of `target`, with no share moved to the deeper layers when a lower layer holds
        fewer tokens than its share (each layer's stream holds its own count, so moving shares by it would let the
        layers together keep more than L·target)."""
        self.check_inputs(tokens)
        return super().compress(tokens, layer_budget(target, tokens.layer_idx, tokens.num_layers, self.beta), generator)
