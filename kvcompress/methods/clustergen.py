"""ClusterGen: the practical variant of SubGen's experiments, recent window + greedy k-center centres.

Zandieh, Han, Mirrokni, Karbasi, "SubGen: Token Generation in Sublinear Time and Memory", 2024,
arXiv:2402.06082 (Sec. 3.2): keep the r most recent tokens plus k centres chosen by the greedy k-center
(farthest-point) algorithm of Gonzalez (1985) over the remaining keys, applied once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..checks import as_count
from ..saved_state import Count, Instance, Maybe, Sequence, saved
from ..summary import KVSummary, gather_slots
from .base import Method, StreamState
from .budget import check_slack, stream_split
from .registry import register
from .tokens import Tokens, cat_tokens

# Pairwise inner products materialised at once (float32) by farthest_point; above this it takes one
# matrix-vector product per step instead.
_MAX_GRAM = 1 << 25


def squared_norms(x: torch.Tensor) -> torch.Tensor:
    """‖x‖² over the last axis of float32 x [..., d] -> [...] (the norm's own reduction, a few times faster on the CPU
    than squaring and summing over a short last axis)."""
    return torch.linalg.vector_norm(x, dim=-1).square_()


def squared_distances(points: torch.Tensor, centres: torch.Tensor, points_sq: torch.Tensor | None = None,
                      centres_sq: torch.Tensor | None = None) -> torch.Tensor:
    """‖x − c‖² [G, n, m] (clamped at 0) of float32 points [G, n, d] and centres [G, m, d], as ‖x‖² − 2<x, c> + ‖c‖²;
    points_sq [G, n] and centres_sq [G, m], their squared norms (`squared_norms`), when the caller has them. The
    products are one batched matmul with the points as its wide right-hand side (centres · pointsᵀ, read back
    transposed), which the CPU runs about twice as fast as points · centresᵀ when m is small. The result is that
    transposed view: reduce it over the centres with min/max, whose indices come several times faster than argmin's."""
    points_sq = squared_norms(points) if points_sq is None else points_sq
    centres_sq = squared_norms(centres) if centres_sq is None else centres_sq
    dots = torch.bmm(centres, points.transpose(1, 2)).transpose(1, 2)
    return dots.mul_(-2.0).add_(points_sq.unsqueeze(-1)).add_(centres_sq.unsqueeze(1)).clamp_min_(0.0)


