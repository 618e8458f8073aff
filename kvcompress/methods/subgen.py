"""SubGen: sublinear streaming attention by online key clustering and value-norm sampling.

Zandieh, Han, Mirrokni, Karbasi, "SubGen: Token Generation in Sublinear Time and Memory", 2024,
arXiv:2402.06082 (Alg. 1). The keys are clustered online by greedy δ-clustering (UpdateSoftmaxNormalizer);
the partition function is estimated from uniform samples stratified by those clusters; the
attention numerator from s samples drawn with probability ∝ ‖v‖² (UpdateMatrixProduct).
QueryStreamAttn is `weighted_attention` over the resulting `KVSummary`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import as_count, as_real
from ..saved_state import Count, Generator, Maybe, Real, Record, Tensor, saved
from ..summary import KVSummary, take_slots
from .base import Method, StreamState
from .clustergen import farthest_point, squared_distances, squared_norms
from .registry import register
from .tokens import Tokens


def _uniform(shape, generator: torch.Generator, device) -> torch.Tensor:
    """Uniform [0, 1) draws from `generator` (on its own device), moved to `device`."""
    return torch.rand(shape, generator=generator, device=generator.device, dtype=torch.float64).to(device)


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [G, n, ...], index [G, k] -> [G, k, ...]: per-row gather along the token axis (`take_slots`: one index_select,
    and no copy of a strided x such as the model's keys and values)."""
    return take_slots(x.unsqueeze(0), index.unsqueeze(0)).squeeze(0)


def _distances(points: torch.Tensor, centres: torch.Tensor, points_sq: torch.Tensor | None = None,
               centres_sq: torch.Tensor | None = None) -> torch.Tensor:
    """Euclidean distances [G, n, m] between float32 points [G, n, d] and centres [G, m, d] (`squared_distances`)."""
    return squared_distances(points, centres, points_sq, centres_sq).sqrt_()


