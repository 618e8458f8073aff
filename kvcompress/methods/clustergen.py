"""ClusterGen: the practical variant of SubGen's experiments, recent window + greedy k-center centres.

Zarandi, Han, Mirrokni, Karbasi, Zandieh, "SubGen: Token Generation in Sublinear Time and Memory", 2024
(seed 001, Sec. 3.2): keep the r most recent tokens plus k centres chosen by the greedy k-center
(farthest-point) algorithm of Gonzalez (1985) over the remaining keys, applied once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..summary import KVSummary, gather_slots
from .base import Method, Tokens, register


def farthest_point(points: torch.Tensor, k: int, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy k-center (farthest-first traversal), batched over the leading axis.

    points [G, n, d] (any float dtype; distances in float32), valid [G, n] bool or None (invalid
    points are never chosen and ignored by the radius; point 0 must be valid). The traversal starts
    at point 0 and adds the point farthest from the chosen set, k times in all.
    Returns (index [G, k] in selection order, distance of every point to its nearest centre [G, n],
    -inf for the centres themselves and for invalid points, so a centre is never chosen twice); the
    covering radius is the max of the latter. k must be at most the number of valid points.
    """
    x = points.float()
    g = x.shape[0]
    rows = torch.arange(g, device=x.device)
    index = torch.zeros(g, k, dtype=torch.long, device=x.device)
    sq_norms = x.square().sum(-1)

    def distance_to(centre: torch.Tensor) -> torch.Tensor:
        # ‖x - c‖ via ‖x‖² - 2<x, c> + ‖c‖²: one matrix-vector product, no [G, n, d] temporary per step.
        dot = torch.bmm(x, centre.unsqueeze(-1)).squeeze(-1)
        return (sq_norms - 2.0 * dot + centre.square().sum(-1, keepdim=True)).clamp_min(0.0).sqrt()

    nearest = distance_to(x[:, 0])
    if valid is not None:
        nearest = nearest.masked_fill(~valid, float("-inf"))
    nearest[:, 0] = float("-inf")
    for j in range(1, k):
        nxt = nearest.argmax(dim=-1)
        index[:, j] = nxt
        nearest = torch.minimum(nearest, distance_to(x[rows, nxt]))
        nearest[rows, nxt] = float("-inf")
    return index, nearest


@register
@dataclass
class ClusterGen(Method):
    """Keep `budget` greedy k-center centres of the compressible keys (raw post-RoPE key space).

    The seed keeps only a recent window besides the centres (no sinks): here the window is the
    framework's `window` (default 64) and `default_sink = 0`. The centres are plain kept tokens
    (log-weight 0) as in the seed; `weighted=True` instead gives each centre the log of the number
    of keys nearest to it (a cluster-size-weighted coreset, an option the seed does not use).
    Streams block-wise: after every block the kept centres plus the block are re-clustered down to
    `budget` (k-center over centres and new tokens), so storage is budget + block slots.
    Cost: O(budget * n * d) per head.
    """

    name = "clustergen"
    default_sink = 0
    default_window = 64
    weighted: bool = False

    def compress(self, tokens: Tokens, budget: int, generator: torch.Generator) -> KVSummary:
        if tokens.length <= budget:
            return tokens.exact()
        b, h, n, d = tokens.keys.shape
        chosen, _ = farthest_point(tokens.keys.reshape(b * h, n, d), budget)
        index = chosen.reshape(b, h, budget).sort(dim=-1).values
        keys, values, positions = gather_slots(tokens.keys, tokens.values, tokens.positions, index)
        log_weights = torch.zeros(positions.shape, device=keys.device)
        if self.weighted:
            owner = torch.cdist(tokens.keys.float(), keys.float()).argmin(dim=-1)
            sizes = torch.zeros(b, h, budget, device=keys.device).scatter_add_(2, owner, torch.ones_like(owner, dtype=torch.float32))
            log_weights = sizes.log()
        return KVSummary(keys, values, log_weights, positions)
