"""SubGen: sublinear streaming attention by online key clustering and value-norm sampling.

Zarandi, Han, Mirrokni, Karbasi, Zandieh, "SubGen: Token Generation in Sublinear Time and Memory", 2024
(seed 001, Alg. 1). The softmax denominator is estimated from t uniform samples per cluster of an
online greedy δ-clustering of the keys (UpdateSoftmaxNormalizer); the numerator from s samples
drawn with probability ∝ ‖v‖² (UpdateMatrixProduct); QueryStreamAttn is `weighted_attention` over
the resulting `KVSummary`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..summary import KVSummary, Normalizer
from .base import Method, StreamState, Tokens, register
from .clustergen import farthest_point


def _uniform(shape, generator: torch.Generator, device) -> torch.Tensor:
    """Uniform [0, 1) draws from `generator` (on its own device), moved to `device`."""
    return torch.rand(shape, generator=generator, device=generator.device, dtype=torch.float64).to(device)


def _distances(points: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Exact Euclidean distances [G, n, m] (no matmul shortcut, so a key is at distance 0 from itself)."""
    return torch.cdist(points, centres.float(), compute_mode="donot_use_mm_for_euclid_dist")


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [G, n, ...], index [G, *shape] -> [G, *shape, ...]: per-row gather along the token axis."""
    g = x.shape[0]
    flat = index.reshape(g, -1)
    tail = x.shape[2:]
    out = x.gather(1, flat.reshape(g, -1, *([1] * len(tail))).expand(g, flat.shape[1], *tail))
    return out.reshape(*index.shape, *tail)


class SubGenState(StreamState):
    """The SubGen data structures of every (batch, head), stored flat over G = B * H_kv rows.

    Normalizer D: centres [G, A, d] (first key of each cluster), counts n_i [G, A] (int64),
    samples [G, A, t, d] with their positions, radius δ [G]; the live clusters of a row are its
    first m columns (A = max m over rows). Numerator M: s sampled keys/values/positions, their
    ‖v‖² and μ = Σ‖v‖² [G] (float64).

    A block is absorbed with the distribution of the seed's token-by-token rules:
    - UpdateMatrixProduct: after a block with Σ‖v‖² = W, each of the s slots independently holds a
      block token drawn ∝ ‖v‖² with probability W / (μ + W), else keeps its sample; this is the
      law of applying the per-token replacement probability ‖v‖² / (μ + ‖v‖²) to every token.
    - UpdateSoftmaxNormalizer: cluster assignment is sequential (a key may open a cluster that
      later keys join), so the block is scanned event by event: all keys up to the next one farther
      than δ from every centre are assigned to their nearest centre at once, then that key opens a
      cluster; the loop runs once per new cluster, vectorised over tokens and rows. The t slots of
      a cluster that had n_old members and gains b members are each replaced, with probability
      b / (n_old + b), by a uniform draw among the new members: again the law of the seed's
      per-token reservoir rule (p = 1/n_i), and a new cluster's t copies of its first key are
      always replaced this way.
    - Cluster cap (departure from the seed, which lets m grow with the data): when a key needs a
      new cluster and the row already holds `max_clusters`, δ grows to max(2δ, r), with r the
      greedy k-center radius of the centres plus that key at half the cap, and clusters whose
      centres lie within the new δ of an earlier kept centre merge into the nearest one (the
      doubling step of streaming k-center, Charikar et al. 1997). Merged counts add; each merged
      sample slot takes the joining cluster's sample with probability n_j / (n_i + n_j), so counts
      stay exact and samples stay i.i.d. uniform over the merged members; member radius stays
      below 2δ. Repeated until the key fits, so m never exceeds the cap.
    """

    def __init__(self, s: int, t: int, max_clusters: int, delta: float, generator: torch.Generator):
        self.s, self.t, self.cap, self.delta0 = s, t, max_clusters, delta
        self.generator = generator
        self.shape: tuple[int, int] | None = None

    def _init(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        g, _, d = keys.shape
        dev = keys.device
        self.centres = keys.new_zeros(g, 0, d)
        self.counts = torch.zeros(g, 0, dtype=torch.long, device=dev)
        self.sample_keys = keys.new_zeros(g, 0, self.t, d)
        self.sample_pos = torch.zeros(g, 0, self.t, dtype=torch.long, device=dev)
        self.delta = torch.full((g,), float(self.delta0), dtype=torch.float32, device=dev)
        self.num_keys = keys.new_zeros(g, self.s, d)
        self.num_values = values.new_zeros(g, self.s, values.shape[-1])
        self.num_pos = torch.full((g, self.s), -1, dtype=torch.long, device=dev)
        self.num_sq = torch.zeros(g, self.s, dtype=torch.float32, device=dev)
        self.mu = torch.zeros(g, dtype=torch.float64, device=dev)

    @property
    def num_clusters(self) -> torch.Tensor:
        """[B, H_kv]: live clusters per head."""
        return (self.counts > 0).sum(-1).reshape(self.shape)

    def absorb(self, tokens: Tokens) -> None:
        b, h, n, d = tokens.keys.shape
        if self.shape is None:
            self.shape = (b, h)
            self._init(tokens.keys.reshape(b * h, n, d), tokens.values.reshape(b * h, n, -1))
        keys = tokens.keys.reshape(b * h, n, d)
        positions = tokens.positions.reshape(b * h, n)
        self._update_matrix_product(keys, tokens.values.reshape(b * h, n, -1), positions)
        live = (self.counts > 0).sum(-1)
        assign = self._assign(keys, positions, live)
        self._update_reservoirs(keys, positions, assign)

    def _update_matrix_product(self, keys, values, positions) -> None:
        sq = values.float().pow(2).sum(-1)
        block = sq.double().sum(-1)
        total = self.mu + block
        p_new = torch.where(total > 0, block / total.clamp_min(1e-300), torch.zeros_like(total))
        replace = _uniform((keys.shape[0], self.s), self.generator, keys.device) < p_new[:, None]
        probs = torch.where(block[:, None] > 0, sq, torch.ones_like(sq))
        pick = torch.multinomial(probs.to(self.generator.device), self.s, replacement=True, generator=self.generator).to(keys.device)
        self.num_keys = torch.where(replace[..., None], _gather_rows(keys, pick), self.num_keys)
        self.num_values = torch.where(replace[..., None], _gather_rows(values, pick), self.num_values)
        self.num_pos = torch.where(replace, positions.gather(1, pick), self.num_pos)
        self.num_sq = torch.where(replace, sq.gather(1, pick), self.num_sq)
        self.mu = total

    def _assign(self, keys, positions, live) -> torch.Tensor:
        """Cluster index [G, n] of every key of the block, opening and merging clusters on the way."""
        x = keys.float()
        g, n, _ = x.shape
        order = torch.arange(n, device=x.device)
        nearest_dist, nearest = self._nearest(x)
        assign = torch.full((g, n), -1, dtype=torch.long, device=x.device)
        start = torch.zeros(g, dtype=torch.long, device=x.device)
        while True:
            pending = order[None] >= start[:, None]
            far = pending & (nearest_dist > self.delta[:, None])
            has = far.any(-1)
            first = torch.where(has, far.int().argmax(-1), torch.full_like(start, n))
            settle = pending & (order[None] < first[:, None])
            assign = torch.where(settle, nearest, assign)
            start = first
            if not bool(has.any()):
                return assign
            rows = has.nonzero().squeeze(-1)
            opener = keys[rows, first[rows]]
            full = live[rows] >= self.cap
            if bool(full.any()):
                remap = self._merge(rows[full], opener[full].float(), live)
                assign = torch.where(assign >= 0, remap.gather(1, assign.clamp_min(0)), assign)
                nearest_dist, nearest = self._nearest(x, live)
                continue
            self._open(rows, live[rows], opener, positions[rows, first[rows]])
            col = (x[rows] - opener.float()[:, None]).norm(dim=-1)
            closer = col < nearest_dist[rows]
            nearest_dist[rows] = torch.where(closer, col, nearest_dist[rows])
            nearest[rows] = torch.where(closer, live[rows, None], nearest[rows])
            live[rows] += 1

    def _nearest(self, x, live=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Distance [G, n] from every key to its nearest live centre (inf if none) and that centre's index."""
        g, n, _ = x.shape
        if self.centres.shape[1] == 0:
            return torch.full((g, n), float("inf"), device=x.device), torch.zeros(g, n, dtype=torch.long, device=x.device)
        if live is None:
            live = (self.counts > 0).sum(-1)
        dead = torch.arange(self.centres.shape[1], device=x.device)[None] >= live[:, None]
        dist = _distances(x, self.centres).masked_fill(dead[:, None, :], float("inf"))
        return dist.min(dim=-1)

    def _open(self, rows, slots, opener, opener_pos) -> None:
        """A new cluster at column `slots` of each of `rows`: centre and t samples = the opening key, count 0 until the block ends."""
        if bool((slots >= self.centres.shape[1]).any()):
            self._grow()
        self.centres[rows, slots] = opener
        self.counts[rows, slots] = 0
        self.sample_keys[rows, slots] = opener[:, None].expand(-1, self.t, -1)
        self.sample_pos[rows, slots] = opener_pos[:, None]

    def _grow(self) -> None:
        """One more cluster column for every row (dead until opened)."""
        g, _, d = self.centres.shape
        self.centres = torch.cat([self.centres, self.centres.new_zeros(g, 1, d)], 1)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(g, 1)], 1)
        self.sample_keys = torch.cat([self.sample_keys, self.sample_keys.new_zeros(g, 1, self.t, d)], 1)
        self.sample_pos = torch.cat([self.sample_pos, self.sample_pos.new_full((g, 1, self.t), -1)], 1)

    def _merge(self, rows, opener, live) -> torch.Tensor:
        """Cap rule on `rows` (each holding `cap` clusters): grow δ, merge centres within it. Returns the column remap [G, A]."""
        a = self.centres.shape[1]
        centres = self.centres[rows].float()
        _, spread = farthest_point(torch.cat([centres, opener[:, None]], 1), max(1, (self.cap + 1) // 2))
        delta = torch.maximum(2 * self.delta[rows], spread.amax(-1))
        self.delta[rows] = delta
        dist = _distances(centres, centres)
        counts, samples, sample_pos = self.counts[rows], self.sample_keys[rows], self.sample_pos[rows]
        keep = torch.zeros(len(rows), a, dtype=torch.bool, device=centres.device)
        target = torch.arange(a, device=centres.device).repeat(len(rows), 1)
        for j in range(a):
            near_kept = keep & (dist[:, j] <= delta[:, None])
            joins = near_kept.any(-1)
            keep[:, j] = ~joins
            target[:, j] = torch.where(joins, dist[:, j].masked_fill(~near_kept, float("inf")).argmin(-1), target[:, j])
            r = joins.nonzero().squeeze(-1)
            if len(r):
                dest = target[r, j]
                n_i, n_j = counts[r, dest], counts[r, j]
                p_j = n_j.double() / (n_i + n_j).clamp_min(1).double()
                take = _uniform((len(r), self.t), self.generator, centres.device) < p_j[:, None]
                samples[r, dest] = torch.where(take[..., None], samples[r, j], samples[r, dest])
                sample_pos[r, dest] = torch.where(take, sample_pos[r, j], sample_pos[r, dest])
                counts[r, dest] = n_i + n_j
        new_index = keep.long().cumsum(-1) - 1
        column = torch.argsort((~keep).long(), dim=-1, stable=True)
        kept = keep.sum(-1)
        dead = torch.arange(a, device=centres.device)[None] >= kept[:, None]
        self.centres[rows] = _gather_rows(self.centres[rows], column)
        self.counts[rows] = counts.gather(1, column).masked_fill(dead, 0)
        self.sample_keys[rows] = _gather_rows(samples, column)
        self.sample_pos[rows] = _gather_rows(sample_pos, column).masked_fill(dead[..., None], -1)
        live[rows] = kept
        remap = torch.arange(a, device=centres.device).repeat(self.centres.shape[0], 1)
        remap[rows] = new_index.gather(1, target)
        return remap

    def _update_reservoirs(self, keys, positions, assign) -> None:
        g, n, _ = keys.shape
        a = self.centres.shape[1]
        joined = torch.zeros(g, a, dtype=torch.long, device=keys.device).scatter_add_(1, assign, torch.ones_like(assign))
        total = self.counts + joined
        p_new = joined.double() / total.clamp_min(1).double()
        replace = _uniform((g, a, self.t), self.generator, keys.device) < p_new[..., None]
        grouped = torch.argsort(assign * n + torch.arange(n, device=keys.device)[None], dim=-1)
        offset = joined.cumsum(-1) - joined
        rank = (_uniform((g, a, self.t), self.generator, keys.device) * joined[..., None]).long()
        rank = torch.minimum(rank, (joined[..., None] - 1).clamp_min(0))
        member = grouped.gather(1, (offset[..., None] + rank).clamp_max(n - 1).reshape(g, -1)).reshape(g, a, self.t)
        self.sample_keys = torch.where(replace[..., None], _gather_rows(keys, member), self.sample_keys)
        self.sample_pos = torch.where(replace, positions.gather(1, member.reshape(g, -1)).reshape(g, a, self.t), self.sample_pos)
        self.counts = total

    def summary(self) -> KVSummary | None:
        if self.shape is None:
            return None
        b, h = self.shape
        filled = self.num_pos >= 0
        num_log = (self.mu.log()[:, None] - math.log(self.s) - self.num_sq.double().log()).float()
        num_log = num_log.masked_fill(~filled, float("-inf"))
        a, d = self.centres.shape[1], self.centres.shape[-1]
        den_log = (self.counts.double() / self.t).log().float()[..., None].expand(-1, -1, self.t)
        normalizer = Normalizer(
            self.sample_keys.reshape(b, h, a * self.t, d),
            den_log.reshape(b, h, a * self.t),
            self.sample_pos.reshape(b, h, a * self.t),
        )
        return KVSummary(
            self.num_keys.reshape(b, h, self.s, d),
            self.num_values.reshape(b, h, self.s, -1),
            num_log.reshape(b, h, self.s),
            self.num_pos.reshape(b, h, self.s),
            normalizer,
        )

    def nbytes(self) -> int:
        if self.shape is None:
            return 0
        stored = (self.centres, self.counts, self.sample_keys, self.sample_pos, self.delta,
                  self.num_keys, self.num_values, self.num_pos, self.num_sq, self.mu)
        return sum(x.numel() * x.element_size() for x in stored)


@register
@dataclass
class SubGen(Method):
    """SubGen's streaming estimator (seed 001, Alg. 1) with a hard slot budget.

    Parameters: `s` numerator samples (default budget // 2), `t` samples per cluster (4),
    `delta` initial clustering radius in raw key space (default 0.0: every distinct key opens a
    cluster until the cap is reached, and the cap rule then sets δ from the data — the greedy
    k-center radius of the centres at half the cap — and doubles it at every later cap hit),
    `max_clusters` (default (budget - s) // t). Slots per head = s + t * m <= s + t * max_clusters
    <= budget (numerator slots hold a key and a value, normalizer slots a key); memory is
    O(d (m t + s)). Seed defaults: no sinks (`default_sink = 0`) and a recent window (64), which
    enters the denominator exactly. See `SubGenState` for the block rules and the cap rule.
    """

    name = "subgen"
    randomized = True
    default_sink = 0
    default_window = 64
    s: int | None = None
    t: int = 4
    delta: float = 0.0
    max_clusters: int | None = None

    def __post_init__(self):
        for field, value, low in (("s", self.s, 1), ("t", self.t, 1), ("max_clusters", self.max_clusters, 1)):
            if value is None and field != "t":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{field} must be an integer >= {low}, got {value!r}")
        if isinstance(self.delta, bool) or not isinstance(self.delta, (int, float)) or not (0.0 <= self.delta < math.inf):
            raise ValueError(f"delta must be a finite number >= 0, got {self.delta!r}")

    def sizes(self, budget: int) -> tuple[int, int]:
        """(s, max_clusters) for a budget of slots per head."""
        s = self.s if self.s is not None else max(1, budget // 2)
        cap = self.max_clusters if self.max_clusters is not None else (budget - s) // self.t
        if cap < 1 or s + self.t * cap > budget:
            raise ValueError(
                f"subgen needs s + t * max_clusters <= budget with max_clusters >= 1; got s={s}, t={self.t}, "
                f"max_clusters={cap}, budget={budget}: raise the budget or lower s / t / max_clusters"
            )
        return s, cap

    def new_stream(self, budget: int, generator: torch.Generator) -> SubGenState:
        s, cap = self.sizes(budget)
        return SubGenState(s, self.t, cap, float(self.delta), generator)