def farthest_point(points: torch.Tensor, k: int, valid: torch.Tensor | None = None,
                   points_sq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy k-center (farthest-first traversal), batched over the leading axis.

    points [G, n, d] (any float dtype; distances in float32), valid [G, n] bool or None (invalid
    points are never chosen and ignored by the radius; point 0 must be valid), points_sq [G, n] their float32 squared
    norms (`squared_norms`) when the caller has them. The traversal starts
    at point 0 and adds the point farthest from the chosen set, k times in all.
    Returns (index [G, k] in selection order, distance of every point to its nearest centre [G, n],
    -inf for the centres themselves and for invalid points, so a centre is never chosen twice); the
    covering radius is the max of the latter. k must be at most the number of valid points.
    Squared distances ‖x‖² − 2<x, c> + ‖c‖² come from a table of all pairs when G·n² <= _MAX_GRAM
    (one batched matmul up front, one gather per step), else from one matrix-vector product per step. Without
    points_sq the points are first shifted by point 0 (distances do not move), so that a large part every point shares
    does not cancel the digits of that difference.
    """
    x = points.float()
    if points_sq is None:
        x = x - x[:, :1]
    g, n, _ = x.shape
    rows = torch.arange(g, device=x.device)
    index = torch.zeros(g, k, dtype=torch.long, device=x.device)
    sq_norms = squared_norms(x) if points_sq is None else points_sq
    if g * n * n <= _MAX_GRAM:  # every squared distance at once: row c holds ‖x‖² − 2<x, x_c> + ‖x_c‖², one gather per step
        table = torch.bmm(x, x.transpose(1, 2)).mul_(-2.0).add_(sq_norms[:, None, :]).add_(sq_norms[:, :, None]).clamp_min_(0.0)

        def sq_distance_to(centre: torch.Tensor) -> torch.Tensor:
            return table[rows, centre]
    else:

        def sq_distance_to(centre: torch.Tensor) -> torch.Tensor:
            return squared_distances(x, x[rows, centre].unsqueeze(1), sq_norms, sq_norms[rows, centre].unsqueeze(1)).squeeze(-1)

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

    The paper keeps only a recent window besides the centres (no sinks): here the window is the
    framework's `window` (default 64) and `default_sink = 0`. The centres are plain kept tokens
    (log-weight 0) as in the paper; `weighted=True` instead gives each centre the log of the number
    of keys nearest to it (a cluster-size-weighted coreset, an option the paper does not use).
    Streaming with an integer block_size (`ClusterGenState.within`) gives, after any number of
    tokens, the one-shot summary of every token seen at the stream's target (the budget less the
    room for the waiting runs and the run in progress, `budget.stream_split`; runs of min(B, room)
    tokens): each run's farthest-first traversal is computed once, when the run completes, and the
    run keeps the first quota(n) points of it (quotas only shrink as n grows, a traversal's prefix
    is the traversal of the smaller quota), so an update costs O(B²·d) per completed run plus one
    copy of the kept slots: linear in n per run of B tokens. block_size=None or weighted=True stream
    block-wise (the state of `methods.base`): the kept centres and the new tokens fill a buffer of
    `budget` slots, which is re-clustered down to its target (`budget.stream_split`) when the next
    tokens do not fit, O(budget²·d) per re-compression, each token in about 1 + 1/slack of them;
    storage at most `budget` slots.

    weighted: False (default) or True, as above.
    block_size: None runs the paper's k-center over all n keys of a head: `budget` sequential
    farthest-point steps of O(n·d) each, O(budget·n·d) per head, quadratic when the budget is a
    fixed share of n. An integer B >= 1 (departure from the paper, default 256) runs k-center inside each
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
        self.block_size = as_count("block_size", self.block_size, 1, optional=True)

    def compress(self, tokens: Tokens, budget: int, generator: torch.Generator) -> KVSummary:
        if tokens.length <= budget:
            return tokens.exact()
        b, h, n, d = tokens.keys.shape
        keys = tokens.keys.reshape(b * h, n, d)
        chosen = farthest_point(keys, budget)[0] if self.block_size is None or self.block_size >= n else block_centres(keys, budget, self.block_size)
        index = chosen.reshape(b, h, budget).sort(dim=-1).values
        keys, values, positions = gather_slots(tokens.keys, tokens.values, tokens.positions, index)
        log_weights = torch.zeros(positions.shape, device=keys.device, dtype=torch.float32)
        if self.weighted:
            # keys shifted by the first (as `farthest_point`): cdist's |x|^2 + |c|^2 - 2<x, c> cancels on a large common part
            origin = tokens.keys[:, :, :1].float()
            owner = torch.cdist(tokens.keys.float() - origin, keys.float() - origin).argmin(dim=-1)
            sizes = torch.zeros(b, h, budget, device=keys.device).scatter_add_(2, owner, torch.ones_like(owner, dtype=torch.float32))
            log_weights = sizes.log()
        return KVSummary(keys, values, log_weights, positions)

    def new_stream(self, budget: int, generator: torch.Generator, slack: float | None = None) -> StreamState:
        """Native (`ClusterGenState.within`: completed runs wait, within the budget, before their batched traversal)
        with block_size and unweighted; otherwise block-wise with `slack`."""
        if self.block_size is None or self.weighted:
            return super().new_stream(budget, generator, slack)
        return ClusterGenState.within(budget, self.block_size, self.stream_slack(slack))


def run_quotas(ends: list[int], budget: int, n: int) -> list[int]:
    """Centres of each run when n tokens are seen: ⌊budget·C_j/n⌋ − ⌊budget·C_{j−1}/n⌋, C_j the tokens up to run j's end (`block_centres`' rule)."""
    cumulative = [budget * end // n for end in ends]
    return [c - p for c, p in zip(cumulative, [0, *cumulative[:-1]])]


@saved("clustergen_state", 2)
class ClusterGenState(StreamState):
    """Block-local k-center as a stream: every completed run of `block_size` tokens holds the head of
    its farthest-first traversal (batched over batch and heads), trimmed to its quota as n grows.

    Completed runs wait, exact, until they hold more than `slack_slots` tokens (or until `compact()`);
    then all waiting runs are traversed in one batched call and every run is trimmed to its current
    quota. Quotas only shrink as n grows and a traversal's prefix is the traversal of a
    smaller quota, so waiting changes no kept slot; it batches the traversal's sequential steps and
    trims each run once per wait instead of once per run. slack_slots 0 traverses and trims at
    every completed run. Built directly, the state takes slack_slots = ceil(slack·budget) on top of
    `budget`; a stream's state is built by `within`, which fits the traversed runs, the waiting
    runs and the run in progress into the stream's budget.

    summary() after n tokens equals `ClusterGen.compress` of those n tokens (block_size runs counted
    from the first absorbed token), except when floor rounding gives a run one centre more than it
    had at an earlier trim: that slot is gone and the summary holds one slot fewer (never more than
    `budget`). Storage: at most `budget` slots of traversed runs, `slack_slots` tokens of waiting runs
    and block_size tokens of the run in progress (the run that has just completed, before the wait is
    traversed); `within` sizes the three so that they fit a stream's budget.
    """

    @classmethod
    def within(cls, budget: int, block_size: int, slack: float) -> "ClusterGenState":
        """A state that never stores more than `budget` slots per head: the room `budget.stream_split` leaves beside
        the target holds the run in progress (runs of min(block_size, room) tokens: a run longer than the room is
        shortened to it) and the waiting runs (the rest of the room). The traversed runs keep `target` slots."""
        target, room = stream_split(budget, slack)
        run = min(block_size, room)
        state = cls(target, run, 0.0)
        state.slack_slots = room - run
        return state


    def __init__(self, budget: int, block_size: int, slack: float):
        self.budget, self.block_size = budget, block_size
        self.slack_slots = math.ceil(check_slack(slack) * budget)
        self.runs: list[Tokens] = []  # per traversed run: its traversal head, in selection order
        self.waiting: list[Tokens] = []  # completed runs not traversed yet, exact
        self.ends: list[int] = []  # tokens seen up to the end of each completed run
        self.pending: Tokens | None = None
        self.seen = 0

    saved_fields = {
        "budget": Count(1), "block_size": Count(1), "slack_slots": Count(), "runs": Sequence(Instance("tokens")),
        "waiting": Sequence(Instance("tokens")), "ends": Sequence(Count(1)), "pending": Maybe(Instance("tokens")), "seen": Count(),
    }

    def check_saved(self) -> None:
        if len(self.ends) != len(self.runs) + len(self.waiting) or self.ends != sorted(self.ends) or any(e > self.seen for e in self.ends):
            raise ValueError(f"run ends {self.ends} do not fit {len(self.runs)} traversed and {len(self.waiting)} waiting runs of "
                             f"{self.seen} tokens")
        if self.pending is not None and self.pending.length >= self.block_size:
            raise ValueError(f"the run in progress holds {self.pending.length} tokens, a whole run of {self.block_size}")

    def absorb(self, tokens: Tokens) -> None:
        start = 0
        while start < tokens.length:
            have = self.pending.length if self.pending is not None else 0
            stop = min(tokens.length, start + self.block_size - have)
            part = tokens.slice(start, stop).stored()
            self.pending = part if self.pending is None else cat_tokens([self.pending, part])
            self.seen += part.length
            start = stop
            if self.pending.length == self.block_size:
                self.ends.append(self.seen)
                self.waiting.append(self.pending)
                self.pending = None
                if sum(r.length for r in self.waiting) > self.slack_slots:
                    self.compact()

    def compact(self) -> None:
        """Traverse the waiting runs and trim every run to its quota (at most `budget` slots then)."""
        quotas = run_quotas(self.ends, self.budget, self.seen)
        if self.waiting:
            self.runs += _traversals(self.waiting, [min(self.block_size, q) for q in quotas[len(self.runs) :]])
            self.waiting = []
        if sum(r.length for r in self.runs) > self.budget:
            self.runs = [r if r.length <= q else _head(r, q) for r, q in zip(self.runs, quotas)]

    def summary(self) -> KVSummary | None:
        if self.seen == 0:
            return None
        ends = self.ends + ([self.seen] if self.pending is not None else [])
        quotas = run_quotas(ends, self.budget, self.seen)
        parts = [r.slice(0, min(r.length, q)) for r, q in zip(self.runs, quotas)]
        unfinished = self.waiting + ([self.pending] if self.pending is not None else [])
        if unfinished:
            parts += _traversals(unfinished, [min(r.length, q) for r, q in zip(unfinished, quotas[len(self.runs) :])])
        parts = [p for p in parts if p.length]
        if not parts:  # every run with a quota lost its slot to an earlier trim (the rounding case above)
            return None
        kept = cat_tokens(parts)
        order = kept.positions.argsort(dim=-1)
        keys, values, positions = gather_slots(kept.keys, kept.values, kept.positions, order)
        return KVSummary(keys, values, torch.zeros(positions.shape, device=keys.device, dtype=torch.float32), positions)

    def kv_tensors(self) -> list[torch.Tensor]:
        parts = [*self.runs, *self.waiting, *([self.pending] if self.pending is not None else [])]
        return [t for p in parts for t in (p.keys, p.values)]

    def set_kv_tensors(self, tensors: list[torch.Tensor]) -> None:
        given = iter(tensors)
        self.runs = [replace(r, keys=next(given), values=next(given)) for r in self.runs]
        self.waiting = [replace(r, keys=next(given), values=next(given)) for r in self.waiting]
        if self.pending is not None:
            self.pending = replace(self.pending, keys=next(given), values=next(given))

    def nbytes(self) -> int:
        """KV bytes of the runs, the waiting runs and the run in progress (positions are bookkeeping, counted apart)."""
        return sum(t.numel() * t.element_size() for t in self.kv_tensors())


def _head(run: Tokens, count: int) -> Tokens:
    """The first `count` slots of a run as their own tensors (the trimmed tail's memory is freed)."""
    return Tokens(run.keys[:, :, :count].clone(), run.values[:, :, :count].clone(), run.positions[:, :, :count].clone(), scale=run.scale)


def _traversals(runs: list[Tokens], steps: list[int]) -> list[Tokens]:
    """The first `steps[i]` points of each head's farthest-first traversal of run i, in selection order,
    every run of the same length traversed in one batched call (runs [B,H,c,d], steps[i] <= c)."""
    out: list[Tokens | None] = [None] * len(runs)
    by_length: dict[int, list[int]] = {}
    for i, run in enumerate(runs):
        by_length.setdefault(run.length, []).append(i)
    for members in by_length.values():
        b, h, n, d = runs[members[0]].keys.shape
        most = max(steps[i] for i in members)
        if most:
            keys = torch.cat([runs[i].keys for i in members]).reshape(len(members) * b * h, n, d)
            index = farthest_point(keys, most)[0].reshape(len(members), b, h, most)
        for j, i in enumerate(members):
            run = runs[i]
            kept = gather_slots(run.keys, run.values, run.positions, index[j, :, :, : steps[i]]) if steps[i] else None
            out[i] = Tokens(*kept, scale=run.scale) if kept else run.slice(0, 0)
    return out
