"""BalanceKV: discrepancy-based selection of key-value pairs, with weighted attention.

Han, Kapralov, Kochetkova, Sheth, Zandieh, "BalanceKV: KV Cache Compression through Discrepancy
Theory" (seed 000; DESIGN.md §4).

- SoftmaxBalance (seed Alg. 2): a self-balancing walk signs the tokens of a block so that the
  signed sum of exp(s<k,·>)·v is small in every direction; one side is kept with doubled weight.
- One-shot (prefill, seed App. B): every block of `block_size` tokens of every head is balanced
  at once as one batched tensor program, rounds repeat until the budget is met.
- Streaming (decoding, seed Alg. 1 + Alg. 4): MergeAndReduce binary counters, one per value-norm
  bucket for the numerator and one on keys only for the normaliser.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..summary import KVSummary, Normalizer
from .base import Method, StreamState, Tokens, register

LOG2 = math.log(2.0)
KERNELS = ("value", "key", "joint")
# The walk's gain is capped at e^80 so x·gain stays finite in float32 (|x| <= b); this only
# changes p for imbalances below e^-80·R², which the walk could not resolve anyway.
_MAX_LOG_GAIN = 80.0
# Kernel entries materialised at once (float32): blocks are balanced in chunks below this.
_MAX_KERNEL = 1 << 24


def balance_kernel(
    keys: torch.Tensor, values: torch.Tensor | None, valid: torch.Tensor, scale: float, kernel: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """SoftmaxBalance kernel of each block, divided by the seed's R² so every entry lies in [-1, 1].

    keys [N, b, d], values [N, b, d_v] (ignored for kernel="key"), valid [N, b] bool (False = padding).
    Keys are centred by the mean of the block's valid keys (attention is invariant to that shift;
    seed App. B.5). K_ij = exp(s<k̄_i,k̄_j>)·κ(v_i,v_j) with κ = <v_i,v_j> ("value", seed Alg. 2),
    κ = 1 ("key": v ≡ 1, the normaliser's walk) or κ = (<v_i,v_j>/r_v² + 1)/2 ("joint": the walk on
    [v/r_v, 1], balancing numerator and denominator together). R² = exp(s·r_key²)·r_value² with the
    block's largest centred key norm and value norm (seed Alg. 2 line 2), applied in log space.
    Returns (K / R² [N, b, b] float32 with zero rows and columns for padding, log R² [N]).
    """
    mask = valid.unsqueeze(-1).float()
    keys = keys.float() * mask
    mean = keys.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp_min(1.0)
    centred = (keys - mean) * mask
    gram = torch.bmm(centred, centred.transpose(1, 2)) * scale
    r_key = gram.diagonal(dim1=1, dim2=2).amax(-1)
    out = torch.exp(gram - r_key[:, None, None])
    log_r2 = r_key
    if kernel != "key":
        v = values.float() * mask
        vgram = torch.bmm(v, v.transpose(1, 2))
        r_value = vgram.diagonal(dim1=1, dim2=2).amax(-1).clamp_min(torch.finfo(torch.float32).tiny)
        vgram = vgram / r_value[:, None, None]
        out = out * (vgram if kernel == "value" else (vgram + 1.0) / 2.0)
        log_r2 = log_r2 + r_value.log()
    return out * (mask * mask.transpose(1, 2)), log_r2


def balancing_walk(kernel: torch.Tensor, valid: torch.Tensor, log_gain: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Signs of the self-balancing walk (seed Alg. 2) on each block, exactly half of each block per side.

    kernel [N, b, b] normalised (R² = 1), valid [N, b] with an even number of valid tokens per block
    and padding only after them (padding never affects a valid token), log_gain [N] = log(1 / (2c))
    in these units. Token j goes to +1
    with probability p_j = ½ − x_j·gain, x_j = Σ_{i<j} η_i K_ij: the seed's ½ − yᵀη/(2cR²). The
    seed FAILs when |yᵀη| > cR², i.e. p_j outside [0, 1]; here p_j is clipped (the walk then takes
    the sign that reduces the imbalance) and the event is counted. Balancing rule: once one side
    holds half of the block's valid tokens, the remaining valid tokens join the other side.
    Returns (signs [N, b] in {-1, 0, +1}, 0 for padding; number of FAIL events).
    """
    n_blocks, b, _ = kernel.shape
    half = valid.sum(-1) // 2
    gain = torch.exp(log_gain.clamp_max(_MAX_LOG_GAIN)).to(kernel.device)
    uniform = torch.rand(n_blocks, b, generator=generator, device=generator.device).to(kernel.device)
    signs = torch.zeros(n_blocks, b, device=kernel.device)
    pushes = torch.zeros(n_blocks, b, device=kernel.device)
    drift = torch.zeros(n_blocks, b, device=kernel.device)
    plus = torch.zeros(n_blocks, dtype=torch.long, device=kernel.device)
    for j in range(b):
        push = drift[:, j] * gain
        eta = torch.where(uniform[:, j] < 0.5 - push, 1.0, -1.0)
        eta = torch.where(plus >= half, -1.0, torch.where(j - plus >= half, 1.0, eta))
        plus += eta > 0
        drift.addcmul_(eta[:, None], kernel[:, j])
        signs[:, j] = eta
        pushes[:, j] = push
    fails = ((pushes.abs() > 0.5) & valid).sum()
    return signs * valid, int(fails)


