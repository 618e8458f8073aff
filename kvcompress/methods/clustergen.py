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


# Pairwise inner products materialised at once (float32) by farthest_point; above this it takes one
# matrix-vector product per step instead.
_MAX_GRAM = 1 << 25


def farthest_point(points: torch.Tensor, k: int, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy k-center (farthest-first traversal), batched over the leading axis.

    points [G, n, d] (any float dtype; distances in float32), valid [G, n] bool or None (invalid
    points are never chosen and ignored by the radius; point 0 must be valid). The traversal starts
    at point 0 and adds the point farthest from the chosen set, k times in all.
    Returns (index [G, k] in selection order, distance of every point to its nearest centre [G, n],
    -inf for the centres themselves and for invalid points, so a centre is never chosen twice); the
    covering radius is the max of the latter. k must be at most the number of valid points.
    Squared distances ‖x‖² − 2<x, c> + ‖c‖² are updated per step from the Gram matrix when
    G·n² <= _MAX_GRAM (one batched matmul up front), else from one matrix-vector product per step.
    """
    x = points.float()
    g, n, _ = x.shape
    rows = torch.arange(g, device=x.device)
    index = torch.zeros(g, k, dtype=torch.long, device=x.device)
    sq_norms = x.square().sum(-1)
    gram = torch.bmm(x, x.transpose(1, 2)) if g * n * n <= _MAX_GRAM else None

    def sq_distance_to(centre: torch.Tensor) -> torch.Tensor:
        dot = gram[rows, centre] if gram is not None else torch.bmm(x, x[rows, centre].unsqueeze(-1)).squeeze(-1)
        return (sq_norms - 2.0 * dot + sq_norms[rows, centre][:, None]).clamp_min(0.0)

    nearest = sq_distance_to(index[:, 0])
    if valid is not None:
        nearest = nearest.masked_fill(~valid, float("-inf"))
    nearest[:, 0] = float("-inf")
    for j in range(1, k):
        nxt = nearest.argmax(dim=-1)
        index[:, j] = nxt
        nearest = torch.minimum(nearest, sq_distance_to(nxt))
        nearest[rows, nxt] = float("-inf")
    return index, nearest.clamp_min(0.0).sqrt().masked_fill(nearest == float("-inf"), float("-inf"))


def block_centres(points: torch.Tensor, k: int, block_size: int) -> torch.Tensor:
    """Greedy k-center inside each run of `block_size` consecutive points, all blocks batched.

    points [G, n, d], 1 <= k <= n. Block j holding c_j points (the last one may be shorter) gets
    ⌊k·C_j/n⌋ − ⌊k·C_{j−1}/n⌋ centres, C_j the points in blocks 0..j (quotas sum to k, each <= c_j).
    Returns index [G, k] into the n points (block by block, each block's centres in selection order).
    """
    g, n, d = points.shape
    blocks = -(-n // block_size)
    pad = blocks * block_size - n
    padded = torch.nn.functional.pad(points, (0, 0, 0, pad)).reshape(g * blocks, block_size, d)
    ends = torch.arange(1, blocks + 1, device=points.device).mul(block_size).clamp_max(n)
    cumulative = torch.div(ends * k, n, rounding_mode="floor")
    quota = torch.diff(cumulative, prepend=cumulative.new_zeros(1))
    valid = (torch.arange(blocks * block_size, device=points.device) < n).reshape(blocks, block_size)
    steps = int(quota.max())
    local, _ = farthest_point(padded, steps, valid.repeat(g, 1))
    local = local.reshape(g, blocks, steps) + torch.arange(blocks, device=points.device)[:, None] * block_size
    taken = torch.arange(steps, device=points.device) < quota[:, None]
    return local[:, taken]


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

    block_size: None runs the seed's k-center over all n keys of a head: `budget` sequential
    farthest-point steps of O(n·d) each, O(budget·n·d) per head, quadratic when the budget is a
    fixed share of n. An integer B (departure from the seed, default 512) runs k-center inside each
    run of B consecutive keys, all blocks and heads as one batch: block j of c_j keys gets
    ⌊budget·C_j/n⌋ − ⌊budget·C_{j−1}/n⌋ centres (C_j = keys up to block j, so the quotas sum to
    `budget` and follow the share kept), the traversal takes max-quota ≈ B·budget/n sequential
    steps of O(n·d), O(B·budget·d) per head, linear in n at a fixed share. Each block's centres
    are its own greedy k-center (a 2-approximation of that block's optimal radius).
    """

    name = "clustergen"
    default_sink = 0
    default_window = 64
    weighted: bool = False
    block_size: int | None = 256

    def __post_init__(self):
        if self.block_size is not None and (isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1):
            raise ValueError(f"block_size must be None or an integer >= 1, got {self.block_size!r}")

    def compress(self, tokens: Tokens, budget: int, generator: torch.Generator) -> KVSummary:
        if tokens.length <= budget:
            return tokens.exact()
        b, h, n, d = tokens.keys.shape
        keys = tokens.keys.reshape(b * h, n, d)
        chosen = farthest_point(keys, budget)[0] if self.block_size is None or self.block_size >= n else block_centres(keys, budget, self.block_size)
        index = chosen.reshape(b, h, budget).sort(dim=-1).values
        keys, values, positions = gather_slots(tokens.keys, tokens.values, tokens.positions, index)
        log_weights = torch.zeros(positions.shape, device=keys.device)
        if self.weighted:
            owner = torch.cdist(tokens.keys.float(), keys.float()).argmin(dim=-1)
            sizes = torch.zeros(b, h, budget, device=keys.device).scatter_add_(2, owner, torch.ones_like(owner, dtype=torch.float32))
            log_weights = sizes.log()
        return KVSummary(keys, values, log_weights, positions)