@saved("subgen_state")
class SubGenState(StreamState):
    """SubGen's data structures for every (batch, head), stored flat over G = B * H_kv rows.

    - Numerator M (the paper's Lemma 1): s keys/values/positions i.i.d. ∝ ‖v‖², their ‖v‖², μ = Σ‖v‖².
    - Clusters (the paper's Lemma 2): centres [G, cap, d] (the key that opened each cluster, with its
      value and position), exact counts n_i [G, cap], radius δ [G]; live clusters are the first
      `live` columns.
    - Normalizer samples R: r keys/values/positions i.i.d. uniform over every token seen, each
      with the cluster it joined.

    Block rules (the law of the paper's per-token rules, applied to a whole block at once):
    - Reservoirs: after a block of total weight W (‖v‖² for M, 1 per token for R), each slot
      independently holds a block token drawn ∝ its weight with probability W / (seen + W).
    - Clustering: every key within δ of a centre joins its nearest centre. Keys farther than δ
      open clusters in farthest-first order (the farthest uncovered key of each row opens the
      next one; at most `cap` masked steps per block, vectorised over tokens and rows, no Python loop
      over tokens), until every key lies within δ of a centre. Departure: the paper opens them in
      arrival order; both leave centres more than δ apart and every key within δ of its centre.
    - Cluster cap (departure: the paper lets m grow with the data): when keys remain uncovered
      with `cap` clusters live, the doubling step of streaming k-center (Charikar et al. 1997)
      runs: greedy k-center picks cap // 2 centres among the live centres and the uncovered keys,
      δ ← max(2δ, its covering radius), and every cluster merges into its nearest kept centre
      (counts add; samples keep pointing at the merged cluster). A host check per block decides
      whether any key is uncovered (then the opening steps run) and whether the doubling step runs.
    """

    def __init__(self, s: int, r: int, cap: int, delta: float, cluster_weight: float, generator: torch.Generator):
        self.s, self.r, self.cap, self.delta0, self.cluster_weight = s, r, cap, delta, cluster_weight
        self.generator = generator
        self.shape: tuple[int, int] | None = None

    # the tensors `_init` allocates at the first block (None before it): G = batch × KV heads rows
    _LAZY = {
        "centres": Tensor("G C D"), "centre_values": Tensor("G C V"), "centre_pos": Tensor("G C", ("int64",)),
        "counts": Tensor("G C", ("int64",)), "live": Tensor("G", ("int64",)), "delta": Tensor("G", ("float32",)),
        "num_keys": Tensor("G S D"), "num_values": Tensor("G S V"), "num_pos": Tensor("G S", ("int64",)),
        "num_sq": Tensor("G S", ("float32",)), "mu": Tensor("G", ("float64",)), "sample_keys": Tensor("G R D"),
        "sample_values": Tensor("G R V"), "sample_pos": Tensor("G R", ("int64",)), "sample_cluster": Tensor("G R", ("int64",)),
        "seen": Tensor("G", ("float64",)),
    }
    saved_fields = {
        "s": Count(1), "r": Count(1), "cap": Count(1), "delta0": Real(0.0), "cluster_weight": Real(0.0), "generator": Generator(),
        "shape": Maybe(Record((Count(1), Count(1)))), **{name: Maybe(spec) for name, spec in _LAZY.items()},
    }

    def saved_values(self) -> dict:
        lazy = {name: getattr(self, name) if self.shape is not None else None for name in self._LAZY}
        return {**{name: getattr(self, name) for name in self.saved_fields if name not in lazy}, **lazy}

    @classmethod
    def from_saved(cls, values):
        return super().from_saved({name: v for name, v in values.items() if v is not None or name not in cls._LAZY})

    def check_saved(self) -> None:
        lazy = [name for name in self._LAZY if getattr(self, name, None) is not None]
        if self.shape is None:
            if lazy:
                raise ValueError(f"{lazy} are saved before any block (shape is null)")
            return
        if len(lazy) != len(self._LAZY):
            raise ValueError(f"shape {self.shape} is set but {sorted(set(self._LAZY) - set(lazy))} are missing")
        g = self.shape[0] * self.shape[1]
        sizes = (self.centres.shape[:2], self.num_keys.shape[1], self.sample_keys.shape[1])
        if sizes != ((g, self.cap), self.s, self.r):
            raise ValueError(f"centres {list(self.centres.shape)}, {self.num_keys.shape[1]} norm samples and {self.sample_keys.shape[1]} "
                             f"samples, expected {g} rows, {self.cap} centres, {self.s} and {self.r}")
        if bool((self.live < 0).any() | (self.live > self.cap).any()):
            raise ValueError(f"live cluster counts outside 0..{self.cap}")
        if bool((self.sample_cluster < 0).any() | (self.sample_cluster >= self.cap).any()):
            raise ValueError(f"sample clusters outside 0..{self.cap - 1}")

    def _init(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        g, _, d = keys.shape
        dev = keys.device
        self.centres = keys.new_zeros(g, self.cap, d)
        self.centre_values = values.new_zeros(g, self.cap, values.shape[-1])
        self.centre_pos = torch.full((g, self.cap), -1, dtype=torch.long, device=dev)
        self.counts = torch.zeros(g, self.cap, dtype=torch.long, device=dev)
        self.live = torch.zeros(g, dtype=torch.long, device=dev)
        self.delta = torch.full((g,), float(self.delta0), dtype=torch.float32, device=dev)
        self.num_keys, self.num_values = keys.new_zeros(g, self.s, d), values.new_zeros(g, self.s, values.shape[-1])
        self.num_pos = torch.full((g, self.s), -1, dtype=torch.long, device=dev)
        self.num_sq = torch.zeros(g, self.s, dtype=torch.float32, device=dev)
        self.mu = torch.zeros(g, dtype=torch.float64, device=dev)
        self.sample_keys, self.sample_values = keys.new_zeros(g, self.r, d), values.new_zeros(g, self.r, values.shape[-1])
        self.sample_pos = torch.full((g, self.r), -1, dtype=torch.long, device=dev)
        self.sample_cluster = torch.zeros(g, self.r, dtype=torch.long, device=dev)
        self.seen = torch.zeros(g, dtype=torch.float64, device=dev)

    @property
    def num_clusters(self) -> torch.Tensor:
        """[B, H_kv]: live clusters per head."""
        return self.live.reshape(self.shape)

    def absorb(self, tokens: Tokens) -> None:
        b, h, n, d = tokens.keys.shape
        keys, values = tokens.keys.reshape(b * h, n, d), tokens.values.reshape(b * h, n, -1)
        positions = tokens.positions.reshape(b * h, n)
        if self.shape is None:
            self.shape = (b, h)
            self._init(keys, values)
        sq = squared_norms(values.float())
        rows, slots, pick = self._reservoir(sq, self.mu, self.s)
        for store, source in ((self.num_keys, keys), (self.num_values, values), (self.num_pos, positions), (self.num_sq, sq)):
            store[rows, slots] = source[rows, pick]
        self.mu = self.mu + sq.double().sum(-1)
        assign = self._cluster(keys, values, positions)
        self.counts.scatter_add_(1, assign, torch.ones_like(assign))
        rows, slots, pick = self._reservoir(None, self.seen, self.r, n)
        for store, source in ((self.sample_keys, keys), (self.sample_values, values), (self.sample_pos, positions), (self.sample_cluster, assign)):
            store[rows, slots] = source[rows, pick]
        self.seen = self.seen + n

    def _reservoir(self, weights: torch.Tensor | None, total: torch.Tensor, slots: int, n: int | None = None):
        """Slots that take a block token, and which: (rows [K], slots [K], pick [K]).

        weights [G, n] (None: uniform over the n block tokens), total [G] the earlier weight. Each of
        the `slots` slots of a row is replaced with probability W / (total + W), W the block's weight,
        by a token drawn ∝ weights, one binary search per slot (O(slots·log n) per block).
        """
        g = total.shape[0]
        device = total.device
        block = weights.double().sum(-1) if weights is not None else torch.full((g,), float(n), dtype=torch.float64, device=device)
        after = total + block
        p_new = torch.where(after > 0, block / after.clamp_min(1e-300), torch.zeros_like(after))
        rows, which = (_uniform((g, slots), self.generator, device) < p_new[:, None]).nonzero(as_tuple=True)
        u = _uniform(rows.shape, self.generator, device)
        if weights is None:
            return rows, which, (u * n).long().clamp_max(n - 1)
        cdf = weights.double().cumsum(-1)
        uniform = torch.arange(1, weights.shape[1] + 1, device=device, dtype=torch.float32) / weights.shape[1]
        cdf = torch.where(block[:, None] > 0, cdf / block.clamp_min(1e-300)[:, None], uniform)
        draws = torch.zeros(g, slots, dtype=cdf.dtype, device=device)
        draws[rows, which] = u.to(cdf.dtype)  # each row's draws searched in its own cdf: no [K, n] copy of cdf rows
        pick = torch.searchsorted(cdf, draws, right=True)[rows, which]
        return rows, which, pick.clamp_max(weights.shape[1] - 1)

    def _cluster(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Cluster column [G, n] of every key of the block, opening (and if needed merging) clusters on the way.

        When some key is uncovered, the block's keys are first copied into float32 rows behind room for the centres,
        the points `_double` takes (contiguous rows: the distance products of the opening steps read them faster than
        the model's strided keys).
        """
        x = keys.float()
        g, n, d = x.shape
        rows = torch.arange(g, device=x.device)
        x_sq = squared_norms(x)
        if bool(self.live.any()):
            columns = torch.arange(self.cap, device=x.device)
            dist = _distances(x, self.centres.float(), x_sq).masked_fill_((columns[None] >= self.live[:, None])[:, None, :], float("inf"))
            dist, nearest = dist.min(-1)
        else:  # no cluster yet (a fresh state's first block): every key uncovered, as the masked distances would say
            dist, nearest = torch.full((g, n), float("inf"), device=x.device), torch.zeros(g, n, dtype=torch.long, device=x.device)
        if not bool((dist > self.delta[:, None]).any()):
            return nearest
        points = x.new_empty(g, self.cap + n, d)
        x = points[:, self.cap :].copy_(x)
        opened = []  # (key opening a cluster in each row, whether it opens one) per step; the centres are written after the loop
        for _ in range(min(self.cap, n)):
            best_dist, best = dist.max(-1)  # the farthest key: uncovered (it opens a cluster) unless every key is covered
            opens = (best_dist > self.delta) & (self.live < self.cap)
            if not bool(opens.any()):  # nothing changed: no later step opens one either
                break
            col = self.live.clamp_max(self.cap - 1)
            new_dist = _distances(x, x[rows, best].unsqueeze(1), x_sq, x_sq[rows, best].unsqueeze(1)).squeeze(-1)
            closer = opens[:, None] & (new_dist <= dist)
            dist = torch.where(closer, new_dist, dist)
            nearest = torch.where(closer, col[:, None], nearest)
            self.live = self.live + opens.long()
            opened.append((best, opens))
        if opened:
            self._open(opened, keys, values, positions)
        uncovered = dist > self.delta[:, None]
        if bool(uncovered.any()):
            nearest = self._double(points, x_sq, keys, values, positions, nearest, uncovered)
        return nearest

    def _open(self, opened: list[tuple[torch.Tensor, torch.Tensor]], keys, values, positions) -> None:
        """Write the clusters the opening steps opened: opened holds each step's (best [G], opens [G]); a row's opening
        steps took its next free columns in turn, so its clusters end at column `live` [G] (already counted)."""
        best, opens = (torch.stack(part, 1) for part in zip(*opened))  # [G, steps]
        col = self.live[:, None] - opens.long().flip(1).cumsum(1).flip(1)  # a step's column: live less the openings from it on
        row, step = opens.nonzero(as_tuple=True)
        token, col = best[row, step], col[row, step]
        self.centres[row, col] = keys[row, token]
        self.centre_values[row, col] = values[row, token]
        self.centre_pos[row, col] = positions[row, token]

    def _double(self, points, x_sq, keys, values, positions, nearest, uncovered) -> torch.Tensor:
        """Cap rule on the rows with uncovered keys: k-center at cap // 2 over live centres + uncovered keys, δ doubling, merge.
        points [G, cap + n, d] float32 with the block's keys in its last n rows (the first cap are written here: the
        centres), x_sq [G, n] the keys' squared norms. Returns the block's cluster columns."""
        need = uncovered.any(-1)
        g, _, d = points.shape
        k = max(1, self.cap // 2)
        centres = points[:, : self.cap]
        centres.copy_(self.centres)
        points_sq = torch.cat([squared_norms(centres), x_sq], 1)
        valid = torch.cat([torch.arange(self.cap, device=points.device)[None] < self.live[:, None], uncovered], 1)
        chosen, spread = farthest_point(points, k, valid, points_sq)
        radius = spread.masked_fill(~valid, float("-inf")).amax(-1).clamp_min(0.0)
        self.delta = torch.where(need, torch.maximum(2 * self.delta, radius), self.delta)
        new_centres = _gather_rows(points, chosen)
        # [G, cap + n]: the kept centre nearest to each point (see `squared_distances`: min's indices, the first of
        # equal minima, as argmin's)
        owner = squared_distances(points, new_centres, points_sq, points_sq.gather(1, chosen)).min(-1).indices
        old_to_new = owner[:, : self.cap]
        block_owner = torch.where(uncovered, owner[:, self.cap :], old_to_new.gather(1, nearest))
        counts = torch.zeros_like(self.counts).scatter_add_(1, old_to_new, self.counts)
        cols = torch.arange(self.cap, device=points.device).clamp_max(k - 1)
        source = chosen.gather(1, cols[None].expand(g, -1))  # [G, cap] into [centres; block]
        from_centre = source < self.cap
        merged = (
            torch.cat([new_centres, new_centres.new_zeros(g, self.cap - k, d)], 1).to(keys.dtype),
            torch.where(from_centre[..., None], _gather_rows(self.centre_values, source.clamp_max(self.cap - 1)),
                        _gather_rows(values, (source - self.cap).clamp_min(0))),
            torch.where(from_centre, self.centre_pos.gather(1, source.clamp_max(self.cap - 1)), positions.gather(1, (source - self.cap).clamp_min(0))),
        )
        n_row = need[:, None]
        self.centres = torch.where(n_row[..., None], merged[0], self.centres)
        self.centre_values = torch.where(n_row[..., None], merged[1], self.centre_values)
        self.centre_pos = torch.where(n_row, merged[2].masked_fill(torch.arange(self.cap, device=points.device)[None] >= k, -1), self.centre_pos)
        self.counts = torch.where(n_row, counts, self.counts)
        self.sample_cluster = torch.where(n_row, old_to_new.gather(1, self.sample_cluster), self.sample_cluster)
        self.live = torch.where(need, torch.full_like(self.live, k), self.live)
        return torch.where(n_row, block_owner, nearest)

    def summary(self) -> KVSummary | None:
        if self.shape is None:
            return None
        b, h = self.shape
        filled = self.sample_pos >= 0
        per_cluster = torch.zeros_like(self.counts).scatter_add_(1, self.sample_cluster, filled.long())
        log_share = math.log(self.cluster_weight)
        counts = self.counts.double()
        sample_log = (counts.gather(1, self.sample_cluster) / per_cluster.gather(1, self.sample_cluster).clamp_min(1)).log()
        sample_log = (sample_log + log_share).float().masked_fill(~filled, float("-inf"))
        empty = (per_cluster == 0) & (self.counts > 0)
        centre_log = (counts.log() + log_share).float().masked_fill(~empty, float("-inf"))
        num_log = (self.mu.log()[:, None] - math.log(self.s) - self.num_sq.double().log() + math.log(1 - self.cluster_weight)).float()
        num_log = num_log.masked_fill(self.num_pos < 0, float("-inf"))
        keys = torch.cat([self.num_keys, self.sample_keys, self.centres], 1)
        values = torch.cat([self.num_values, self.sample_values, self.centre_values], 1)
        log_weights = torch.cat([num_log, sample_log, centre_log], 1)
        positions = torch.cat([self.num_pos, self.sample_pos, self.centre_pos.masked_fill(~empty, -1)], 1)
        slots = keys.shape[1]
        return KVSummary(
            keys.reshape(b, h, slots, -1), values.reshape(b, h, slots, -1),
            log_weights.reshape(b, h, slots), positions.reshape(b, h, slots),
        )

    def kv_tensors(self) -> list[torch.Tensor]:
        if self.shape is None:
            return []
        return [self.centres, self.centre_values, self.num_keys, self.num_values, self.sample_keys, self.sample_values]

    def set_kv_tensors(self, tensors: list[torch.Tensor]) -> None:
        if tensors:
            self.centres, self.centre_values, self.num_keys, self.num_values, self.sample_keys, self.sample_values = tensors

    def nbytes(self) -> int:
        """KV bytes: the keys and values of the centres and both sample sets (budget slots per head). Positions,
        counts, radii and ‖v‖² are bookkeeping, counted apart (`index_nbytes`), as for every summary."""
        return sum(x.numel() * x.element_size() for x in self.kv_tensors())

    def index_nbytes(self) -> int:
        """Bytes of the bookkeeping: positions, cluster counts and memberships, radii, ‖v‖² and the counters."""
        if self.shape is None:
            return 0
        stored = (self.centre_pos, self.counts, self.live, self.delta, self.num_pos, self.num_sq, self.mu, self.sample_pos,
                  self.sample_cluster, self.seen)
        return sum(x.numel() * x.element_size() for x in stored)


@register
@dataclass
class SubGen(Method):
    """SubGen's streaming estimator (the paper's Alg. 1) with a hard slot budget.

    The summary is one weighted slot set used for numerator and denominator alike: the ‖v‖²
    samples M with weight (1 − cluster_weight)·μ / (s‖v‖²) (the paper's numerator estimator), and
    the uniform samples R post-stratified by cluster, weight cluster_weight·n_i / c_i (c_i: samples
    that fell in cluster i; a cluster with none is represented by its centre, weight
    cluster_weight·n_i). The ‖v‖² part is an unbiased estimate of the middle's numerator and partition
    function. The uniform part is unbiased for every cluster that holds a sample; a cluster that
    holds none (chance P0_i) stands in with its centre, a fixed token rather than a random one, so the
    part's expectation is Σ_i n_i·[(1 − P0_i)·mean_i + P0_i·f(centre_i)]: biased towards the centres of
    the clusters the reservoir misses (the small ones), the price of keeping every cluster in the
    summary within the budget.

    Departures from the paper, and why: the paper estimates the denominator from t samples per
    cluster (weight n_i / t) and the numerator from M alone. A fixed t per cluster puts a few
    high-weight samples in big clusters, and with the two estimates from different samples the
    ratio is unbounded, so on real layers that estimator's attention error exceeds uniform
    sampling's and grows with the key scale. Here the denominator's samples are allocated to
    clusters in proportion to their size (post-stratification of one uniform reservoir), and numerator and
    denominator share their slots, so the output is a convex combination of values: finite for any key scale.

    Parameters (defaults tuned on real layers of the default model, on other text than the
    reported bench's; the ‖v‖² part gets the smallest share because it helped least):
    `s`: ‖v‖² samples, an integer >= 1 or None (the default: max(1, budget // 24)).
    `max_clusters`: cap on clusters, an integer >= 1 or None (the default: max(1, min(16, budget // 8))).
    `delta`: initial radius in raw key space, a number >= 0 (default 0.0: every distinct key opens a
    cluster until the cap, the cap rule then sets δ from the data and doubles it at later cap hits).
    `cluster_weight`: a number in (0, 1) (default 0.95).
    The uniform reservoir takes the rest: r = budget − s − max_clusters. Slots per head = s + r +
    max_clusters = budget. Memory O(d·budget) whatever the stream length. Cost per block of b tokens
    O(b·cap·d) plus `cap` vectorised steps.

    Window: 64 tokens kept exactly (`default_window = 64`, this library's default; the paper's experiments
    keep a window of recent tokens without giving its size). Sink: 4 tokens kept exactly (`default_sink = 4`;
    departure: the paper keeps none, but then the first token's large attention mass enters only through
    whichever samples happen to hold it, and the model's output degenerates end to end).
    """

    name = "subgen"
    randomized = True
    stream_recompresses = False
    default_sink = 4
    default_window = 64
    s: int | None = None
    max_clusters: int | None = None
    delta: float = 0.0
    cluster_weight: float = 0.95

    def __post_init__(self):
        self.s = as_count("s", self.s, 1, optional=True)
        self.max_clusters = as_count("max_clusters", self.max_clusters, 1, optional=True)
        self.delta = as_real("delta", self.delta, "the clustering radius", minimum=0.0)
        if isinstance(self.cluster_weight, bool) or not isinstance(self.cluster_weight, (int, float)) or not (0.0 < self.cluster_weight < 1.0):
            raise ValueError(f"cluster_weight must be a number in (0, 1), got {self.cluster_weight!r}")

    def sizes(self, budget: int) -> tuple[int, int, int]:
        """(s, r, max_clusters) for a budget of slots per head."""
        s = self.s if self.s is not None else max(1, budget // 24)
        cap = self.max_clusters if self.max_clusters is not None else max(1, min(16, budget // 8))
        r = budget - s - cap
        if r < 1:
            raise ValueError(
                f"subgen needs s + max_clusters < budget (the rest holds the uniform samples); got s={s}, "
                f"max_clusters={cap}, budget={budget}: raise the budget (>= 3) or lower s / max_clusters"
            )
        return s, r, cap

    def new_stream(self, budget: int, generator: torch.Generator, slack: float | None = None) -> SubGenState:
        """Native stream (at most `budget` slots, never re-compressed): a slack is refused (`stream_slack`)."""
        self.stream_slack(slack)
        s, r, cap = self.sizes(budget)
        return SubGenState(s, r, cap, float(self.delta), float(self.cluster_weight), generator)