def halve(
    keys: torch.Tensor,
    values: torch.Tensor | None,
    scale: float,
    method: "BalanceKV",
    kernel: str,
    generator: torch.Generator,
) -> tuple[torch.Tensor, int]:
    """SoftmaxBalance on consecutive blocks of every row: index [R, m/2] of the kept tokens (ascending).

    keys [R, m, d], values [R, m, d_v] or None, m even. Rows and blocks are balanced together as
    one batched program; the last block of a row is zero-padded (seed App. B), and a row shorter
    than a block is one block of its own length. In each block the
    side kept is +1 or -1 with probability ½ each, so every token is kept with probability ½.
    `method` supplies block_size and the walk's gain. Returns (index, number of FAIL events).
    """
    rows, m, d = keys.shape
    block_size = min(method.block_size, m)
    n_blocks = -(-m // block_size)
    pad = n_blocks * block_size - m
    valid = (torch.arange(n_blocks * block_size, device=keys.device) < m).expand(rows, -1).reshape(-1, block_size)
    k = torch.nn.functional.pad(keys, (0, 0, 0, pad)).reshape(-1, block_size, d)
    v = None if values is None else torch.nn.functional.pad(values, (0, 0, 0, pad)).reshape(-1, block_size, values.shape[-1])
    chunk = max(1, _MAX_KERNEL // (block_size * block_size))
    keep, fails = [], 0
    for start in range(0, k.shape[0], chunk):
        stop = start + chunk
        blocks_valid = valid[start:stop]
        kern, log_r2 = balance_kernel(k[start:stop], None if v is None else v[start:stop], blocks_valid, scale, kernel)
        signs, failed = balancing_walk(kern, blocks_valid, method.log_gain(log_r2), generator)
        side = torch.where(torch.rand(signs.shape[0], generator=generator, device=generator.device) < 0.5, 1.0, -1.0)
        keep.append(signs == side.to(signs.device)[:, None])
        fails += failed
    keep = torch.cat(keep).reshape(rows, -1)[:, :m]
    return first_true(keep, m // 2), fails


def first_true(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Indices [..., count] of the first `count` True entries of mask [..., n] (ascending)."""
    return torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[..., :count]


def _gather(index: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Gather [B,H,n] or [B,H,n,d] tensors along the token axis with index [B,H,k]."""
    out = []
    for t in tensors:
        idx = index if t.ndim == 3 else index.unsqueeze(-1).expand(*index.shape, t.shape[-1])
        out.append(t.gather(2, idx))
    return out


@register
@dataclass
class BalanceKV(Method):
    """BalanceKV (seed 000). Defaults follow the seed: b = 256, sinks 256 + window 256 exact (App. B.1).

    block_size: b, tokens per SoftmaxBalance block (one-shot blocks, and blocks inside each stream halving);
    even. step: the walk's probability rule p = ½ − yᵀη/(2cR²) with cR² = 1/(2·step) (the form
    and default 4.0 of the authors' implementation); step=None uses the theoretical c = 30·log(b/δ)
    of seed Alg. 2 with delta the failure probability. On real keys exp(s<k̄_i,k̄_j>) is tiny next
    to R² = exp(s·r²), so the theoretical c leaves p ≈ ½ (the walk is then uniform sampling, one
    half per block); with step = 4 the walk mostly clips p (counted as FAIL events), i.e. it takes
    the sign that reduces the imbalance.
    weighted: kept slots carry log-weight (number of halvings)·log 2 (True), or plain eviction
    (False; the seed's App. B does not say which). kernel: "value" (seed Alg. 2 kernel), "key"
    (v ≡ 1) or "joint" (see `balance_kernel`); one-shot only, the stream uses "value" per bucket and
    "key" for its normaliser as in seed Alg. 1. augment: fraction of the budget kept exactly for the
    keys most anti-correlated with the rest (seed Sec. 4.3), 0 turns it off. levels: T of
    MergeAndReduce (stream only), None lets the counter grow as deep as the stream (the seed's
    T = log(n/t)). batch: t, the tokens per MergeAndReduce halving (stream only; None means
    block_size); a batch larger than block_size is balanced as parallel blocks, which cuts the
    walk's sequential steps per token by batch/block_size.

    One-shot: rounds halve the middle until the budget is met. A round halves as many tokens of
    the current (heaviest) level as are needed; when fewer than all, the halved subset is drawn
    uniformly and the rest is kept exactly (seed App. B.5); an odd token out stays at its weight.
    Every halving keeps exactly half of a block with doubled weight, so weights sum to n.
    `failures` holds the FAIL count of the last call (see `balancing_walk`).
    """

    name = "balancekv"
    randomized = True
    default_sink = 256
    default_window = 256

    block_size: int = 256
    delta: float = 0.01
    step: float | None = 4.0
    weighted: bool = True
    kernel: str = "value"
    augment: float = 0.0
    levels: int | None = 2
    batch: int | None = None

    def __post_init__(self):
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 2 or self.block_size % 2:
            raise ValueError(f"block_size must be an even integer >= 2, got {self.block_size!r}")
        if not (0.0 < self.delta < 1.0):
            raise ValueError(f"delta must be in (0, 1), got {self.delta!r}")
        if self.step is not None and not (isinstance(self.step, (int, float)) and 0.0 < self.step < math.inf):
            raise ValueError(f"step must be None or a positive finite number, got {self.step!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if not (0.0 <= self.augment < 1.0):
            raise ValueError(f"augment must be in [0, 1), got {self.augment!r}")
        if self.levels is not None and (isinstance(self.levels, bool) or not isinstance(self.levels, int) or self.levels < 1):
            raise ValueError(f"levels must be None or an integer >= 1, got {self.levels!r}")
        if self.batch is not None and (isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 2 or self.batch % 2):
            raise ValueError(f"batch must be None or an even integer >= 2, got {self.batch!r}")
        self.failures = 0

    @property
    def stream_batch(self) -> int:
        """t of MergeAndReduce: tokens per halving call (block_size when `batch` is None)."""
        return self.block_size if self.batch is None else self.batch

    def log_gain(self, log_r2: torch.Tensor) -> torch.Tensor:
        """log(1 / (2c)) of the walk in units of R² (see `balancing_walk`), per block from log R² [N].

        step None: c = 30·log(b/δ), the constant of seed Alg. 2. step γ: cR² = 1/(2γ) in the
        kernel's own units, the form p = ½ − γ·yᵀη of the authors' implementation.
        """
        if self.step is None:
            return torch.full_like(log_r2, -math.log(2.0 * 30.0 * math.log(self.block_size / self.delta)))
        return log_r2 + math.log(self.step)

    def compress(self, tokens: Tokens, budget: int, generator: torch.Generator) -> KVSummary:
        n = tokens.length
        if n <= budget:
            return tokens.exact()
        keys, values, positions = tokens.keys, tokens.values, tokens.positions
        log_weights = torch.zeros(positions.shape, device=keys.device)
        exact_count = int(self.augment * budget)
        if exact_count:
            outlier = first_true(_outlier_mask(keys, exact_count), n)
            outliers = _gather(outlier[..., :exact_count], keys, values, positions, log_weights)
            keys, values, positions, log_weights = _gather(outlier[..., exact_count:], keys, values, positions, log_weights)
        self.failures = 0
        keys, values, positions, log_weights = self._rounds(keys, values, positions, log_weights, budget - exact_count, tokens.scale, generator)
        if exact_count:
            keys, values, positions, log_weights = (torch.cat(p, 2) for p in zip(outliers, (keys, values, positions, log_weights)))
        order = positions.argsort(-1)
        keys, values, positions, log_weights = _gather(order, keys, values, positions, log_weights)
        if not self.weighted:
            log_weights = torch.zeros_like(log_weights)
        return KVSummary(keys, values, log_weights, positions)

    def _rounds(self, keys, values, positions, log_weights, target: int, scale: float, generator: torch.Generator):
        """Halving rounds over [B,H,n,·] tokens until `target` slots per head remain."""
        b, h, _, d = keys.shape
        while keys.shape[2] > target:
            current = keys.shape[2]
            level = log_weights == log_weights.amax(-1, keepdim=True)
            pairs = min(current - target, int(level[0, 0].sum()) // 2)
            if pairs == 0:
                raise ValueError(
                    f"balancekv cannot reach budget={target} from {current} slots of distinct weights; "
                    f"use a budget of at least {current}"
                )
            priority = torch.rand(level.shape, generator=generator, device=generator.device).to(keys.device) + level
            chosen = priority.topk(2 * pairs, dim=-1).indices.sort(-1).values
            rest_mask = torch.ones_like(level).scatter(-1, chosen, False)
            rest = first_true(rest_mask, current - 2 * pairs)
            sel_k, sel_v, sel_p, sel_w = _gather(chosen, keys, values, positions, log_weights)
            kernel_values = None if self.kernel == "key" else sel_v.reshape(b * h, 2 * pairs, -1)
            kept, fails = halve(sel_k.reshape(b * h, 2 * pairs, d), kernel_values, scale, self, self.kernel, generator)
            self.failures += fails
            kept_parts = _gather(kept.reshape(b, h, pairs), sel_k, sel_v, sel_p, sel_w + LOG2)
            rest_parts = _gather(rest, keys, values, positions, log_weights)
            keys, values, positions, log_weights = (torch.cat(p, 2) for p in zip(rest_parts, kept_parts))
        return keys, values, positions, log_weights

    def new_stream(self, budget: int, generator: torch.Generator) -> "BalanceKVStream":
        return BalanceKVStream(self, budget, generator)


def _outlier_mask(keys: torch.Tensor, count: int) -> torch.Tensor:
    """[B,H,n] True for the `count` keys with the lowest mean inner product with the other keys (seed Sec. 4.3)."""
    keys = keys.float()
    n = keys.shape[2]
    others = (keys.sum(2, keepdim=True) - keys) / max(n - 1, 1)
    score = (keys * others).sum(-1)
    index = score.topk(count, dim=-1, largest=False).indices
    return torch.zeros(score.shape, dtype=torch.bool, device=keys.device).scatter(-1, index, True)


class MergeAndReduce:
    """One MergeAndReduce instance (seed Alg. 4) for one head: level l holds slots of weight 2^l.

    Tokens enter level 0; a level holding `batch` slots (l < `top`, or any l when top is None) has
    its oldest `batch` slots halved by SoftmaxBalance into level l + 1, like a binary counter.
    values None runs the keys-only instance (v ≡ 1) of the normaliser.
    """

    def __init__(self, owner: BalanceKV, kernel: str, top: int | None):
        self.owner, self.kernel, self.top = owner, kernel, top
        self.levels: dict[int, list[torch.Tensor | None]] = {}

    def add(self, level: int, keys: torch.Tensor, values: torch.Tensor | None, positions: torch.Tensor) -> None:
        """Append slots [c, d] / [c, d_v] / [c] to a level."""
        old = self.levels.get(level)
        new = [keys, values, positions]
        if old is not None:
            new = [None if a is None else torch.cat([a, x]) for a, x in zip(old, new)]
        self.levels[level] = new

    def count(self, level: int) -> int:
        return self.levels[level][0].shape[0] if level in self.levels else 0

    def halve_level(self, level: int, count: int, scale: float, generator: torch.Generator) -> None:
        """Halve the oldest `count` (even) slots of a level into the next one."""
        keys, values, positions = self.levels.pop(level)
        kernel_values = None if values is None else values[None, :count]
        kept, fails = halve(keys[None, :count], kernel_values, scale, self.owner, self.kernel, generator)
        self.owner.failures += fails
        kept = kept[0]
        if count < keys.shape[0]:
            self.levels[level] = [None if t is None else t[count:] for t in (keys, values, positions)]
        self.add(level + 1, keys[kept], None if values is None else values[kept], positions[kept])

    def cascade(self, scale: float, generator: torch.Generator) -> None:
        """Halve every full level (seed Alg. 4 lines 11-17)."""
        level = 0
        while level <= max(self.levels, default=-1):
            batch = self.owner.stream_batch
            if self.count(level) >= batch and (self.top is None or level < self.top):
                self.halve_level(level, batch, scale, generator)
            else:
                level += 1

    def slots(self) -> int:
        return sum(self.count(level) for level in self.levels)


class BalanceKVStream(StreamState):
    """Streaming BalanceKV (seed Alg. 1) per head: value-norm buckets for the numerator, keys only for the normaliser.

    A token with 2^i <= ‖v‖ < 2^(i+1) enters numerator bucket i; every token also enters the
    normaliser instance. Tokens are taken `batch` (t) at a time. Departure from the seed forced by
    the hard budget: the numerator and normaliser slots of a head together never exceed `budget`;
    when they would, the fullest level (ties: the lighter one) has its oldest even number of
    slots halved ahead of time (a forced extra halving), so memory stays
    bounded for any stream length while every level still holds slots of one weight and weights
    keep summing to the tokens seen. The seed's erasure of negligible buckets (Alg. 1 line 8) is
    not applied: every token stays represented.
    """

    def __init__(self, method: BalanceKV, budget: int, generator: torch.Generator):
        if budget < 2:
            raise ValueError(f"balancekv streaming needs budget >= 2 (numerator and normaliser slots), got {budget}")
        self.method, self.budget, self.generator = method, budget, generator
        self.heads: list[tuple[dict[int, MergeAndReduce], MergeAndReduce]] | None = None
        self.shape: tuple[int, int] | None = None
        self.template: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def failures(self) -> int:
        return self.method.failures

    def absorb(self, tokens: Tokens) -> None:
        b, h, n, _ = tokens.keys.shape
        if self.heads is None:
            self.shape = (b, h)
            self.template = (tokens.keys[:1, :1, :0], tokens.values[:1, :1, :0])
            self.heads = [({}, MergeAndReduce(self.method, "key", self.method.levels)) for _ in range(b * h)]
        buckets = torch.floor(torch.log2(tokens.values.float().norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny))).long()
        step = self.method.stream_batch
        for start in range(0, n, step):
            part = tokens.slice(start, min(n, start + step))
            for head, (numerators, denominator) in enumerate(self.heads):
                i, j = divmod(head, h)
                keys, values, positions = part.keys[i, j], part.values[i, j], part.positions[i, j]
                head_buckets = buckets[i, j, start : start + keys.shape[0]]
                for bucket in head_buckets.unique().tolist():
                    sel = head_buckets == bucket
                    instance = numerators.setdefault(bucket, MergeAndReduce(self.method, "value", self.method.levels))
                    instance.add(0, keys[sel], values[sel], positions[sel])
                    instance.cascade(part.scale, self.generator)
                denominator.add(0, keys, None, positions)
                denominator.cascade(part.scale, self.generator)
                self._enforce_budget([*numerators.values(), denominator], part.scale)

    def _enforce_budget(self, instances: list[MergeAndReduce], scale: float) -> None:
        while sum(inst.slots() for inst in instances) > self.budget:
            _, level, inst = min(
                ((-inst.count(lvl), lvl, inst) for inst in instances for lvl in inst.levels if inst.count(lvl) >= 2),
                key=lambda item: item[:2],
            )
            inst.halve_level(level, inst.count(level) // 2 * 2, scale, self.generator)
            inst.cascade(scale, self.generator)

    def summary(self) -> KVSummary | None:
        if self.heads is None:
            return None
        numerator = [_collect(list(numerators.values())) for numerators, _ in self.heads]
        denominator = [_collect([den]) for _, den in self.heads]
        keys, values, log_weights, positions = _stack(numerator, self.shape, self.template)
        norm_keys, _, norm_weights, norm_positions = _stack(denominator, self.shape, self.template)
        return KVSummary(keys, values, log_weights, positions, Normalizer(norm_keys, norm_weights, norm_positions))


def _collect(instances: list[MergeAndReduce]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """All levels of some instances of one head: keys [c,d], values [c,d_v] or None, log-weights [c], positions [c]."""
    parts = [(*inst.levels[lvl], lvl) for inst in instances for lvl in sorted(inst.levels)]
    keys = torch.cat([p[0] for p in parts])
    values = None if parts[0][1] is None else torch.cat([p[1] for p in parts])
    log_weights = torch.cat([torch.full((p[0].shape[0],), p[3] * LOG2, device=keys.device) for p in parts])
    return keys, values, log_weights, torch.cat([p[2] for p in parts])


def _stack(heads: list, shape: tuple[int, int], template: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Pad per-head slot sets to one [B, H, m, ·] tensor set; padding has log-weight -inf and position -1."""
    width = max(k.shape[0] for k, _, _, _ in heads)
    key_t, value_t = template
    out_k, out_v, out_w, out_p = [], [], [], []
    for keys, values, log_weights, positions in heads:
        pad = width - keys.shape[0]
        out_k.append(torch.nn.functional.pad(keys, (0, 0, 0, pad)))
        if values is not None:
            out_v.append(torch.nn.functional.pad(values, (0, 0, 0, pad)))
        out_w.append(torch.nn.functional.pad(log_weights, (0, pad), value=float("-inf")))
        out_p.append(torch.nn.functional.pad(positions, (0, pad), value=-1))
    b, h = shape
    keys = torch.stack(out_k).reshape(b, h, width, -1).to(key_t.dtype)
    values = torch.stack(out_v).reshape(b, h, width, -1).to(value_t.dtype) if out_v else None
    return keys, values, torch.stack(out_w).reshape(b, h, width), torch.stack(out_p).reshape(b, h, width)
