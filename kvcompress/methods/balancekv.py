"""BalanceKV: discrepancy-based selection of key-value pairs, with weighted attention.

Han, Kapralov, Kochetkova, Sheth, Zandieh, "BalanceKV: KV Cache Compression through Discrepancy
Theory", arXiv:2502.07861. The stream's departures from it: docs/design.md, "BalanceKV's stream".

- SoftmaxBalance (Alg. 2): a self-balancing walk signs the tokens of a block so that the
  signed sum of exp(s<k,·>)·v is small in every direction; one side is kept with doubled weight.
- One-shot (prefill, App. B): every block of `block_size` tokens of every head is balanced
  at once as one batched tensor program, rounds repeat until the budget is met.
- Streaming (decoding, Alg. 1 + Alg. 4): MergeAndReduce binary counters, one per value-norm
  bucket; the kept slots serve numerator and denominator alike (see `BalanceKVStream`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

import torch

from ..checks import as_count, as_fraction
from ..saved_state import Choice, Count, Generator, Instance, Linked, Mapping, Maybe, Real, Record, Tensor, saved
from ..summary import KVSummary, concat, take_slots
from .base import Method, StreamState, first_true
from .budget import check_slack, floor_share, stream_split
from .clustergen import squared_norms
from .registry import register
from .tokens import Tokens, cat_tokens

LOG2 = math.log(2.0)
KERNELS = ("value", "key", "joint")
# The walk's gain is capped at e^80 so x·gain stays finite in float32 (|x| <= b); this only
# changes p for imbalances below e^-80·R², which the walk could not resolve anyway.
_MAX_LOG_GAIN = 80.0
# Kernel entries materialised at once (float32): blocks are balanced in chunks below this.
_MAX_KERNEL = 1 << 24
# Kernel entries (float32) computed at once: a chunk's kernel is written in place piece by piece, so
# the temporaries (value Gram matrices) stay small enough for the allocator to reuse their memory.
# In a fresh process that spares first-touch page faults; inside a model's prefill, where the
# allocator is warm, the piece size matters little.
_KERNEL_PIECE = 1 << 19


def balance_kernel(
    keys: torch.Tensor,
    values: torch.Tensor | None,
    valid: torch.Tensor | None,
    scale: float,
    kernel: str,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SoftmaxBalance kernel of each block, divided by the paper's R² so every entry lies in [-1, 1].

    keys [N, b, d], values [N, b, d_v] (ignored for kernel="key"), valid [N, b] bool (False = padding;
    None: no padding).
    Keys are centred by the mean of the block's valid keys (attention is invariant to that shift;
    the paper's App. B.5). K_ij = exp(s<k̄_i,k̄_j>)·κ(v_i,v_j) with κ = <v_i,v_j> ("value", Alg. 2),
    κ = 1 ("key": v ≡ 1) or κ = (<v_i,v_j>/r_v² + 1)/2 ("joint": the walk on
    [v/r_v, 1], balancing numerator and denominator together). R² = exp(s·r_key²)·r_value² with the
    block's largest centred key norm and value norm (Alg. 2 line 2), applied in log space; exp(s·r_key²)
    for "key" and "joint", whose κ is at most 1.
    out: a contiguous float32 [N, b, b] to write K / R² into (None: a new tensor).
    Returns (K / R² [N, b, b] float32 with zero rows and columns for padding, log R² [N]).
    """
    keys = keys.float()
    if valid is None:
        centred = keys - keys.sum(1, keepdim=True) / float(keys.shape[1])
    else:
        mask = valid.unsqueeze(-1).float()
        keys = keys * mask
        mean = keys.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp_min(1.0)
        centred = (keys - mean) * mask
    out = torch.bmm(centred, centred.transpose(1, 2), out=out).mul_(scale)
    r_key = out.diagonal(dim1=1, dim2=2).amax(-1)
    out.sub_(r_key[:, None, None]).exp_()
    log_r2 = r_key
    if kernel != "key":
        v = values.float()
        if valid is not None:
            v = v * mask
        vgram = torch.bmm(v, v.transpose(1, 2))
        r_value = vgram.diagonal(dim1=1, dim2=2).amax(-1).clamp_min(torch.finfo(torch.float32).tiny)
        vgram.div_(r_value[:, None, None])
        if kernel == "value":
            out.mul_(vgram)
            log_r2 = log_r2 + r_value.log()
        else:  # "joint": kappa <= 1 already, so R² is the keys' factor alone and the walk does not see the values' scale
            out.mul_(vgram.add_(1.0).div_(2.0))
    if valid is not None:
        out.masked_fill_(~valid[:, :, None], 0.0).masked_fill_(~valid[:, None, :], 0.0)
    return out, log_r2


