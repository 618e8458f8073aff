"""Thinformer Express: kernel halving, Compress2 and the Express weighted cache.

Gong et al., "Express Language Modeling", arXiv:2606.10944 (Express, Alg. 1; Compress2, Alg. 2;
Subsample, Alg. 3; Thinformer Express, Alg. 4; Offline-Express, App. H), with kernel halving from
Carrell et al., "Low-Rank Thinning", ICML 2025 (Alg. B.1). The extracted text of the Express
paper lost its formulas; docs/design.md, "Express, restated" restates the structure. Constants
the surviving text does not fix are chosen here, each with its reason:

- Bounded Halve calls (`max_group`, default 128): a Halve input larger than max_group slots (the
  Halve phase's 4m and 2m, Compress2's top levels, the top-up) is halved as consecutive chunks of
  max_group slots. Departure from the paper, whose two warm-start Halves act on all of 4m: kernel
  halving costs O(S²) for S points and its walk is sequential, so one Halve of 4m = O(budget)
  points would make compression cost O(n²) in the stream length. Chunked, every token costs
  O(max_group) per level and the walk is a loop of at most max_group / 2 steps, vectorised over
  all chunks, heads and batch. The default is the smaller of the group sizes whose attention
  error on real layers was the same within the spread over random seeds.
- Kernel (docs/design.md, "Express, restated"):
  k((k,v),(k',v')) = exp(s<k,k'> − shift)·(<v,v'> + b²). shift and b are computed **per Halve
  call** (per batch, head and group, over that call's input). Kernel halving is invariant to
  scaling the kernel, so shift only prevents overflow (shift = max s‖k‖² bounds every entry by
  1); b = max|v_ij| of the call's input, the tightest value bound available to a stream without
  looking back at evicted tokens. Inner products are float32 matmuls; the kernel
  matrix is formed from them in float64 so the small entries of low-norm keys do not underflow.
- Halve's walk (`halving`): the signed sum ψ = Σ_{j<i} ε_j f_j of pair differences
  f_j = k(x_{2j},·) − k(x_{2j+1},·) is checked through α_i = <ψ, f_i> = Σ_j ε_j Kdiff_ji, and
  member 1 of pair i is kept (ε_i = +1) with probability ½(1 − α_i/a_i), clipped (Dwivedi &
  Mackey's self-balancing walk); the first pair is fixed (member 1 kept) and the whole result is
  swapped for its complement with probability ½, independently per (batch, head, group).
  Default "greedy": a_i → 0, i.e. ε_i = −sign(α_i) (ties keep member 1), the symmetrised greedy
  walk. Reason: with the randomised threshold a_i = (½ + log(2S/δ))·√Kdiff_ii·max_{j≤i}√Kdiff_jj
  (docs/design.md, "Express, restated"), the exp kernel's dynamic range on real keys makes
  max_j √Kdiff_jj (set by a few large-norm keys) dwarf every α_i, so every later pair is a fair
  coin flip and the walk is hardly better than a uniform half; the greedy walk does act on α_i.
  "self-balancing" keeps the randomised walk, multiplier ½ + log(2S/δ) with S the call's input
  size and δ = `delta` (default 0.5, the failure probability Carrell et al.'s code uses).
- Exact phase: the first m tokens fill the cache C exactly; the three following thin phases run
  with thinning factor ℓ = 1 (blocks of m tokens kept as they are), so the first 4m tokens are
  held exactly, then the first Halve phase brings them to m slots of weight 4 and ℓ = 4.
  Afterwards ℓ grows ×4 per Halve phase (base-4 counting: C plus three siblings of m slots of
  weight ℓ are 4m slots, two Halves give m slots of weight 4ℓ).
- Compress2 on a block of ℓ·m tokens (Compress structure of Shetty et al.): leaves of L samples
  are kept as they are, four outputs of one level are concatenated and halved into one output of
  the next level, so level j outputs hold L·2^j slots and depth D = log2(ℓ) levels give exactly
  m = L·2^D slots. The oversampling parameter g sets the smallest leaf, L ≥ 4^g (the first Halve
  acts on ≥ 4^(g+1) points, as in KT-Compress); D is capped by D_max, the largest D with
  2^D | m and m/2^D ≥ 4^g. Once log2(ℓ) > D_max (the threshold set by the inflation factor),
  stratified Subsample keeps one uniformly chosen token per stratum of ℓ/2^D_max consecutive
  tokens; before that nothing is filtered.
- Streaming Subsample keeps a reservoir candidate for the stratum in progress (uniform over the
  stratum's tokens seen so far, weight = their count), so the weights always add up to the tokens
  seen and the candidate is an exact uniform draw when the stratum completes.
- m from `budget`: the state between updates is C (m) + two finished siblings (2m) + the block in
  progress (at most three outputs per level, the open leaf and the candidate), at most
  6m − 2·L_min slots with L_min = m/2^D_max. A stream uses the largest m whose bound fits
  `budget` (budget >= 4). A one-shot `compress` (n known, `offline_plan`) is the Express state
  at a point of the stream: a cache of size m absorbs the first n − held tokens and the last
  `held` are the input not yet absorbed, which WtdAttention attends to exactly. Only sizes that
  reach a Halve phase (4m <= n − held) qualify, so every ratio gives a thinned, multi-level
  cache: a state alone holds at most about 3n/8 slots, and below that ratio `held` fills the
  rest. Among the sizes, held is the smallest count reaching `budget`, and the plan with the
  fewest slots over budget wins (ties: the larger m); the excess is removed by
  halving a subset of the state (`fill_budget`, the "halve a chosen subset, keep the rest"
  top-up of App. B.5 of "BalanceKV: KV Cache Compression through Discrepancy Theory",
  arXiv:2502.07861): one-shot Express returns exactly min(budget, n) slots per head
  for any budget >= 1, never a silently smaller cache. m is restricted to numbers with at most
  three significant bits (c·2^k, c ≤ 7), so Compress2 keeps several halving levels.

All slots keep chronological order, so positions are ascending within each head.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from ..saved_state import Count, Generator, Instance, Maybe, Real, Saveable, Sequence, saved
from ..summary import KVSummary, concat, gather_slots, take_slots
from .base import Method, StreamState
from .registry import register
from .tokens import Tokens

_LOG2 = math.log(2.0)
# Row bands of the halving kernel, each formed against itself and the later bands only: up to 4,
# of at least 16 pairs, once a call's kernels hold 2^16 entries in all (below that, the extra
# tensor ops of banding cost more than the kernel entries it skips).
_BANDS = 4
_BAND_PAIRS = 16
_BANDED_ENTRIES = 1 << 16


def kernel_halving(
    keys: torch.Tensor, values: torch.Tensor, scale: float, generator: torch.Generator, delta: float | None = None
) -> torch.Tensor:
    """Kernel halving of each group of key–value pairs under the attention kernel; returns kept indices.

    keys [..., S, d], values [..., S, d_v] with S even; leading dims (batch, head, group) are
    halved independently in one batched program. Returns index [..., S/2] (ascending): one
    member of each consecutive pair (2i, 2i+1). delta=None: greedy self-balancing walk (each
    pair's sign opposes the running signed sum); a float: the randomised walk with threshold
    multiplier ½ + log(2S/δ). Either way the result is swapped for its complement with probability ½.
    """
    size = keys.shape[-2]
    if size % 2:
        raise ValueError(f"kernel halving needs an even number of points per group, got {size}")
    k = keys.float()
    v = values.float()
    pairs = size // 2
    # The walk reads Kdiff_ji only for j < i: each band of pairs is formed against itself and the
    # later bands only, (1 + 1/bands)/2 of the kernel.
    batch = keys[..., 0, 0].numel()
    bands = max(1, min(_BANDS, pairs // _BAND_PAIRS)) if batch * size * size >= _BANDED_ENTRIES else 1
    edges = sorted({pairs * j // bands for j in range(bands + 1)})
    spans = list(zip(edges[:-1], edges[1:]))
    logits = [(k[..., 2 * lo : 2 * hi, :] @ k[..., 2 * lo :, :].transpose(-1, -2)).mul_(scale) for lo, hi in spans]
    value_products = [v[..., 2 * lo : 2 * hi, :] @ v[..., 2 * lo :, :].transpose(-1, -2) for lo, hi in spans]
    self_logits = torch.cat([lg[..., : lg.shape[-2]].diagonal(dim1=-2, dim2=-1) for lg in logits], -1)
    shift = self_logits.amax(-1, keepdim=True).unsqueeze(-1)
    b2 = torch.maximum(v.amax(dim=(-2, -1), keepdim=True), v.amin(dim=(-2, -1), keepdim=True).neg_()).square_()  # max|v_ij|², no |v| copy
    # formed in place: float32 logits shifted, then exp and the product with the value term in float64
    kdiffs = [_pair_differences(lg.sub_(shift).double().exp_().mul_(vp.add_(b2))) for lg, vp in zip(logits, value_products)]
    signs = torch.ones((*kdiffs[0].shape[:-2], pairs), dtype=torch.float64, device=k.device)  # written in place, one pair per step
    sign_columns = signs.unsqueeze(-1).unbind(-2)
    # greedy (delta None, every threshold 0): the walk tracks minus the signed sum (0 − x turns a zero
    # of either sign into +0), so a step's sign is one copysign: −1 exactly where the sum is positive
    greedy = delta is None
    walked = 0.0 - kdiffs[0][..., 0, :] if greedy else kdiffs[0][..., 0, :].clone()
    rows = [(walked[..., lo:], row) for (lo, _), kd in zip(spans, kdiffs) for row in kd.unbind(-2)]
    columns = walked.unsqueeze(-1).unbind(-2)
    if greedy:
        one = signs.new_tensor(1.0)
        for i in range(1, pairs):
            torch.copysign(one, columns[i], out=sign_columns[i])
            target, row = rows[i]
            target.addcmul_(sign_columns[i], row, value=-1.0)
    else:
        diagonal = torch.cat([kd[..., : kd.shape[-2]].diagonal(dim1=-2, dim2=-1) for kd in kdiffs], -1)
        root = diagonal.clamp_min(0.0).sqrt()
        multiplier = 0.5 + math.log(2.0 * size / delta)
        uniforms = torch.rand(diagonal.shape, generator=generator, device=generator.device, dtype=torch.float64)
        thresholds = (2.0 * uniforms.to(k.device) - 1.0) * multiplier * root * root.cummax(dim=-1).values
        limits, minus, plus = thresholds.unsqueeze(-1).unbind(-2), signs.new_tensor(-1.0), signs.new_tensor(1.0)
        for i in range(1, pairs):
            torch.where(columns[i] > limits[i], minus, plus, out=sign_columns[i])
            target, row = rows[i]
            target.addcmul_(sign_columns[i], row)
    complement = torch.rand(kdiffs[0].shape[:-2], generator=generator, device=generator.device, dtype=torch.float32) < 0.5
    swap = (signs < 0) ^ complement.to(k.device).unsqueeze(-1)
    return 2 * torch.arange(pairs, device=k.device) + swap.long()


def _pair_differences(kernel: torch.Tensor) -> torch.Tensor:
    """[..., R/2, C/2]: k(x_2j, x_2i) − k(x_2j, x_2i+1) − k(x_2j+1, x_2i) + k(x_2j+1, x_2i+1) of a kernel block [..., R, C]."""
    pair_columns = kernel[..., ::2] - kernel[..., 1::2]
    return pair_columns[..., ::2, :] - pair_columns[..., 1::2, :]


def halve_groups(slots: KVSummary, group: int, scale: float, generator: torch.Generator, delta: float | None) -> KVSummary:
    """Split the slots into consecutive groups of `group` and kernel-halve every group in parallel.

    Slots of one group must carry equal weight; the kept half gets log-weight + log 2.
    """
    b, h, n, d = slots.keys.shape
    groups = n // group
    keys = slots.keys.unflatten(2, (groups, group))
    values = slots.values.unflatten(2, (groups, group))
    within = kernel_halving(keys, values, scale, generator, delta)
    index = (within + group * torch.arange(groups, device=within.device).unsqueeze(-1)).flatten(2)
    kept_k, kept_v, kept_p = gather_slots(slots.keys, slots.values, slots.positions, index)
    return KVSummary(kept_k, kept_v, take_slots(slots.log_weights, index) + _LOG2, kept_p)


def halve(slots: KVSummary, group: int, scale: float, generator: torch.Generator, delta: float | None, max_group: int) -> KVSummary:
    """Kernel-halve consecutive groups of `group` equal-weight slots, no Halve call seeing more than max_group slots.

    A group larger than max_group (the Halve phase's 4m and 2m, Compress2's top levels, the
    budget top-up) is halved as consecutive chunks of max_group slots, the last one smaller:
    cost O(n·max_group) instead of O(n²), and a walk of at most max_group / 2 steps.
    """
    if group <= max_group:
        return halve_groups(slots, group, scale, generator, delta)
    n = slots.num_slots
    whole = n // max_group * max_group
    parts = [halve_groups(_take(slots, 0, whole), max_group, scale, generator, delta)] if whole else []
    if whole < n:
        parts.append(halve_groups(_take(slots, whole, n), n - whole, scale, generator, delta))
    return concat(parts)


def max_depth(m: int, g: int) -> int:
    """D_max: the most Compress2 levels for cache size m, i.e. the largest D with 2^D | m and m / 2^D >= 4^g."""
    depth = 0
    while m % (2 ** (depth + 1)) == 0 and m // 2 ** (depth + 1) >= 4**g:
        depth += 1
    return depth


def block_plan(ell: int, m: int, g: int) -> tuple[int, int, int]:
    """(stratum, leaf, depth) for a block of ell·m tokens: Subsample strata, Compress2 leaf size and levels."""
    depth = min(ell.bit_length() - 1, max_depth(m, g))
    return ell >> depth, m >> depth, depth


def cache_slots(n: int, m: int, g: int) -> int:
    """Slots per head the Express state holds after absorbing n tokens (closed form of the base-4 count)."""
    if n <= m:
        return n
    r = 0
    while 4 ** (r + 1) * m <= n:
        r += 1
    ell = 4**r
    siblings, t = divmod(n - ell * m, ell * m)
    stratum, leaf, depth = block_plan(ell, m, g)
    samples, partial = divmod(t, stratum)
    leaves, open_leaf = divmod(samples, leaf)
    levels = sum(((leaves // 4**j) % 4) * (leaf << j) for j in range(depth))
    return m * (1 + siblings) + levels + open_leaf + int(partial > 0)


def stream_bound(m: int, g: int) -> int:
    """Most slots per head the Express state holds between updates, for any stream length: 6m − 2·L_min."""
    return 6 * m - 2 * (m >> max_depth(m, g))


def _sizes_desc(limit: int):
    """Cache sizes m <= limit with at most three significant bits, largest first."""
    sizes = {c << k for c in range(1, 8) for k in range(limit.bit_length()) if c << k <= limit}
    return sorted(sizes, reverse=True)


@functools.lru_cache(maxsize=256)
def offline_plan(n: int, budget: int, g: int) -> tuple[int, int] | None:
    """(m, held) for one-shot Express on n tokens: a cache of size m absorbs the first n − held, the last `held` stay exact.

    Only sizes that reach a Halve phase (4m <= n − held) are considered. For each, held is the
    smallest count with cache_slots(n − held, m) + held >= budget; that sum never decreases as
    held grows (absorbing a token adds at most one slot), so a binary search finds it. The plan
    with the fewest slots over `budget` wins (ties: the larger m). None when no size reaches a
    Halve phase with `budget` slots (budget > n − 3). Cached: every layer of a prefill asks for the
    same plan, so the search runs once per (n, budget, g).
    """
    best = None
    for m in _sizes_desc(n // 4):
        lo, hi = 0, n - 4 * m
        if cache_slots(n - hi, m, g) + hi < budget:
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            if cache_slots(n - mid, m, g) + mid >= budget:
                hi = mid
            else:
                lo = mid + 1
        key = (cache_slots(n - lo, m, g) + lo - budget, -m)
        if best is None or key < best[0]:
            best = (key, m, lo)
    return None if best is None else (best[1], best[2])


@saved("express_state")
class ExpressState(StreamState):
    """The Express weighted cache of target size m ("Express Language Modeling", Alg. 1) over the compressible middle.

    Holds C (m slots of weight ℓ, or the exact phase), the finished sibling blocks, and the block
    in progress as Compress2 levels, an open leaf and a Subsample candidate. `summary()` is all of
    them: WtdAttention attends exactly to the not-yet-thinned samples of the block in progress.
    """

    def __init__(self, m: int, g: int, delta: float | None, generator: torch.Generator, max_group: int):
        self.m, self.g, self.delta, self.generator, self.max_group = m, g, delta, generator, max_group
        self.scale = 1.0
        self.ell = 1
        self.cache: KVSummary | None = None
        self.siblings: list[KVSummary] = []
        self._start_block()

    saved_fields = {
        "m": Count(1), "g": Count(), "delta": Maybe(Real(0.0)), "generator": Generator(), "max_group": Count(1), "scale": Real(0.0),
        "ell": Count(1), "cache": Maybe(Instance("kv_summary")), "siblings": Sequence(Instance("kv_summary")), "block_seen": Count(),
        "stratum": Count(), "leaf": Count(), "depth": Count(), "levels": Sequence(Instance("express_buffer")),
        "open_leaf": Instance("express_buffer"), "candidate": Maybe(Instance("kv_summary")), "count": Count(),
    }

    def check_saved(self) -> None:
        if self.ell & (self.ell - 1) or self.ell > 1 and (self.cache is None or self.cache.num_slots != self.m):
            raise ValueError(f"thinning factor {self.ell} (a power of 2) with a cache of {self.cache and self.cache.num_slots} slots, "
                             f"size {self.m}")
        if self.cache is not None and self.cache.num_slots > self.m:
            raise ValueError(f"the cache holds {self.cache.num_slots} slots, more than its size {self.m}")
        plan = block_plan(self.ell, self.m, self.g)
        if (self.stratum, self.leaf, self.depth) != plan or len(self.levels) != self.depth or len(self.siblings) > 3:
            raise ValueError(f"block plan (stratum, leaf, depth) {(self.stratum, self.leaf, self.depth)} with {len(self.levels)} levels "
                             f"and {len(self.siblings)} siblings, expected {plan} for thinning factor {self.ell}")
        if self.block_seen >= self.ell * self.m:
            raise ValueError(f"{self.block_seen} tokens of a block of {self.ell * self.m}")
        if self.count >= max(self.stratum, 1) or (self.candidate is None) != (self.count == 0):
            raise ValueError(f"{self.count} tokens of the stratum in progress (of {self.stratum}) with "
                             f"{'no' if self.candidate is None else 'a'} candidate")

    def _start_block(self) -> None:
        self.block_seen = 0
        self.stratum, self.leaf, self.depth = block_plan(self.ell, self.m, self.g)
        self.levels = [_Buffer() for _ in range(self.depth)]
        self.open_leaf = _Buffer()
        self.candidate: KVSummary | None = None
        self.count = 0

    def absorb(self, tokens: Tokens) -> None:
        self.scale = tokens.scale
        start, n = 0, tokens.length
        while start < n:
            have = self.cache.num_slots if self.cache is not None else 0
            if self.ell == 1 and have < self.m:
                stop = min(n, start + self.m - have)
                self.cache = _join(self.cache, tokens.slice(start, stop).exact())
            else:
                size = self.ell * self.m
                # whole blocks of this phase (at most the three before a Halve phase) go through Compress2 together
                blocks = 1 if self.block_seen else max(1, min((n - start) // size, 3 - len(self.siblings)))
                stop = min(n, start + blocks * size - self.block_seen)
                self._thin(tokens.slice(start, stop), blocks)
            start = stop

    def _thin(self, part: Tokens, blocks: int = 1) -> None:
        """Subsample then Compress2 tokens of the block in progress, or of `blocks` > 1 whole blocks at
        once (each level's Halve calls batched across them); finish the block when it is full."""
        self.block_seen += part.length
        leaves = self.open_leaf.push(self._subsample(part), self.leaf)
        if leaves is not None:
            self._compress2(leaves, blocks)
        if self.block_seen == blocks * self.ell * self.m:
            self._finish_block()

    def _subsample(self, part: Tokens) -> KVSummary | None:
        """Stratified Subsample: one uniform token per stratum; the stratum in progress stays a reservoir candidate."""
        if self.stratum == 1:
            return part.exact()
        s, seen_before, t = self.stratum, self.count, part.length
        if t == 1 and seen_before + 1 < s:
            self._reservoir_step(part.exact())
            return None
        total = seen_before + t
        strata = -(-total // s)
        edges = torch.arange(strata + 1, device=part.keys.device) * s
        lo = (edges[:-1] - seen_before).clamp_min(0)
        hi = (edges[1:] - seen_before).clamp_max(t)
        b, h = part.keys.shape[:2]
        u = torch.rand(b, h, strata, generator=self.generator, device=self.generator.device, dtype=torch.float32).to(part.keys.device)
        index = (lo + (u * (hi - lo)).long()).clamp_max(hi - 1)
        keys, values, positions = gather_slots(part.keys, part.values, part.positions, index)
        picked = KVSummary(keys, values, torch.zeros(index.shape, device=keys.device, dtype=torch.float32), positions)
        if self.candidate is not None:
            first = min(total, s)
            draw = torch.rand(b, h, 1, generator=self.generator, device=self.generator.device, dtype=torch.float32)
            keep_old = draw < seen_before / first
            picked = _replace_first(picked, self.candidate, keep_old.to(part.keys.device))
        last_count = total - (strata - 1) * s
        picked.log_weights[:] = math.log(s)
        complete = strata if last_count == s else strata - 1
        self.count = 0 if last_count == s else last_count
        self.candidate = None
        if complete < strata:
            self.candidate = _take(picked, complete, strata).clone()  # a view would hold every stratum picked
            self.candidate.log_weights[:] = math.log(last_count)
        return _take(picked, 0, complete) if complete else None

    def _reservoir_step(self, token: KVSummary) -> None:
        """One token inside the stratum in progress (decode): it replaces the candidate with probability 1/count."""
        self.count += 1
        if self.candidate is not None:
            u = torch.rand(token.positions.shape, generator=self.generator, device=self.generator.device, dtype=torch.float32)
            new = (u.to(token.positions.device) * self.count < 1.0)
            c, mask = self.candidate, new.unsqueeze(-1)
            token = KVSummary(torch.where(mask, token.keys, c.keys), torch.where(mask, token.values, c.values),
                              c.log_weights, torch.where(new, token.positions, c.positions))
        self.candidate = replace(token, log_weights=torch.full_like(token.log_weights, math.log(self.count)), eviction_only=False)

    def _compress2(self, leaves: KVSummary, blocks: int = 1) -> None:
        """Push complete leaves into Compress2: every four outputs of a level are halved, all groups of a level at once.

        blocks > 1: the leaves of that many whole blocks, each block halved on its own as if it were a
        head of its own (so no Halve chunk spans two blocks), giving one sibling per block."""
        heads = leaves.positions.shape[1]
        carry = _regroup(leaves, heads * blocks)
        for j in range(self.depth):
            group = 4 * (self.leaf << j)
            full = self.levels[j].push(carry, group)
            if full is None:
                return
            carry = halve(full, group, self.scale, self.generator, self.delta, self.max_group)
        carry = _regroup(carry, heads)
        self.siblings += [_take(carry, i * self.m, (i + 1) * self.m) for i in range(blocks)]

    def _finish_block(self) -> None:
        """A block is m slots of weight ℓ; after three of them, two Halves bring C + siblings from 4m to m (ℓ ← 4ℓ)."""
        if len(self.siblings) == 3:
            merged = concat([self.cache, *self.siblings])
            for size in (4 * self.m, 2 * self.m):
                merged = halve(merged, size, self.scale, self.generator, self.delta, self.max_group)
            self.cache, self.siblings = merged, []
            self.ell *= 4
        self._start_block()

    def _parts(self) -> list[KVSummary | None]:
        """C, the siblings, the Compress2 levels' waiting parts (top level first), the open leaf's and the candidate."""
        parts = [self.cache, *self.siblings]
        for buffer in (*reversed(self.levels), self.open_leaf):
            parts += buffer.parts
        return [*parts, self.candidate]

    def _set_parts(self, parts: list[KVSummary | None]) -> None:
        """Put back the parts `_parts` listed, in its order."""
        parts = list(parts)
        self.cache = parts.pop(0)
        self.siblings = [parts.pop(0) for _ in self.siblings]
        for buffer in (*reversed(self.levels), self.open_leaf):
            buffer.parts = [parts.pop(0) for _ in buffer.parts]
        self.candidate = parts.pop(0)

    def kv_tensors(self) -> list[torch.Tensor]:
        return [t for p in self._parts() if p is not None for t in (p.keys, p.values)]

    def set_kv_tensors(self, tensors: list[torch.Tensor]) -> None:
        given = iter(tensors)
        self._set_parts([None if p is None else replace(p, keys=next(given), values=next(given)) for p in self._parts()])

    def summary(self) -> KVSummary | None:
        parts = [p for p in self._parts() if p is not None and p.num_slots > 0]
        return concat(parts) if parts else None


def fill_budget(
    summary: KVSummary, budget: int, scale: float, generator: torch.Generator, delta: float | None, max_group: int
) -> KVSummary:
    """Reduce an Express state to exactly `budget` slots per head by halving a subset (BalanceKV paper's App. B.5 trick).

    Slot weights are token counts and their layout is the same in every head. While there are
    more slots than `budget`: the weight class with the most slots (ties: the lighter) gives its
    2h oldest slots, h = min(excess, count // 2), to kernel halving in chunks of at most max_group
    slots (kept slots weigh double);
    all other slots stay as they are. Only when every class has a single slot are the last two
    slots merged into one, kept with probability proportional to its weight and carrying both
    weights (unbiased). The total weight is preserved; a reduced pair sits where its first slot
    was, so chronological order holds because each weight class of an Express state is a
    contiguous run of slots.
    """
    while summary.num_slots > budget:
        counts = summary.log_weights[0, 0].exp().round().long()
        classes, sizes = torch.unique(counts, return_counts=True)
        best = max(range(len(classes)), key=lambda i: (int(sizes[i]), -int(classes[i])))
        pool = torch.nonzero(counts == classes[best]).flatten()
        if len(pool) >= 2:
            chosen = pool[: 2 * min(summary.num_slots - budget, len(pool) // 2)]
            reduced = halve(_select(summary, chosen), len(chosen), scale, generator, delta, max_group)
        else:
            chosen = torch.arange(summary.num_slots - 2, summary.num_slots, device=counts.device)
            reduced = _merge_weighted_pair(_select(summary, chosen), generator)
        rest = torch.ones(summary.num_slots, dtype=torch.bool, device=chosen.device)
        rest[chosen] = False
        rest = torch.nonzero(rest).flatten()
        order = torch.cat([rest, chosen[0::2]]).argsort()
        summary = _select(concat([_select(summary, rest), reduced]), order)
    return summary


def _merge_weighted_pair(pair: KVSummary, generator: torch.Generator) -> KVSummary:
    """One slot per head out of two: slot j kept with probability w_j / (w_0 + w_1), weighing w_0 + w_1."""
    w = pair.log_weights.exp()
    u = torch.rand(w.shape[:2], generator=generator, device=generator.device, dtype=torch.float32).to(w.device)
    index = (u * w.sum(-1) >= w[..., 0]).long().unsqueeze(-1)
    keys, values, positions = gather_slots(pair.keys, pair.values, pair.positions, index)
    return KVSummary(keys, values, w.sum(-1, keepdim=True).log(), positions)


def _select(s: KVSummary, index: torch.Tensor) -> KVSummary:
    """The slots at `index` [k] (the same slots in every head)."""
    return KVSummary(s.keys[:, :, index], s.values[:, :, index], s.log_weights[:, :, index], s.positions[:, :, index])


@saved("express_buffer")
class _Buffer(Saveable):
    """Slots waiting for a full group, kept as a list of parts so that adding one copies only that part."""

    saved_fields = {"parts": Sequence(Instance("kv_summary")), "slots": Count()}

    def __init__(self):
        self.parts: list[KVSummary] = []
        self.slots = 0

    def check_saved(self) -> None:
        if self.slots != sum(part.num_slots for part in self.parts):
            raise ValueError(f"{self.slots} slots counted, the parts hold {sum(part.num_slots for part in self.parts)}")

    def push(self, part: KVSummary | None, group: int) -> KVSummary | None:
        """Add `part`; once whole groups are there, return them (a multiple of `group` slots) and keep the rest."""
        if part is not None and part.num_slots:
            self.parts.append(part.clone())  # a view would hold the whole tensor it came from while the part waits
            self.slots += part.num_slots
        if self.slots < group:
            return None
        buffer = concat(self.parts)
        full = self.slots // group * group
        rest = _take(buffer, full, self.slots).clone()
        self.parts = [rest] if rest.num_slots else []
        self.slots = rest.num_slots
        return _take(buffer, 0, full)


def _join(a: KVSummary | None, b: KVSummary | None) -> KVSummary | None:
    if a is None or a.num_slots == 0:
        return b
    if b is None or b.num_slots == 0:
        return a
    return concat([a, b])


def _regroup(s: KVSummary, heads: int) -> KVSummary:
    """[B,H,n,...] -> [B,heads,H·n/heads,...] with the slots in the same order: heads = H·k lays each run of
    n/k slots out as a head of its own, and heads = H undoes it."""
    b, h, n = s.positions.shape
    return KVSummary(*(t.reshape(b, heads, h * n // heads, *t.shape[3:]) for t in (s.keys, s.values, s.log_weights, s.positions)))


def _take(s: KVSummary, start: int, stop: int) -> KVSummary:
    return KVSummary(s.keys[:, :, start:stop], s.values[:, :, start:stop], s.log_weights[:, :, start:stop], s.positions[:, :, start:stop])


def _replace_first(picked: KVSummary, old: KVSummary, keep_old: torch.Tensor) -> KVSummary:
    """picked with its first slot replaced by `old` where keep_old [B,H,1] is set."""
    mask = keep_old.unsqueeze(-1)
    picked.keys[:, :, :1] = torch.where(mask, old.keys, picked.keys[:, :, :1])
    picked.values[:, :, :1] = torch.where(mask, old.values, picked.values[:, :, :1])
    picked.positions[:, :, :1] = torch.where(keep_old, old.positions, picked.positions[:, :, :1])
    return picked


@register
@dataclass
class Express(Method):
    """Thinformer Express ("Express Language Modeling", arXiv:2606.10944): a kernel-halving weighted cache of size O(m) for any stream length.

    Streaming is native (`new_stream`): m is the largest size whose worst-case state,
    6m − 2·L_min slots, fits `budget`, so a stream needs budget >= 4 (m = 1 holds C and up to
    three finished blocks); its state size then moves between m and the bound with the stream
    length (base-4 counting), and filling the rest would mean halving a different subset after
    every token. One-shot `compress` is Offline-Express (the paper's App. H): the first n − held tokens
    are absorbed in one call, so each block's Compress2 runs level by level with all Halve calls
    of a level batched, and the last `held` tokens stay exact as the stream's not-yet-absorbed
    input (`offline_plan` picks m and held; every ratio gives a cache that went through a Halve
    phase); `fill_budget` halves a subset down to exactly min(budget, n) slots (any budget >= 1).
    The paper's defaults: 32 sink + 32 window tokens exact.

    g: Compress2 oversampling (leaves of at least 4^g samples), an integer in [0, 8] (default 0).
    halving: "greedy" (default, the greedy self-balancing walk) or "self-balancing" (the randomised
    walk of Dwivedi & Mackey). delta: that walk's failure probability, a number in (0, 1] (default 0.5);
    read only with halving="self-balancing": with "greedy", which has none, a delta other than the
    default is refused. max_group: the most points one Halve call sees, an even integer >= 4 (default
    128; larger inputs are halved in consecutive chunks of this size).
    """

    name = "express"
    randomized = True
    stream_recompresses = False
    default_sink = 32
    default_window = 32
    g: int = 0
    halving: str = "greedy"
    delta: float = 0.5
    max_group: int = 128

    def __post_init__(self):
        if isinstance(self.g, bool) or not isinstance(self.g, int) or not 0 <= self.g <= 8:
            raise ValueError(f"g (Compress2 oversampling) must be an integer in [0, 8], got {self.g!r}")
        if self.halving not in ("greedy", "self-balancing"):
            raise ValueError(f"halving must be 'greedy' or 'self-balancing', got {self.halving!r}")
        if isinstance(self.delta, bool) or not isinstance(self.delta, (int, float)) or not 0.0 < self.delta <= 1.0:
            raise ValueError(f"delta (Halve failure probability) must be in (0, 1], got {self.delta!r}")
        if isinstance(self.max_group, bool) or not isinstance(self.max_group, int) or self.max_group < 4 or self.max_group % 2:
            raise ValueError(f"max_group (largest Halve input) must be an even integer >= 4, got {self.max_group!r}")
        if self.halving == "greedy" and self.delta != Express.__dataclass_fields__["delta"].default:
            raise ValueError(f"delta={self.delta!r} is the failure probability of halving='self-balancing'; halving='greedy' has "
                             "none: drop delta, or use halving='self-balancing'")

    @property
    def _delta(self) -> float | None:
        return None if self.halving == "greedy" else float(self.delta)

    def new_stream(self, budget: int, generator: torch.Generator, slack: float | None = None) -> ExpressState:
        """Native stream (at most `budget` slots, never re-compressed): a slack is refused (`stream_slack`)."""
        self.stream_slack(slack)
        if budget < stream_bound(1, 0):
            raise ValueError(
                f"streaming express needs budget >= 4 (its smallest cache, m = 1, holds C plus up to three "
                f"finished blocks: 4 slots), got {budget}; one-shot compress accepts any budget >= 1"
            )
        m = next(m for m in _sizes_desc(budget) if stream_bound(m, self.g) <= budget)
        return ExpressState(m, self.g, self._delta, generator, self.max_group)

    def compress(self, tokens: Tokens, budget: int, generator: torch.Generator) -> KVSummary:
        if budget < 1:
            raise ValueError(f"express needs budget >= 1, got {budget}")
        n = tokens.length
        plan = offline_plan(n, budget, self.g)
        if plan is None:
            held = tokens.exact()
        else:
            m, kept_exact = plan
            state = ExpressState(m, self.g, self._delta, generator, self.max_group)
            state.absorb(tokens.slice(0, n - kept_exact))
            held = concat([state.summary(), tokens.slice(n - kept_exact, n).exact()]) if kept_exact else state.summary()
        return fill_budget(held, budget, tokens.scale, generator, self._delta, self.max_group)