def balancing_walk(kernel: torch.Tensor, valid: torch.Tensor, log_gain: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Signs of the self-balancing walk (the paper's Alg. 2) on each block, exactly half of each block per side.

    kernel [N, b, b] normalised (R² = 1), overwritten with the walk's drift (no copy of it), valid
    [N, b] with an even number of valid tokens per block and padding only after them (padding never
    affects a valid token), log_gain [N] = log(1 / (2c)) in these units. Token j goes to +1
    with probability p_j = ½ − x_j·gain, x_j = Σ_{i<j} η_i K_ij: the paper's ½ − yᵀη/(2cR²). The
    paper FAILs when |yᵀη| > cR², i.e. p_j outside [0, 1]; here p_j is clipped (the walk then takes
    the sign that reduces the imbalance) and the event is counted. Balancing rule: once one side
    holds half of the block's valid tokens, the remaining valid tokens join the other side.

    The sequential loop runs the walk without the balancing rule (two tensor ops per step); the
    rule is applied afterwards, which gives the same signs: up to the step where a side fills, the
    walk's choices are the same, and after it every sign is forced. Step i moves only the gaps of
    the later tokens j > i (the upper triangle of the kernel), so each gap ends the loop at its
    value when its token was decided and all signs are read off at once.
    Returns (signs [N, b] in {-1, 0, +1}, 0 for padding; number of FAIL events, a 0-d tensor).
    """
    n_blocks, b, _ = kernel.shape
    device = kernel.device
    half = valid.sum(-1, keepdim=True) // 2
    gain = torch.exp(log_gain.clamp_max(_MAX_LOG_GAIN)).to(device)
    uniform = torch.rand(n_blocks, b, generator=generator, device=generator.device, dtype=torch.float32).to(device)
    scaled = kernel.mul_(gain[:, None, None]).triu_(1)  # the walk's drift in units of the push x_j·gain, on later tokens
    # +1 ⇔ push < ½ − u: gap = push − (½ − u) starts at u − ½ and takes the walk's steps
    gap = uniform - 0.5
    step_minus = torch.empty(n_blocks, 1, device=device, dtype=gap.dtype)  # +1 where the walk says −1 (gap >= 0: ties go to −1)
    one = torch.ones((), device=device, dtype=gap.dtype)
    for column, row in zip(gap.unsqueeze(-1).unbind(1), scaled.unbind(1)):
        torch.copysign(one, column, out=step_minus)
        gap.addcmul_(step_minus, row, value=-1.0)
    free = -torch.copysign(one, gap) * valid
    # a side is full from the step after the one where its count reaches half
    plus, minus = (free > 0).long(), (free < 0).long()
    signs = torch.where(torch.cumsum(plus, -1) - plus >= half, -1.0, torch.where(torch.cumsum(minus, -1) - minus >= half, 1.0, free))
    signs = signs * valid
    pushes = torch.bmm(signs.unsqueeze(1), scaled).squeeze(1)  # x_j·gain with the final signs
    fails = ((pushes.abs() > 0.5) & valid).sum()
    return signs, fails


def halve(
    keys: torch.Tensor,
    values: torch.Tensor | None,
    scale: float,
    method: "BalanceKV",
    kernel: str,
    generator: torch.Generator,
) -> tuple[torch.Tensor, int]:
    """SoftmaxBalance on consecutive blocks of every row: index [R, m/2] of the kept tokens (ascending).

    keys [R, m, d], values [R, m, d_v] or None, m even; see `halve_mask`.
    Returns (index, number of FAIL events as a 0-d tensor).
    """
    m = keys.shape[1]
    keep, fails = halve_mask(keys, values, None, scale, method, method.block_size, kernel, generator)
    return first_true(keep, m // 2, exact=True), fails


def halve_mask(
    keys: torch.Tensor,
    values: torch.Tensor | None,
    lengths: torch.Tensor | None,
    scale: float,
    method: "BalanceKV",
    block_size: int,
    kernel: str,
    generator: torch.Generator,
) -> tuple[torch.Tensor, int]:
    """SoftmaxBalance on consecutive blocks of the first lengths[r] (even) tokens of every row r.

    keys [R, m, d], values [R, m, d_v] or None, lengths [R] even, <= m (tokens beyond are padding;
    None: every row holds m tokens).
    Rows and blocks are balanced together as one batched program; the last block of a row is
    zero-padded (the paper's App. B), and a row shorter than a block is one block of its own length.
    In each block the side kept is +1 or -1 with probability ½, so every token is kept with
    probability ½. `method` supplies the walk's gain; block_size is b.
    Returns (keep [R, m] bool, exactly lengths[r] / 2 True per row; number of FAIL events as a 0-d tensor).
    """
    rows, m, d = keys.shape
    block_size = min(block_size, m)
    n_blocks = -(-m // block_size)
    pad = n_blocks * block_size - m
    padded = pad > 0 or lengths is not None
    token_valid = torch.arange(n_blocks * block_size, device=keys.device) < (m if lengths is None else lengths[:, None])
    valid = token_valid.expand(rows, -1).reshape(-1, block_size)
    if pad:
        keys = torch.nn.functional.pad(keys, (0, 0, 0, pad))
        values = None if values is None else torch.nn.functional.pad(values, (0, 0, 0, pad))
    k = keys.reshape(-1, block_size, d)
    v = None if values is None else values.reshape(-1, block_size, values.shape[-1])
    chunk = max(1, _MAX_KERNEL // (block_size * block_size))
    piece = max(1, _KERNEL_PIECE // (block_size * block_size))
    keep, fails = [], 0
    for start in range(0, k.shape[0], chunk):
        stop = min(start + chunk, k.shape[0])
        blocks_valid = valid[start:stop]
        kern = torch.empty(stop - start, block_size, block_size, device=keys.device, dtype=torch.float32)
        log_r2 = []
        for low in range(start, stop, piece):
            high = min(low + piece, stop)
            part_values = None if v is None else v[low:high]
            part_valid = valid[low:high] if padded else None
            log_r2.append(balance_kernel(k[low:high], part_values, part_valid, scale, kernel, kern[low - start : high - start])[1])
        signs, failed = balancing_walk(kern, blocks_valid, method.log_gain(torch.cat(log_r2)), generator)
        side = torch.where(torch.rand(signs.shape[0], generator=generator, device=generator.device, dtype=torch.float32) < 0.5, 1.0, -1.0)
        keep.append(signs == side.to(signs.device)[:, None])
        fails += failed
    return torch.cat(keep).reshape(rows, -1)[:, :m], fails


def _gather(index: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Gather [B,H,n] or [B,H,n,d] tensors along the token axis with index [B,H,k]."""
    return [take_slots(t, index) for t in tensors]


_STREAM_ONLY = ("levels", "batch", "stream_block", "cascade_rounds")  # BalanceKV's parameters of MergeAndReduce


@register
@dataclass
class BalanceKV(Method):
    """BalanceKV ("BalanceKV: KV Cache Compression through Discrepancy Theory", arXiv:2502.07861).

    By default the augmented variant of the paper's needle experiment (Sec. 4.3).
    Defaults: b = 128 (a departure from App. B.2's 256, for speed: the kernels cost O(n·b) and
    the walk takes b sequential steps per round; in the paper's Fig. 3, whose rows are labelled
    batch size, 128 has at most 4.4% more relative error than 256: 0.1082 against 0.1036 on
    layer 1 at rate 1/2, 3.2% to 3.9% more at 1/4 and 1/8, at most 1.3% more on layer 15) and
    T-fold halving as in App. B.2; `augment` = 0.25 of the budget
    kept exactly for the keys most anti-correlated with the rest (Sec. 4.3 keeps "a small set"
    without a number; 0.25 is tuned on needle samples disjoint from the reported ones by
    benchmarks/tuning/balancekv_needle.py); no exact sink or window (default_sink = default_window
    = 0), so every compression ratio in (0, 1) runs end to end. The single-layer protocol of App. B.1 (first 256 and last
    256 tokens exact, augment 0) is passed explicitly by the approximation benchmarks.

    block_size: b, tokens per SoftmaxBalance block of the one-shot rounds, an even integer >= 2
    (default 128). step: the walk's probability rule p = ½ − yᵀη/(2cR²) with cR² = 1/(2·step) (the form
    and default 4.0 of the authors' implementation), None or a positive finite number; step=None uses the
    theoretical c = 30·log(b/δ) of the paper's Alg. 2. delta: δ, that failure probability, a number in
    (0, 1) (default 0.01); it is read only with step=None, and a delta other than the default is refused
    while step is set. On real keys exp(s<k̄_i,k̄_j>) is tiny next
    to R² = exp(s·r²), so the theoretical c leaves p ≈ ½ (the walk is then uniform sampling, one
    half per block); with step = 4 the walk mostly clips p (counted as FAIL events), i.e. it takes
    the sign that reduces the imbalance.
    weighted: kept slots carry log-weight (number of halvings)·log 2 (True, the default), or plain eviction
    (False; the paper's App. B does not say which). kernel: "value" (default, the Alg. 2 kernel), "key"
    (v ≡ 1) or "joint" (see `balance_kernel`); one-shot only, the stream uses "value" per bucket as in
    the paper's Alg. 1. augment: fraction of the budget kept exactly for the
    keys most anti-correlated with the rest (the paper's Sec. 4.3; the stream keeps them too, docs/design.md,
    "Streamed augmentation"), a fraction in [0, 1) (default 0.25), 0 turns it off. levels: T of
    MergeAndReduce (stream only), an integer >= 1, default 2; None lets the counter grow as deep as
    the stream (the paper's T = log(n/t)). batch: t, the tokens per MergeAndReduce halving (stream only; None means
    stream_block; else an even integer >= 2); a batch larger than stream_block is balanced as parallel blocks (the paper's App. B
    block-parallel form), which cuts the walk's sequential steps per token by batch/stream_block.
    Default 256 (a larger t is faster but its attention error on real layers is less stable).
    stream_block: b of the stream's halvings, an even integer >= 2 (default 64, for speed: the walk takes
    b sequential steps per halving, and in the paper's ablation, App. B.1 Fig. 3, 64 has at most 10% more
    relative error than 256, in under 1/3 of the time, on its layer 1).
    cascade_rounds: halving rounds of MergeAndReduce's cascade after
    each batch (stream only), an integer >= 1 or None; None halves until no level holds t slots, as the paper's Alg. 4 does;
    the default 1 halves every level full at that moment once, and a level that round fills waits
    for the next batch (at most one halving call per batch, for speed; the attention error is the
    same as the drained cascade's within noise).

    One-shot: rounds halve the middle until the budget is met. A round halves as many tokens of
    the current (heaviest) level as are needed; when fewer than all, the halved subset is drawn
    uniformly and the rest is kept exactly (the paper's App. B.5); an odd token out stays at its weight.
    Every halving keeps exactly half of a block with doubled weight, so weights sum to n. When
    every level holds a single slot and the budget is still exceeded (budgets below about
    log2(n / budget) slots), the two lightest slots are merged by weighted sampling (one kept with
    probability proportional to its weight, at their summed weight), so every budget >= 1 is reached.
    `failures` is the FAIL count of the last one-shot call, or of the stream so far (see `balancing_walk`).
    A stream of a batch pools every row's slots and draws each round's signs for all of them at once, in an order that
    depends on what every row holds: each row's summary is a BalanceKV summary of its tokens, reproducible for the same
    batch and seed, but not the one that row streamed alone gets (a cache, whose rows answer as alone, streams one row).
    """

    name = "balancekv"
    randomized = True
    default_sink = 0
    default_window = 0

    block_size: int = 128
    delta: float = 0.01
    step: float | None = 4.0
    weighted: bool = True
    kernel: str = "value"
    augment: float = 0.25
    levels: int | None = 2
    batch: int | None = 256
    stream_block: int = 64
    cascade_rounds: int | None = 1

    def __post_init__(self):
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 2 or self.block_size % 2:
            raise ValueError(f"block_size must be an even integer >= 2, got {self.block_size!r}")
        if isinstance(self.delta, bool) or not isinstance(self.delta, numbers.Real) or not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must be a number in (0, 1), got {self.delta!r}")
        if self.step is not None and (isinstance(self.step, bool) or not isinstance(self.step, numbers.Real)
                                      or not 0.0 < self.step < math.inf):
            raise ValueError(f"step must be None or a positive finite number, got {self.step!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        self.augment = as_fraction("augment", self.augment, "the share of the budget kept exactly")
        self.levels = as_count("levels", self.levels, 1, optional=True)
        if isinstance(self.stream_block, bool) or not isinstance(self.stream_block, int) or self.stream_block < 2 or self.stream_block % 2:
            raise ValueError(f"stream_block must be an even integer >= 2, got {self.stream_block!r}")
        if self.batch is not None and (isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 2 or self.batch % 2):
            raise ValueError(f"batch must be None or an even integer >= 2, got {self.batch!r}")
        self.cascade_rounds = as_count("cascade_rounds", self.cascade_rounds, 1, optional=True)
        if self.step is not None and self.delta != BalanceKV.__dataclass_fields__["delta"].default:
            raise ValueError(f"delta={self.delta!r} is the failure probability of the theoretical gain that step=None uses; step="
                             f"{self.step!r} sets the gain itself: drop delta, or use step=None")
        self.fail_events = 0  # a 0-d tensor once counted: read through `failures` (no host sync per halving)

    def check_acting(self, streams: bool) -> None:
        """A ValueError naming the parameters set away from their defaults that cannot act where the method runs: the
        stream's (levels, batch, stream_block, cascade_rounds) in one shot, and the one-shot rounds' (kernel, and
        block_size unless step=None reads it) in a stream."""
        names = ("kernel",) + (() if self.step is None else ("block_size",)) if streams else _STREAM_ONLY
        unused = [f"{name}={getattr(self, name)!r}" for name in names if getattr(self, name) != BalanceKV.__dataclass_fields__[name].default]
        if unused:
            where, other = ("a stream (mode 'chunked' or 'decode', kvc.stream)", "the one-shot rounds") if streams else \
                ("one shot (mode 'prefill', kvc.compress, a hybrid's coreset)", "the stream")
            raise ValueError(f"{', '.join(unused)} cannot act in {where}: they set {other} of method 'balancekv'; drop them")

    def check_mode(self, mode: str) -> None:
        super().check_mode(mode)
        self.check_acting(streams=mode != "prefill")

    @property
    def failures(self) -> int:
        """FAIL events (see `balancing_walk`) of the last one-shot call (a stream counts its own: `BalanceKVStream.failures`)."""
        return int(self.fail_events)

    @property
    def stream_batch(self) -> int:
        """t of MergeAndReduce: tokens per halving call (stream_block when `batch` is None)."""
        return self.stream_block if self.batch is None else self.batch

    def log_gain(self, log_r2: torch.Tensor) -> torch.Tensor:
        """log(1 / (2c)) of the walk in units of R² (see `balancing_walk`), per block from log R² [N].

        step None: c = 30·log(b/δ), the constant of the paper's Alg. 2. step γ: cR² = 1/(2γ) in the
        kernel's own units, the form p = ½ − γ·yᵀη of the authors' implementation.
        """
        if self.step is None:
            return torch.full_like(log_r2, -math.log(2.0 * 30.0 * math.log(self.block_size / self.delta)))
        return log_r2 + math.log(self.step)

    def compress(self, tokens: Tokens, budget: int, generator: torch.Generator) -> KVSummary:
        self.check_acting(streams=False)
        n = tokens.length
        if n <= budget:
            return tokens.exact()
        keys, values, positions = tokens.keys, tokens.values, tokens.positions
        # the rounds follow the slots as indices into the tokens; keys and values are gathered once at the end
        index = torch.arange(n, device=keys.device).expand(positions.shape)
        exact_count = floor_share(self.augment, budget)
        if exact_count:
            outlier = _outlier_mask(keys, exact_count)
            outliers, index = first_true(outlier, exact_count, exact=True), first_true(~outlier, n - exact_count, exact=True)
        log_weights = torch.zeros(index.shape, device=keys.device, dtype=torch.float32)
        self.fail_events = 0
        index, log_weights = self._rounds(keys, values, index, log_weights, budget - exact_count, tokens.scale, generator)
        if exact_count:
            index = torch.cat([outliers, index], -1)
            log_weights = torch.cat([torch.zeros(outliers.shape, device=keys.device, dtype=torch.float32), log_weights], -1)
        order = take_slots(positions, index).argsort(-1)
        index = index.gather(-1, order)
        keys, values, positions = _gather(index, keys, values, positions)
        log_weights = log_weights.gather(-1, order) if self.weighted else torch.zeros_like(log_weights)
        return KVSummary(keys, values, log_weights, positions)

    def _rounds(self, keys, values, index, log_weights, target: int, scale: float, generator: torch.Generator):
        """Halving rounds over the slots index [B,H,m] (into keys [B,H,n,d] / values [B,H,n,d_v]) with log-weights
        [B,H,m] until `target` slots per head remain; returns (index, log_weights) of the slots kept. A round
        gathers the keys (and values, unless kernel="key") of the slots it halves."""
        b, h, _, d = keys.shape
        while index.shape[2] > target:
            current = index.shape[2]
            level = log_weights == log_weights.amax(-1, keepdim=True)
            pairs = min(current - target, int(level[0, 0].sum()) // 2)
            if pairs == 0:
                index, log_weights = _merge_lightest(index, log_weights, generator)
                continue
            # drawn in every round, so the generator's stream does not depend on which rounds select
            draw = torch.rand(level.shape, generator=generator, device=generator.device, dtype=torch.float32)
            if 2 * pairs == current:  # every slot is halved (the first rounds): nothing to select
                chosen, halved = None, index
            else:
                chosen = (draw.to(keys.device) + level).topk(2 * pairs, dim=-1).indices.sort(-1).values
                rest = first_true(torch.ones_like(level).scatter(-1, chosen, False), current - 2 * pairs, exact=True)
                halved = index.gather(-1, chosen)
            kernel_values = None if self.kernel == "key" else take_slots(values, halved).reshape(b * h, 2 * pairs, -1)
            kept, fails = halve(take_slots(keys, halved).reshape(b * h, 2 * pairs, d), kernel_values, scale, self, self.kernel, generator)
            self.fail_events += fails
            # the rest, then the kept half of the chosen (weight doubled)
            kept = kept.reshape(b, h, pairs)
            order = kept if chosen is None else torch.cat([rest, chosen.gather(-1, kept)], -1)
            index, log_weights = index.gather(-1, order), log_weights.gather(-1, order)
            log_weights[..., current - 2 * pairs :] += LOG2
        return index, log_weights

    def new_stream(self, budget: int, generator: torch.Generator, slack: float | None = None) -> "BalanceKVStream":
        """Native stream (`BalanceKVStream`): at most `budget` slots per head at any time, its slack and the batch
        being added included; pending halvings wait until a head's pool is full."""
        self.check_acting(streams=True)
        return BalanceKVStream(self, budget, generator, self.stream_slack(slack))


def _merge_lightest(index: torch.Tensor, log_weights: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One slot fewer per head when every level holds a single slot: of the slots index [B,H,m] with log-weights
    [B,H,m], the two lightest (weights w1, w2) become one, slot i kept with probability w_i / (w1 + w2) at weight
    w1 + w2 (unbiased). Returns (index, log_weights) [B,H,m-1]: the other slots in order, then the merged one."""
    lightest = log_weights.topk(2, dim=-1, largest=False).indices
    pair_weights = log_weights.gather(-1, lightest)
    first = torch.rand(pair_weights.shape[:-1], generator=generator, device=generator.device, dtype=torch.float32).to(index.device)
    keep_first = first < pair_weights.softmax(-1)[..., 0]
    kept = torch.where(keep_first, lightest[..., 0], lightest[..., 1]).unsqueeze(-1)
    rest = first_true(torch.ones_like(log_weights, dtype=torch.bool).scatter(-1, lightest, False), log_weights.shape[-1] - 2,
                      exact=True)
    weights = torch.cat([log_weights.gather(-1, rest), pair_weights.logsumexp(-1, keepdim=True)], -1)
    return index.gather(-1, torch.cat([rest, kept], -1)), weights


def _outlier_mask(keys: torch.Tensor, count: int) -> torch.Tensor:
    """[B,H,n] True for the `count` keys with the lowest mean inner product with the other keys (the paper's Sec. 4.3):
    <k_i, Σ_j k_j − k_i> / (n − 1), one matrix-vector product and the keys' squared norms (no [B,H,n,d] temporary)."""
    keys = keys.float()
    n = keys.shape[2]
    total = keys.sum(2, keepdim=True)  # [B,H,1,d]
    score = (keys @ total.transpose(-1, -2)).squeeze(-1).sub_(squared_norms(keys)).div_(max(n - 1, 1))
    index = score.topk(count, dim=-1, largest=False).indices
    return torch.zeros(score.shape, dtype=torch.bool, device=keys.device).scatter(-1, index, True)


# Instance ids of a head's MergeAndReduce instances: value-norm bucket i is i + _BUCKET_OFFSET
# (floor(log2 ‖v‖) of a float32 lies in [-149, 128]).
_BUCKET_OFFSET = 160
_INSTANCES = 320
_LEVELS = 64
# Level of the slots made by `_merge_singletons` (weights not a power of two): never halved again.
_MERGED = _LEVELS - 1


@saved("balancekv_stream", 2)
class BalanceKVStream(StreamState):
    """Streaming BalanceKV (the paper's Alg. 1 + Alg. 4): every head and bucket in one pool of slots.

    Each head runs one MergeAndReduce instance (a binary counter: level l holds slots of weight
    2^l) per value-norm bucket (2^i <= ‖v‖ < 2^(i+1)). Tokens enter level 0 `batch` (t) at a time;
    once compression is needed, a level holding t slots (l < `levels`, or any l when levels is
    None) has its oldest t slots halved by SoftmaxBalance into level l + 1 (`cascade_rounds`
    rounds per reduction). The slots of all heads, buckets and levels live in one flat pool, and a
    cascade round halves every full level of every head and bucket with one batched `halve_mask`
    call: the Python loop runs over batches of t tokens and cascade rounds.

    Departures from the paper (docs/design.md, "BalanceKV's stream"):
    - One slot set for numerator and denominator. The paper's Alg. 1 sketches the denominator with a
      separate keys-only instance, so attention is the ratio of two independently halved
      estimates. On real layers a few tokens dominate exp(s<q,k>); when one of them is kept (at
      doubled weight) by one sketch and dropped by the other, that ratio is unbounded and the
      model emits gibberish. Self-normalised over the kept slots (as the one-shot form is), the
      output stays a convex combination of kept values, and every token takes one slot.
    - Exact until compression is needed: no halving runs while every head's pool has room for the
      next tokens (the stream's budget, outliers aside), so a budget at least the tokens seen keeps
      them all exactly (log-weight 0).
    - A hard budget: a head over `budget` after the cascade has the fullest level (ties: the
      lighter one) halve its oldest even number of slots ahead of time (a forced halving), so
      memory stays bounded for any stream length while every level still holds slots of one
      weight and weights keep summing to the tokens seen. When every level of an over-budget head
      holds a single slot, its two lightest slots are merged as the one-shot form does: one kept
      with probability proportional to its weight, at their summed weight (unbiased); such a slot
      is never halved again.
    - The erasure of negligible buckets (Alg. 1 line 8) is not applied: every token stays represented.

    Within the stream's budget: the stream is built with the most slots per head it may ever store
    (`new_stream`'s budget); the outliers take their share of it, and the rest, the pool's, is split
    by `budget.stream_split` into the pool's target (`self.budget`) and the room beside it
    (`slack_slots`) for the slack and the batch being added. slack: pending halvings wait, exact at
    level 0, until a head's pool is full (a host-side bound: every token adds one slot per head, no
    check or sync per batch); tokens are added in batches of at most t that fit the room, and a
    batch that does not fit runs `_reduce` first: one cascade round in which every level below the
    top halves all its whole multiples of t at once (as rows of t of one batched walk), then the
    forced halvings down to the target. slack=0 keeps one slot of room (a reduction at every token
    past the target). `compact()` gives back the buffer rows no slot uses. One-shot
    `BalanceKV.compress` is the separate round-based form and has no slack.
    """

    exact_within_budget = True  # no halving runs while every head's pool has room for the next tokens

    def __init__(self, method: BalanceKV, budget: int, generator: torch.Generator, slack: float):
        self.exact_count = max(0, min(floor_share(method.augment, budget), budget - 2))
        # the pool's target, and the room beside it for the slack and the batch being added (`budget.stream_split`)
        target, self.slack_slots = stream_split(budget - self.exact_count, check_slack(slack))
        self.method, self.budget, self.generator = method, target, generator
        self.outliers: Tokens | None = None  # the `exact_count` keys most anti-correlated with the mean key so far, kept exactly
        self.key_sum: torch.Tensor | None = None
        self.key_count = 0
        self.held = 0  # host-side upper bound on the slots any head holds
        self.scale: float | None = None
        # slot metadata {positions, row, instance, level, log_weight, order, token} (`pool`); `token` indexes
        # the key/value buffers; `added`: batches not yet in it
        self._pool: dict[str, torch.Tensor] | None = None
        self.added: list[dict[str, torch.Tensor]] = []
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        # slots referring to each buffer row [capacity], and the rows no slot refers to (reused by `_store`)
        self.references: torch.Tensor | None = None
        self.free: torch.Tensor | None = None
        self.shape: tuple[int, int] | None = None
        self.template: tuple[torch.Tensor, torch.Tensor] | None = None
        self.events = 0
        self.fail_events = 0  # a 0-d tensor once counted (no host sync per halving)
        self.stored_rows = 0  # rows ever written: the buffers never grow past them (a full cache's size)

    _POOL = ("positions", "row", "instance", "level", "log_weight", "order", "token")
    saved_fields = {
        "method": Linked("method", "coreset_method"), "budget": Count(1), "exact_count": Count(), "generator": Generator(),
        "slack_slots": Count(), "outliers": Maybe(Instance("tokens")), "key_sum": Maybe(Tensor("B H D")), "key_count": Count(),
        "held": Count(), "scale": Maybe(Real(0.0)), "pool": Maybe(Mapping(Choice(_POOL), Tensor("S", ("int64", "float32")))),
        "keys": Maybe(Tensor("R D")), "values": Maybe(Tensor("R V")), "references": Maybe(Tensor("R", ("int32",))),
        "free": Maybe(Tensor("F", ("int64",))), "shape": Maybe(Record((Count(1), Count(1)))),
        "template": Maybe(Record((Tensor("0"), Tensor("0")))), "events": Count(), "fail_events": Count(), "stored_rows": Count(),
    }

    def saved_values(self) -> dict:
        """The fields, the slots added since the last read merged into the pool, the FAIL count as an int."""
        return {name: getattr(self, name) for name in self.saved_fields} | {"fail_events": int(self.fail_events)}

    @classmethod
    def from_saved(cls, values):
        pool = values.pop("pool")
        state = super().from_saved(values)
        state._pool, state.added = pool, []
        return state

    def check_saved(self) -> None:
        if self.slack_slots < 1:  # `absorb` adds tokens only into the room beside the target: none would never finish
            raise ValueError(f"slack_slots must be at least 1 (the room `budget.stream_split` leaves beside the target), got {self.slack_slots}")
        started = [name for name in ("pool", "keys", "values", "references", "free", "shape", "template") if getattr(self, name) is not None]
        if self.shape is None:
            if started:
                raise ValueError(f"{started} are saved before any token reached the pool (shape is null)")
            return
        pool = self.pool
        if pool is None or len(started) != 7:
            raise ValueError(f"shape {self.shape} is set but only {started} of the pool and its buffers are saved")
        if set(pool) != set(self._POOL) or len({t.shape[0] for t in pool.values()}) != 1:
            raise ValueError(f"the pool must hold {list(self._POOL)}, one value per slot each, got {[(k, list(t.shape)) for k, t in pool.items()]}")
        if pool["log_weight"].dtype != torch.float32 or any(pool[k].dtype != torch.long for k in self._POOL if k != "log_weight"):
            raise ValueError("the pool's log_weight must be float32 and its other fields int64")
        rows = self.keys.shape[0]
        bounds = {"row": self.shape[0] * self.shape[1], "instance": _INSTANCES, "level": _LEVELS, "token": rows}
        for name, most in bounds.items():
            if pool[name].numel() and bool((pool[name] < 0).any() | (pool[name] >= most).any()):
                raise ValueError(f"the pool's {name} values must lie in 0..{most - 1}")
        if self.free.numel() and bool((self.free < 0).any() | (self.free >= rows).any()):
            raise ValueError(f"free buffer rows must lie in 0..{rows - 1}")
        if self.references.shape[0] != rows or self.values.shape[0] != rows:
            raise ValueError(f"key buffer of {rows} rows, value buffer of {self.values.shape[0]} and {self.references.shape[0]} reference counts")

    @property
    def failures(self) -> int:
        """FAIL events of this stream's halvings so far (each layer's stream counts its own)."""
        return int(self.fail_events)

    def absorb(self, tokens: Tokens) -> None:
        if self.exact_count:
            tokens = self._keep_outliers(tokens)
            if tokens.length == 0:
                return
        b, h, n, d = tokens.keys.shape
        if self.shape is None:
            self.shape = (b, h)
            self.template = (tokens.keys.new_empty(0), tokens.values.new_empty(0))  # dtypes only: no view of the block
            self.references = torch.zeros(0, dtype=torch.int32, device=tokens.keys.device)
            self.free = torch.zeros(0, dtype=torch.long, device=tokens.keys.device)
        norms = tokens.values.float().norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
        instance = (torch.floor(torch.log2(norms)).long() + _BUCKET_OFFSET).reshape(b * h, n)
        rows = torch.arange(b * h, device=tokens.keys.device)[:, None].expand(b * h, n)
        slots = torch.stack([tokens.positions.reshape(b * h, n), rows, instance], -1)  # [B·H, n, 3]
        step = self.method.stream_batch
        self.scale = tokens.scale
        start = 0
        while start < n:
            if self.held >= self.budget + self.slack_slots:  # full: the pending halvings make room first
                self._reduce(tokens.scale)
            stop = min(n, start + step, start + self.budget + self.slack_slots - self.held)
            count = stop - start
            token = self._store(tokens.keys[:, :, start:stop].reshape(-1, d), tokens.values[:, :, start:stop].reshape(-1, tokens.values.shape[-1]))
            added = slots[:, start:stop].reshape(-1, 3)  # head-major, as the buffer rows
            self._add({"positions": added[:, 0], "row": added[:, 1], "instance": added[:, 2], "token": token})
            self.held += count
            start = stop

    def _keep_outliers(self, tokens: Tokens) -> Tokens:
        """The paper's augmentation (Sec. 4.3), streamed: the held outliers and the new tokens compete for the
        `exact_count` exact places by their inner product with the mean key seen so far (lowest kept);
        returns the tokens that lose, one count for every head, for the MergeAndReduce pool."""
        keys = tokens.keys.float()
        self.key_sum = keys.sum(2) if self.key_sum is None else self.key_sum + keys.sum(2)
        self.key_count += tokens.length
        candidates = tokens if self.outliers is None else cat_tokens([self.outliers, replace(tokens, queries=None)])
        score = (candidates.keys.float() * (self.key_sum / self.key_count)[:, :, None]).sum(-1)
        order = score.argsort(dim=-1, stable=True)
        kept, leaving = order[..., : self.exact_count].sort(-1).values, order[..., self.exact_count :].sort(-1).values
        self.outliers = candidates.select(kept).stored()
        return candidates.select(leaving)

    def compact(self) -> None:
        """Give back the buffer rows no slot refers to (what is held is already within the stream's budget; the pending
        halvings wait for the next token that does not fit)."""
        if self.keys is not None:
            live = (self.references > 0).nonzero().squeeze(1)
            new_row = torch.full_like(self.references, -1, dtype=torch.long).index_copy_(0, live, torch.arange(len(live), device=live.device))
            self.pool["token"] = new_row[self.pool["token"]]
            self.keys, self.values = self.keys.index_select(0, live), self.values.index_select(0, live)
            self.references = self.references.index_select(0, live)
            self.free = self.free[:0]

    def _stamp(self, positions: torch.Tensor) -> torch.Tensor:
        """Age key of slots entering a level now: older entries first, then by position."""
        self.events += 1
        return (self.events << 32) + positions

    def _store(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Write keys [c, d] / values [c, d_v] into free buffer rows; returns those rows [c].

        Rows freed by `_remove` are reused (the latest first), so the buffers stop growing once the
        pool stops growing; when fewer than c rows are free, the buffers are copied into ones twice
        the live rows plus c, capped at the most rows ever live at once, B·H·(budget + slack_slots) (a batch is added
        only while every head has room for it),
        and at the rows written so far plus c (so never more than a full cache of the tokens seen).
        """
        count = keys.shape[0]
        if self.free.numel() < count:
            capacity = 0 if self.keys is None else self.keys.shape[0]
            most_live = self.shape[0] * self.shape[1] * (self.budget + self.slack_slots)
            grown = max(capacity - self.free.numel() + count, min(2 * (capacity - self.free.numel() + count), most_live, self.stored_rows + count))
            new_keys, new_values = keys.new_zeros(grown, keys.shape[1]), values.new_zeros(grown, values.shape[1])
            if capacity:
                new_keys[:capacity], new_values[:capacity] = self.keys, self.values
            self.keys, self.values = new_keys, new_values
            self.references = torch.cat([self.references, self.references.new_zeros(grown - capacity)])
            self.free = torch.cat([self.free, torch.arange(capacity, grown, device=keys.device)])
        self.stored_rows += count
        rows, self.free = self.free[:count], self.free[count:]
        self.keys.index_copy_(0, rows, keys)
        self.values.index_copy_(0, rows, values)
        return rows

    @property
    def pool(self) -> dict[str, torch.Tensor] | None:
        """Slot metadata {positions, row, instance, level, log_weight, order, token} [S] each (None before any
        token): the slots added since the last read are appended now, all batches in one concatenation."""
        if self.added:
            parts = self.added if self._pool is None else [self._pool, *self.added]
            self._pool = {name: torch.cat([part[name] for part in parts]) for name in parts[0]}
            self.added = []
        return self._pool

    @pool.setter
    def pool(self, slots: dict[str, torch.Tensor]) -> None:
        self._pool = slots

    def _add(self, slots: dict[str, torch.Tensor]) -> None:
        """Add new level-0 slots {positions, row, instance, token} (to the pool at its next read)."""
        self.references.index_add_(0, slots["token"], torch.ones_like(slots["token"], dtype=self.references.dtype))
        level = torch.zeros_like(slots["row"])
        self.added.append(slots | {"level": level, "log_weight": level.float(), "order": self._stamp(slots["positions"])})

    def _group_ids(self) -> torch.Tensor:
        """Group id (row · _INSTANCES + instance) · _LEVELS + level of every slot [S]."""
        pool = self.pool
        return (pool["row"] * _INSTANCES + pool["instance"]) * _LEVELS + pool["level"]

    def _groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(group id of each (row, instance, level) present [U], index of each slot's group [S], slots per group [U])."""
        return torch.unique(self._group_ids(), return_inverse=True, return_counts=True)

    def _cascade(self, scale: float) -> None:
        """The paper's Alg. 4 lines 11-17: up to `cascade_rounds` rounds (None: until no level is full) halving every full level.

        A level left full is halved after the next batch (slack > 0: at the next `_reduce`), together
        with the other halvings then. Slots are counted over every possible group id (a bincount, no sort).
        """
        rounds, done = self.method.cascade_rounds, 0
        while rounds is None or done < rounds:
            group = self._group_ids()
            counts = torch.bincount(group, minlength=self.shape[0] * self.shape[1] * _INSTANCES * _LEVELS)
            take = self._cascade_take(counts)
            if not bool(take.any()):
                return
            self._halve_groups(group, counts, take, scale, self.method.stream_batch)
            done += 1

    def _cascade_take(self, counts: torch.Tensor) -> torch.Tensor:
        """Slots [G] a cascade round halves in each group id (counts [G] over every id): the oldest t of a
        level below the top holding t or more; with slack > 0 every whole multiple of t it holds (the batches that waited)."""
        batch, top = self.method.stream_batch, self.method.levels
        full = counts.view(-1, _LEVELS) >= batch
        full[:, _MERGED if top is None else top :] = False
        return torch.where(full.view(-1), counts // batch * batch if self.slack_slots else batch, 0)

    def _enforce_budget(self, scale: float) -> None:
        """Forced halvings until every head holds at most `budget` slots (`_forced_take`; a head over it with no
        level of two or more slots merges its two lightest slots instead); `held` is then the fullest head's slots."""
        rows = self.shape[0] * self.shape[1]
        while True:
            excess = torch.bincount(self.pool["row"], minlength=rows) - self.budget
            most = int(excess.max())
            if most <= 0:
                self.held = self.budget + most
                return
            groups, inverse, counts = self._groups()
            head = groups // (_INSTANCES * _LEVELS)
            halvable = (counts >= 2) & (groups % _LEVELS != _MERGED)
            stuck = (excess > 0) & (torch.bincount(head[halvable], minlength=rows) == 0)
            if bool(stuck.any()):
                self._merge_singletons(stuck)
                continue
            self._halve_groups(inverse, counts, self._forced_take(groups, counts, excess), scale)
            self._cascade(scale)

    def _forced_take(self, groups: torch.Tensor, counts: torch.Tensor, excess: torch.Tensor) -> torch.Tensor:
        """Slots [U] each group halves: a head over budget by excess[head] > 0 slots (excess [B·H]) halves the
        oldest slots of its fullest levels (ties: the lighter level first), just enough to free that many
        (the last level chosen halves only part of its slots); groups [U] group ids, counts [U] their slots.
        """
        rows = excess.shape[0]
        head = groups // (_INSTANCES * _LEVELS)
        halvable = (counts >= 2) & (groups % _LEVELS != _MERGED)
        freed = torch.where(halvable & (excess[head] > 0), counts // 2, 0)
        order = torch.argsort(groups % _LEVELS, stable=True)
        order = order[torch.argsort(-counts[order], stable=True)]
        order = order[torch.argsort(head[order], stable=True)]
        freed_sorted, head_sorted = freed[order], head[order]
        before = torch.cumsum(freed_sorted, 0) - freed_sorted
        head_start = torch.zeros(rows, dtype=before.dtype, device=before.device)
        head_start = head_start.scatter_reduce(0, head_sorted, before, "amin", include_self=False)
        remaining = (excess[head_sorted] - (before - head_start[head_sorted])).clamp_min(0)
        take_sorted = 2 * torch.minimum(freed_sorted, remaining)
        return torch.zeros_like(take_sorted).scatter_(0, order, take_sorted)

    def _reduce(self, scale: float) -> None:
        """The pending halvings: cascade rounds over every level (with slack > 0, all waiting batches at once),
        then, when a head may hold more than `budget`, forced halvings down to it."""
        self._cascade(scale)
        if self.held > self.budget:
            self._enforce_budget(scale)

    def _halve_groups(self, inverse: torch.Tensor, counts: torch.Tensor, take: torch.Tensor, scale: float, same_take: int | None = None) -> None:
        """Halve the oldest take[u] (even) slots of every group u with take > 0 into the next level, in one batch.

        same_take: the number every chosen group halves when the caller knows it (the cascade's t;
        None: read from take). With slack = 0 each group is one row of the walk, padded to the
        largest take; with slack > 0 each group's take is split into rows of t slots (the last one
        shorter), so the many batches a group may halve at once are not padded to one width. When
        every row holds the same number, no halving block holds padding. The walk uses the value
        kernel of the paper's Alg. 2.
        """
        pool = self.pool
        chosen = take > 0
        members = chosen[inverse].nonzero().squeeze(1)  # slots of the chosen groups, sorted by (group, age) below
        by_age = members[torch.argsort(pool["order"][members], stable=True)]
        ordered = by_age[torch.argsort(inverse[by_age], stable=True)]
        sizes, takes = counts[chosen], take[chosen]
        starts = torch.cumsum(sizes, 0) - sizes
        if self.slack_slots:
            row = self.method.stream_batch
            pieces = -(-takes // row)
            group = torch.repeat_interleave(pieces)
            piece = torch.arange(len(group), device=group.device) - (torch.cumsum(pieces, 0) - pieces)[group]
            starts = starts[group] + piece * row
            takes = (takes[group] - piece * row).clamp_max(row)
        lengths, width = None, same_take
        if same_take is None:
            lengths = takes
            shortest, width = torch.stack(torch.aminmax(lengths)).tolist()
            if shortest == width:  # every row halves the same number: no padding
                lengths = None
        offsets = torch.arange(width, device=sizes.device)
        slot = ordered[(starts[:, None] + offsets).clamp_max(len(ordered) - 1)]
        token = pool["token"][slot]
        keys = self.keys.index_select(0, token.reshape(-1)).view(*token.shape, self.keys.shape[-1])
        values = self.values.index_select(0, token.reshape(-1)).view(*token.shape, self.values.shape[-1])
        keep, fails = halve_mask(keys, values, lengths, scale, self.method, self.method.stream_block, "value", self.generator)
        self.fail_events += fails
        if lengths is not None:
            valid = offsets < lengths[:, None]
            keep, slot = keep[valid], slot[valid]
        promoted = slot[keep]
        pool["level"][promoted] += 1
        pool["log_weight"][promoted] += LOG2
        pool["order"][promoted] = self._stamp(pool["positions"][promoted])
        self._remove(slot[~keep])

    def _remove(self, slots: torch.Tensor) -> None:
        """Drop the pool slots at indices `slots`; buffer rows no slot refers to any more become free."""
        token = self.pool["token"][slots]
        self.references.index_add_(0, token, torch.full_like(token, -1, dtype=self.references.dtype))
        self.free = torch.cat([torch.unique(token[self.references[token] == 0]), self.free])
        alive = torch.ones_like(self.pool["row"], dtype=torch.bool).index_fill_(0, slots, False).nonzero().squeeze(1)
        self.pool = {name: t.index_select(0, alive) for name, t in self.pool.items()}

    def _merge_singletons(self, heads: torch.Tensor) -> None:
        """One slot fewer in every head where heads [B·H] is True: its two lightest slots become one,
        slot i (weight w_i) kept with probability w_i / (w_1 + w_2) at weight w_1 + w_2, in log space, at level _MERGED."""
        pool = self.pool
        rows = heads.shape[0]
        by_weight = torch.argsort(pool["log_weight"], stable=True)
        ordered = by_weight[torch.argsort(pool["row"][by_weight], stable=True)]
        counts = torch.bincount(pool["row"], minlength=rows)
        starts = torch.cumsum(counts, 0) - counts
        first = ordered[starts.clamp_max(len(ordered) - 1)][heads]
        second = ordered[(starts + 1).clamp_max(len(ordered) - 1)][heads]
        merged_weight = torch.logaddexp(pool["log_weight"][first], pool["log_weight"][second])
        draw = torch.rand(first.shape, generator=self.generator, device=self.generator.device, dtype=torch.float32).to(first.device)
        keep_first = draw < torch.exp(pool["log_weight"][first] - merged_weight)
        kept, dropped = torch.where(keep_first, first, second), torch.where(keep_first, second, first)
        pool["log_weight"][kept] = merged_weight
        pool["level"][kept] = _MERGED
        pool["order"][kept] = self._stamp(pool["positions"][kept])
        self._remove(dropped)

    def kv_tensors(self) -> list[torch.Tensor]:
        """The key/value buffers (rows no slot refers to included) and the exact outliers' keys and values."""
        tensors = [self.keys, self.values] if self.keys is not None else []
        return tensors + ([self.outliers.keys, self.outliers.values] if self.outliers is not None else [])

    def set_kv_tensors(self, tensors: list[torch.Tensor]) -> None:
        given = iter(tensors)
        if self.keys is not None:
            self.keys, self.values = next(given), next(given)
        if self.outliers is not None:
            self.outliers = replace(self.outliers, keys=next(given), values=next(given))

    def nbytes(self) -> int:
        """KV bytes: the key/value buffers as allocated (see `_store`); the slot metadata is bookkeeping."""
        outliers = self.outliers.exact().nbytes() if self.outliers is not None else 0
        if self.pool is None:
            return outliers
        return outliers + sum(t.numel() * t.element_size() for t in (self.keys, self.values))

    def summary(self) -> KVSummary | None:
        outliers = self.outliers.exact() if self.outliers is not None else None
        if self.pool is None:
            return outliers
        if outliers is None:
            return KVSummary(*self._stack())
        both = concat([outliers, KVSummary(*self._stack())])
        order = both.positions.argsort(dim=-1)  # padding (position -1) first, then position order
        return KVSummary(*_gather(order, both.keys, both.values, both.log_weights, both.positions))

    def _stack(self) -> tuple[torch.Tensor, ...]:
        """The slots as [B, H, m, ·] tensors in position order; padding has log-weight -inf and position -1; with the method's
        weighted=False every kept slot log-weight 0 (plain eviction, as one-shot)."""
        keys, values, log_weights, positions = self._stack_weighted()
        if not self.method.weighted:
            log_weights = torch.where(torch.isfinite(log_weights), 0.0, log_weights)
        return keys, values, log_weights, positions

    def _stack_weighted(self) -> tuple[torch.Tensor, ...]:
        """`_stack` with each slot's log-weight (number of halvings)·log 2."""
        b, h = self.shape
        pool = self.pool
        order = torch.argsort(pool["row"] * (1 << 40) + pool["positions"])
        pool = {name: t[order] for name, t in pool.items()}
        counts = torch.bincount(pool["row"], minlength=b * h)
        width = int(counts.max())
        rank = torch.arange(len(order), device=order.device) - (torch.cumsum(counts, 0) - counts)[pool["row"]]
        key_t, value_t = self.template

        def scatter(values: torch.Tensor, fill: float) -> torch.Tensor:
            out = torch.full((b * h, width, *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
            out[pool["row"], rank] = values
            return out.reshape(b, h, width, *values.shape[1:])

        log_weights = pool["log_weight"]
        return (scatter(self.keys[pool["token"]], 0.0).to(key_t.dtype), scatter(self.values[pool["token"]], 0.0).to(value_t.dtype),
                scatter(log_weights, float("-inf")), scatter(pool["positions"], -1))
