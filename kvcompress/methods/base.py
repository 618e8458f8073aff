"""The two compressor shapes, the method registry and the shared sink/window handling (DESIGN.md §2, §6).

A method is a dataclass whose fields are its parameters. It sees only the compressible middle of
a layer (sink and window are handled here, the same way for every method) as a `Tokens` bundle,
and must honour `budget`: at most `budget` slots per head in what it returns.

- One-shot: `Method.compress(tokens, budget, generator) -> KVSummary`.
- Streaming: `Method.new_stream(budget, generator, slack) -> StreamState` with `absorb(tokens)`,
  `summary()` and `compact()`. A method that is natively one-shot streams block-wise
  (`BlockwiseState`): tokens are buffered and compressed back to `budget` once the buffer passes
  budget + ceil(slack·budget) slots, so at most budget + ceil(slack·budget) + block slots are
  stored and the total work stays linear in the stream length. A natively streaming method
  (Express, SubGen) holds at most `budget` by construction and never re-compresses
  (`recompresses` False: slack does not apply to it); ClusterGen's native stream lets completed
  runs wait up to ceil(slack·budget) tokens before traversing them, BalanceKV's lets new slots wait
  until a head may pass budget + ceil(slack·budget) before halving them all at once (both
  `recompresses` True). A
  natively streaming method's one-shot `compress` runs its stream over the tokens.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace
from typing import Callable, ClassVar

import torch

from ..attention import visible_slots
from ..checks import as_count, as_fraction, check_finite, check_queries, check_same_device, check_tensor, describe
from ..summary import KVSummary, _GrowingSlots, concat, gather_slots, take_slots

_REGISTRY: dict[str, type["Method"]] = {}

# Default re-compression slack of block-wise streams (fraction of the budget held beyond it before
# re-compressing): benchmarks/results/bench/streams3 (docs/bench.md, "Streams") measures time and
# peak memory against it.
DEFAULT_SLACK = 0.5


def check_slack(slack) -> float:
    """The re-compression slack of a block-wise stream: a finite number >= 0, as a Python float."""
    if isinstance(slack, bool) or not isinstance(slack, numbers.Real) or not math.isfinite(slack) or slack < 0:
        raise ValueError(
            f"slack must be a finite number >= 0 (extra slots a block-wise stream holds before re-compressing, "
            f"as a fraction of budget; 0 re-compresses after every block), got {slack!r}"
        )
    return float(slack)


@dataclass
class Tokens:
    """Exact tokens handed to a method.

    keys [B,H_kv,n,d] (post-RoPE), values [B,H_kv,n,d_v], positions [B,H_kv,n] (int64),
    queries [B,H_q,n_q,d] or None (the most recent queries seen with these tokens, post-RoPE),
    pre_rope_keys [B,H_kv,n,d] or None, scale (attention scale s), layer_idx / num_layers when
    called from a model (PyramidKV uses them), query_positions [n_q] (original positions of the
    queries, for causal scoring; None means the queries follow every token), exact_keys
    [B,H_kv,m,d] / exact_positions [B,H_kv,m]: the tokens kept exactly beside these (sink and
    window), which share the queries' softmax with them (None: no such tokens).
    attention_mass [B,H_kv,n] float32 or None: the mass each token received from the queries, as
    `attention_mass(tokens)` would compute it, when the model's own attention computed it as a
    by-product (`integration.attention.causal_attention_with_mass`); `slice` and `cat_tokens`
    carry it along, anything that selects tokens otherwise must drop or select it too.
    unrotate: a function (keys [B,H_kv,m,d], positions [B,H_kv,m]) -> pre-RoPE keys, given by a cache
    that can invert its model's rotation; a stream then stores no pre-RoPE keys and `pre_rope()`
    computes them when a method needs them.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    queries: torch.Tensor | None = None
    pre_rope_keys: torch.Tensor | None = None
    scale: float = 1.0
    layer_idx: int | None = None
    num_layers: int | None = None
    query_positions: torch.Tensor | None = None
    exact_keys: torch.Tensor | None = None
    exact_positions: torch.Tensor | None = None
    attention_mass: torch.Tensor | None = None
    unrotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def slice(self, start: int, stop: int) -> "Tokens":
        """Tokens start:stop along the token axis (queries kept as they are)."""
        pre = self.pre_rope_keys[:, :, start:stop] if self.pre_rope_keys is not None else None
        mass = self.attention_mass[:, :, start:stop] if self.attention_mass is not None else None
        return replace(
            self,
            keys=self.keys[:, :, start:stop],
            values=self.values[:, :, start:stop],
            positions=self.positions[:, :, start:stop],
            pre_rope_keys=pre,
            attention_mass=mass,
        )

    def exact(self) -> KVSummary:
        return KVSummary.exact(self.keys, self.values, self.positions)

    def select(self, index: torch.Tensor, keys_values: bool = True) -> "Tokens":
        """The tokens at `index` [B,H,k] of each head. A given attention mass is dropped: it was normalised
        over all the tokens, so a later score method computes the subset's own. keys_values=False (for a
        method whose `reads_keys_values` is False): keys and values are empty [B,H,k,0] placeholders."""
        pre = take_slots(self.pre_rope_keys, index) if self.pre_rope_keys is not None else None
        if keys_values:
            keys, values = take_slots(self.keys, index), take_slots(self.values, index)
        else:
            keys, values = self.keys.new_empty((*index.shape, 0)), self.values.new_empty((*index.shape, 0))
        return replace(self, keys=keys, values=values, positions=take_slots(self.positions, index), pre_rope_keys=pre, attention_mass=None)

    def pre_rope(self) -> torch.Tensor | None:
        """Pre-RoPE keys [B,H_kv,n,d]: the given ones, else computed by `unrotate` (None without either)."""
        if self.pre_rope_keys is not None or self.unrotate is None:
            return self.pre_rope_keys
        return self.unrotate(self.keys, self.positions)


def cat_tokens(parts: list[Tokens]) -> Tokens:
    """Concatenate token bundles along the token axis; queries from the last part; pre-RoPE keys and
    attention mass when every part has them (else None)."""
    last = parts[-1]
    pre = mass = None
    if all(p.pre_rope_keys is not None for p in parts):
        pre = torch.cat([p.pre_rope_keys for p in parts], 2)
    if all(p.attention_mass is not None for p in parts):
        mass = torch.cat([p.attention_mass for p in parts], 2)
    return replace(
        last,
        keys=torch.cat([p.keys for p in parts], 2),
        values=torch.cat([p.values for p in parts], 2),
        positions=torch.cat([p.positions for p in parts], 2),
        pre_rope_keys=pre,
        attention_mass=mass,
    )


class StreamState(ABC):
    """Per-layer streaming state of one method over the compressible middle."""

    recompresses: ClassVar[bool] = False  # True: buffers tokens past the budget by a slack, then re-compresses
    # True: holds every token exactly while at most `budget` were absorbed (else `Stream` holds them until then)
    exact_within_budget: ClassVar[bool] = False

    @abstractmethod
    def absorb(self, tokens: Tokens) -> None:
        """Take the next tokens leaving the exact window."""

    @abstractmethod
    def summary(self) -> KVSummary | None:
        """The current summary (None before any token)."""

    def compact(self) -> None:
        """Bring what is held down to the budget now (a state that never holds more does nothing)."""

    def nbytes(self) -> int:
        """KV bytes the state stores (keys, values and other key copies, including any workspace kept between updates)."""
        s = self.summary()
        return s.nbytes() if s is not None else 0


@dataclass
class Method:
    """Base of every registered method. Subclasses are dataclasses; their fields are parameters."""

    name: ClassVar[str] = ""
    needs_queries: ClassVar[bool] = False
    needs_pre_rope_keys: ClassVar[bool] = False
    needs_attention_mass: ClassVar[bool] = False  # scores with attention_mass(tokens) of every query: a prefill computes it fused
    # False when keep_index (and score) read neither tokens.keys nor tokens.values: a composition
    # (the hybrid) then hands it placeholders instead of gathering them
    reads_keys_values: ClassVar[bool] = True
    randomized: ClassVar[bool] = False  # draws from the generator: the seed changes the summary
    default_sink: ClassVar[int] = 4
    default_window: ClassVar[int] = 64

    def compress(self, tokens: Tokens, budget: int, generator: torch.Generator) -> KVSummary:
        """One-shot: summarise `tokens` in at most `budget` slots per head (this default runs the method's stream once over them)."""
        state = self.new_stream(budget, generator)
        state.absorb(tokens)
        state.compact()
        return state.summary()

    def new_stream(self, budget: int, generator: torch.Generator, slack: float = DEFAULT_SLACK) -> StreamState:
        """Streaming: a fresh state holding at most budget + ceil(slack·budget) slots per head between updates
        (`BlockwiseState`; a native state that never holds more than `budget` ignores slack: its
        `recompresses` is False)."""
        return BlockwiseState(self, budget, generator, slack)

    def keep_index(self, tokens: Tokens, budget: int, generator: torch.Generator) -> torch.Tensor | None:
        """[B,H,k]: ascending indices into `tokens` of the plain tokens `compress` keeps (k <= budget per head),
        for a caller that selects the tokens itself (the hybrid); None when `compress` keeps weighted slots
        (log-weights or a normalizer). This default compresses and finds the kept positions; a score
        method returns its top-k without gathering the tokens."""
        summary = self.compress(tokens, budget, generator)
        if summary.normalizer is not None or not bool((summary.log_weights == 0).all()):
            return None
        return _positions_index(tokens.positions, summary.positions)

    def check_inputs(self, tokens: Tokens) -> None:
        """Raise a clear error when the method's required inputs are missing."""
        if self.needs_queries and tokens.queries is None:
            raise ValueError(f"method {self.name!r} scores tokens with queries: pass queries=[B, H_q, n_q, d]")
        if self.needs_pre_rope_keys and tokens.pre_rope_keys is None and tokens.unrotate is None:
            raise ValueError(f"method {self.name!r} scores pre-RoPE keys: pass pre_rope_keys=[B, H_kv, n, d]")


class ScoreMethod(Method, ABC):
    """A score-then-top-k method: subclasses implement `score`; the top `budget` per head are kept."""

    @abstractmethod
    def score(self, tokens: Tokens, generator: torch.Generator) -> torch.Tensor:
        """[B, H_kv, n] importance of each token (higher is kept)."""

    def compress(self, tokens: Tokens, budget: int, generator: torch.Generator) -> KVSummary:
        if tokens.length <= budget:
            return tokens.exact()
        return keep_top(tokens, self.score(tokens, generator), budget)

    def keep_index(self, tokens: Tokens, budget: int, generator: torch.Generator) -> torch.Tensor | None:
        if type(self).compress is not ScoreMethod.compress:  # a subclass that keeps otherwise (e.g. KeyDiff's blocks)
            return super().keep_index(tokens, budget, generator)
        if tokens.length <= budget:
            return torch.arange(tokens.length, device=tokens.positions.device).expand(tokens.positions.shape)
        return top_index(self.score(tokens, generator), budget)


def first_true(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Indices [..., count] of the first `count` True entries of mask [..., n] (ascending)."""
    return torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[..., :count]


def top_index(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """[B,H,budget]: the indices of the `budget` highest scores [B,H,n] per head, in ascending (original) order."""
    return scores.float().topk(budget, dim=-1).indices.sort(dim=-1).values


def keep_top(tokens: Tokens, scores: torch.Tensor, budget: int) -> KVSummary:
    """Keep the `budget` highest-scoring tokens per head, in their original order, with log-weight 0.

    scores [B,H,n] may contain -inf for tokens that must go.
    """
    index = top_index(scores, budget)
    keys, values, positions = gather_slots(tokens.keys, tokens.values, tokens.positions, index)
    return KVSummary(keys, values, torch.zeros(positions.shape, device=keys.device), positions)


class BlockwiseState(StreamState):
    """Block-wise streaming of a one-shot method with amortised re-compression.

    Blocks are appended in place to a buffer (no copy of what is held); once it holds more than
    limit + ceil(slack·budget) slots (limit = budget, or what the method kept last time when it
    keeps more, as PyramidKV's lower layers do), the method compresses everything held back to
    `budget`. So between updates the state holds at most budget + ceil(slack·budget) slots per
    head, `peak_slots` (the buffer a re-compression scores) is at most
    budget + ceil(slack·budget) + block, and each token takes part in about 1 + 1/slack
    re-compressions: total work is linear in the stream length even when budget grows with it.
    slack=0 re-compresses after every block (KeyDiff's block prompt processing, seed 004 Eq. 6:
    peak budget + block). `compact()` re-compresses now, so the state holds `budget`.
    The buffer never allocates more slots than the tokens it has absorbed, so it never holds more
    than a full cache of the same tokens would.
    A method that keeps weighted slots (Random and ClusterGen with weighted=True) compresses the
    held tokens as if each stood for one token; a kept slot's weight is then its held weight times
    the method's, scaled so the weights still sum to the tokens absorbed (as one-shot's do).
    """

    recompresses = True
    exact_within_budget = True

    def __init__(self, method: Method, budget: int, generator: torch.Generator, slack: float = DEFAULT_SLACK):
        self.method, self.budget, self.generator = method, budget, generator
        self.slack_slots = math.ceil(check_slack(slack) * budget)
        self.limit = budget
        self.slots = _GrowingSlots()
        self.last: Tokens | None = None
        self.peak_slots = 0
        self.seen = 0
        self.log_weights: torch.Tensor | None = None  # [B,H,held] once a re-compression kept weighted slots

    def most_slots(self) -> int:
        """The most slots the buffer may allocate: the tokens absorbed so far (what a full cache would hold)."""
        return self.seen

    def columns(self, tokens: Tokens) -> tuple[torch.Tensor, ...]:
        """The per-token tensors [B,H,n,...] stored (`token_columns`)."""
        return token_columns(tokens)

    def absorb(self, tokens: Tokens) -> None:
        self.seen += tokens.length
        room = self.limit + self.slack_slots + tokens.length  # what the buffer can hold before a re-compression
        append_columns(self.slots, self.columns(tokens), reserve=room, most=min(room, self.most_slots()))
        if self.log_weights is not None:
            self.log_weights = torch.cat([self.log_weights, self.log_weights.new_zeros(tokens.positions.shape)], -1)
        self.last = tokens
        self.peak_slots = max(self.peak_slots, self.slots.length)
        if self.slots.length > self.limit + self.slack_slots:
            self.recompress(room=self.slack_slots + tokens.length)

    def held(self) -> Tokens:
        """Every token held, with the latest block's queries and exact neighbours."""
        held = tokens_from_columns(self.last, self.slots.view())
        return replace(held, pre_rope_keys=held.pre_rope()) if self.method.needs_pre_rope_keys else held

    def keep(self, held: Tokens) -> tuple[torch.Tensor, ...]:
        """The stored columns of the tokens the method keeps from `held` (more than budget)."""
        summary = self.method.compress(held, self.budget, self.generator)
        extra = self.slots.view()[3:]
        weighted = self.log_weights is not None or not bool((summary.log_weights == 0).all())
        index = _positions_index(held.positions, summary.positions) if extra or weighted else None
        if weighted:
            before = self.log_weights if self.log_weights is not None else torch.zeros(held.positions.shape, device=held.keys.device)
            kept = take_slots(before, index) + summary.log_weights
            self.log_weights = kept + (before.logsumexp(-1) - kept.logsumexp(-1)).unsqueeze(-1)
        return (summary.keys, summary.values, summary.positions, *(take_slots(t, index) for t in extra))

    def recompress(self, room: int) -> None:
        """Compress what is held back to the budget (when above it), into a buffer with `room` more slots reserved."""
        if self.slots.length <= self.budget:
            return
        kept = self.keep(self.held())
        self.limit = max(self.budget, kept[0].shape[2])
        self.slots = _GrowingSlots()
        slots = min(self.limit + room, self.most_slots()) if room else kept[0].shape[2]  # compact(): exactly what is kept
        self.slots.append(kept, reserve=slots, most=slots)

    def compact(self) -> None:
        """Compress to the budget now, into a buffer sized for what is kept (e.g. at the end of a prompt:
        the room reserved for further blocks is given back)."""
        if self.slots.length > self.budget:
            self.recompress(room=0)
        elif self.slots.tensors:
            held = self.slots.view()
            self.slots = _GrowingSlots()
            self.slots.append(held, most=held[0].shape[2])

    def summary(self) -> KVSummary | None:
        if self.last is None:
            return None
        held = self.held()
        return held.exact() if self.log_weights is None else KVSummary(held.keys, held.values, self.log_weights, held.positions)

    def nbytes(self) -> int:
        """KV bytes of the buffer as allocated (its room for the next blocks included): keys, values and any
        stored pre-RoPE keys, never more than the tokens absorbed so far would take."""
        return self.slots.kv_bytes()


def token_columns(tokens: Tokens) -> tuple[torch.Tensor, ...]:
    """The per-token tensors [B,H,n,...] a stream stores: keys, values, positions, and pre-RoPE keys when given
    (not when `tokens.unrotate` can recompute them)."""
    base = (tokens.keys, tokens.values, tokens.positions)
    return base if tokens.pre_rope_keys is None or tokens.unrotate is not None else (*base, tokens.pre_rope_keys)


def append_columns(slots: _GrowingSlots, columns: tuple[torch.Tensor, ...], **allocation) -> None:
    """Append a block's `token_columns` (plus any extra ones) to a buffer (`_GrowingSlots.append` options)."""
    if slots.tensors and len(columns) != len(slots.tensors):
        raise ValueError("a stream's updates must all pass pre_rope_keys or all leave them out")
    slots.append(columns, **allocation)


def tokens_from_columns(last: Tokens, columns: tuple[torch.Tensor, ...]) -> Tokens:
    """The tokens whose `token_columns` (and extra columns after them) are `columns`, with the latest
    block's queries and exact neighbours (`last`)."""
    keys, values, positions, *extra = columns
    pre = extra[0] if last.pre_rope_keys is not None and last.unrotate is None else None
    return replace(last, keys=keys, values=values, positions=positions, pre_rope_keys=pre)


def query_positions_for(queries: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor | None:
    """Positions of queries that came with tokens at `positions` [B,H,n]: the last n_q of them (None if n_q > n)."""
    if queries is None or queries.shape[2] > positions.shape[2]:
        return None
    return positions[0, 0, positions.shape[2] - queries.shape[2] :]


AVERAGES = ("group", "layer")


def attention_mass(tokens: Tokens, last: int | None = None, average: str = "group", max_logits: int = 1 << 22) -> torch.Tensor:
    """[B, H_kv, n]: softmax attention of the (last `last`) queries on the tokens, summed over queries.

    The softmax runs over every key the queries see: the tokens and `tokens.exact_keys` (the sink
    and window kept exactly), as attention itself does; queries see only keys at or before their
    own position when `query_positions` is known. average: "group" means over the query heads of
    each KV head (GQA group); "layer" means over every query head of the layer, the same score for
    each KV head. Queries go in chunks of at most `max_logits` scores (16 MiB of float32 by default:
    on one CPU thread, 1.35-1.65x faster than 4 MiB chunks at the Llama-8B-like shape, whose 32
    query heads leave only a few queries per 4 MiB chunk, and within about 20 % of the best of
    4-32 MiB at every shape tried) at the model's scale
    `tokens.scale` (one exponential per score, no softmax tensor beyond one chunk; the max shift
    is skipped when every logit is bounded well inside float32's exponent range).
    """
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {AVERAGES}, got {average!r}")
    queries, qpos = tokens.queries, tokens.query_positions
    if last is not None:
        queries = queries[:, :, -last:]
        qpos = qpos[-last:] if qpos is not None else None
    b, hq, nq, d = queries.shape
    hkv = tokens.keys.shape[1]
    group = hq // hkv
    keys = tokens.keys.float()
    exact_keys = tokens.exact_keys.float() if tokens.exact_keys is not None else keys.new_zeros(b, hkv, 0, d)
    exact_pos = tokens.exact_positions if tokens.exact_keys is not None else tokens.positions[:, :, :0]
    q = (queries.float() * tokens.scale).reshape(b, hkv, group, nq, d).transpose(2, 3)  # [B, H_kv, n_q, group, d]
    mass = torch.zeros(b, hkv, tokens.length, device=keys.device)
    # |logit| <= ‖q‖·max‖k‖ (Cauchy-Schwarz): below 80, and below 88 - ln(keys) so that a row's total of
    # n exponentials cannot overflow either, every exp stays finite and non-zero in float32 and the
    # per-query max shift can be skipped.
    norms = [k.norm(dim=-1).amax() for k in (keys, exact_keys) if k.shape[2]]  # no copy of the keys
    key_norm = torch.stack(norms).amax() if norms else keys.new_zeros(())
    bounded = float(q.norm(dim=-1).amax() * key_norm) < min(80.0, 88.0 - math.log(max(1, tokens.length + exact_keys.shape[2])))
    chunk = max(1, max_logits // max(1, b * hq * (tokens.length + exact_keys.shape[2])))
    for start in range(0, nq, chunk):
        qc = q[:, :, start : start + chunk]
        c = qc.shape[2]
        qp = qpos[start : start + chunk].to(keys.device) if qpos is not None else None
        n = visible_slots(tokens.positions, qp)
        rows = qc.reshape(b, hkv, c * group, d)
        logits = _masked_logits(rows, keys[:, :, :n], tokens.positions[:, :, :n], qp, group)
        exact_logits = _masked_logits(rows, exact_keys, exact_pos, qp, group)
        if not bounded:
            top = torch.maximum(_row_max(logits), _row_max(exact_logits)).clamp_min(torch.finfo(torch.float32).min).unsqueeze(-1)
            logits.sub_(top)
            exact_logits.sub_(top)
        total = logits.exp_().sum(-1) + exact_logits.exp_().sum(-1)
        inverse = torch.where(total > 0, total.reciprocal(), torch.zeros_like(total))
        mass[:, :, :n] += torch.matmul(inverse.unsqueeze(-2), logits).squeeze(-2)
    mass /= group
    if average == "layer":
        mass = mass.mean(dim=1, keepdim=True).expand(b, hkv, tokens.length)
    return mass


# Unshifted exponentials are trusted while every row's total lies within [2^-limit, 2^limit]; a
# model's logits lie far inside float32's range (within ±40 on the default model at 4k tokens).
TOTAL_LOG2_LIMIT = 100.0


def exp_rows_(logits: torch.Tensor, shifted: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax rows of logits [..., r, n], unnormalised and in place: (exp(logits − shift), the
    reciprocal of each row's total [..., r, 1], the largest |log2| of a total as a 0-d tensor).

    shift is each row's max if `shifted` (every total then lies in [1, n]), else 0: one pass fewer,
    exact while the totals stay within 2^±TOTAL_LOG2_LIMIT; `totals_in_range` tells the caller to
    redo the rows shifted otherwise (an overflow gives inf, NaN inputs NaN: both out of range).
    """
    if shifted:
        logits.sub_(logits.amax(-1, keepdim=True))
    probs = logits.exp_()
    inverse = probs.sum(-1, keepdim=True).reciprocal_()
    return probs, inverse, inverse.log2().abs_().amax()


def totals_in_range(total_range: torch.Tensor) -> bool:
    """Whether the largest |log2| of a row total from `exp_rows_` (NaN included) allows the unshifted rows (one host read)."""
    return bool(total_range < TOTAL_LOG2_LIMIT)


def _row_max(x: torch.Tensor) -> torch.Tensor:
    """Max over the last axis, -inf for an empty one."""
    return x.amax(-1) if x.shape[-1] else x.new_full(x.shape[:-1], float("-inf"))


def _masked_logits(rows: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, query_positions, group: int) -> torch.Tensor:
    """rows [B,H_kv,c*group,d] (query-major) x keys [B,H_kv,n,d] -> [B,H_kv,c*group,n], -inf where a key lies after its query.

    Positions ascend along the slot axis, so only the slots after the first query's position are masked.
    """
    logits = torch.matmul(rows, keys.transpose(-1, -2))
    if query_positions is not None and keys.shape[2]:
        start = int((positions <= query_positions.min()).sum(-1).min())
        hidden = positions[:, :, None, start:] > query_positions.repeat_interleave(group)[None, None, :, None]
        logits[..., start:].masked_fill_(hidden, float("-inf"))
    return logits


def _positions_index(all_positions: torch.Tensor, kept_positions: torch.Tensor) -> torch.Tensor:
    """Index into the token axis of `all_positions` [B,H,n] of each kept position [B,H,k] (both ascending)."""
    return torch.searchsorted(all_positions.contiguous(), kept_positions.contiguous())


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make a method available by its `name`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a `name`")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"method name {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def method_names() -> list[str]:
    return sorted(_REGISTRY)


def get_method_class(name: str) -> type[Method]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(method_names())}")
    return _REGISTRY[name]


def build_method(name: str, **params) -> Method:
    """Instantiate a registered method with its parameters, rejecting unknown ones by name."""
    cls = get_method_class(name)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"method {name!r} has no parameter(s) {unknown}; its parameters are {sorted(known)}")
    for f in fields(cls):
        if f.type in ("bool", bool) and f.name in params and not isinstance(params[f.name], bool):
            raise ValueError(
                f"method {name!r} parameter {f.name} must be True or False (on the command line: true or false), got {params[f.name]!r}"
            )
    return cls(**params)


def make_generator(seed: int | torch.Generator | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator from `seed`: an int seeds it (reproducible), None draws a fresh random seed (a different result each call), a Generator is used as is."""
    if isinstance(seed, torch.Generator):
        return seed
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(as_count("seed", seed, 0))
    return gen


def _smallest_context(kept_needed: int, compression_ratio: float) -> int:
    """Smallest n with ceil((1 - ratio)·n) >= kept_needed."""
    n = max(1, math.ceil(kept_needed / (1.0 - compression_ratio)) - 1)
    while math.ceil((1.0 - compression_ratio) * n - 1e-9) < kept_needed:
        n += 1
    return n


def smallest_stream_budget(method: "Method") -> int:
    """The smallest budget the method's streaming state accepts (1 for most; BalanceKV and Express need more)."""
    for budget in range(1, 65):
        try:
            method.new_stream(budget, torch.Generator())
        except ValueError:
            continue
        return budget
    raise ValueError(f"method {method.name!r} accepts no streaming budget up to 64")


def resolve_budget(
    n: int,
    budget: int | None,
    compression_ratio: float | None,
    sink: int,
    window: int,
    method: "Method | None" = None,
    streaming: bool = False,
) -> int:
    """Middle budget (slots per head, sink and window not counted) from exactly one of budget / ratio.

    compression_ratio is the fraction of all n tokens removed (kvpress convention): the layer keeps
    ceil((1 - ratio) * n) tokens, of which sink + window are exact, the rest is the middle budget.
    A ratio that would remove tokens but leaves no room beyond sink + window is an error naming
    the largest ratio and the smallest context that work (never a silent "keep everything").
    With `method` and streaming=True (chunked/decode generation), a middle budget below what the
    method's stream accepts is an error that says where the budget came from.
    """
    if (budget is None) == (compression_ratio is None):
        raise ValueError(
            f"pass exactly one of budget (tokens kept per head) or compression_ratio (fraction removed); got budget={budget!r}, compression_ratio={compression_ratio!r}"
        )
    if budget is not None:
        middle = as_count("budget", budget, 1)
        origin = f"budget={middle}"
    else:
        ratio = as_fraction("compression_ratio", compression_ratio, "the fraction of tokens removed")
        kept = math.ceil((1.0 - ratio) * n - 1e-9)
        middle = kept - sink - window
        origin = f"compression_ratio={ratio} of n={n} tokens (keeps {kept}: sink={sink} + window={window} exact, a middle budget of {middle})"
        if middle < 1 and kept < n:
            needed = sink + window + 1
            fixes = [f"a context of at least {_smallest_context(needed, ratio)} tokens", "a smaller sink/window"]
            if n >= needed:
                fixes.insert(0, f"compression_ratio <= {math.floor((1 - needed / n) * 1e4) / 1e4}")
            raise ValueError(
                f"compression_ratio={ratio} keeps {kept} of n={n} tokens, which does not leave room beyond sink={sink} + window={window} "
                f"(always kept exactly), so the ratio cannot be honoured; use " + ", or ".join(fixes)
            )
        middle = max(middle, 1)
    if streaming and method is not None:
        smallest = smallest_stream_budget(method)
        if middle < smallest:
            raise ValueError(f"{origin}: streaming {method.name} (chunked/decode mode) needs a middle budget >= {smallest} per KV head")
    return middle


def check_kv(keys, values, queries=None, pre_rope_keys=None, sync: bool = True) -> None:
    """Shape, dtype, device and finiteness checks of one layer's inputs, with errors that name the argument.

    sync=False: the finiteness check forces no host synchronisation off the CPU (see `check_finite`).
    """
    check_tensor("keys", keys, "[B, H_kv, n, d]", 4)
    check_tensor("values", values, "[B, H_kv, n, d_v]", 4)
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"keys and values must agree on [B, H_kv, n]; got keys {describe(keys)} and values {describe(values)}")
    check_same_device("values", values, "keys", keys)
    if keys.shape[2] == 0:
        raise ValueError(f"empty context: keys have no tokens (n = 0), got {describe(keys)}")
    if queries is not None:
        check_queries(queries, keys)
    if pre_rope_keys is not None:
        check_tensor("pre_rope_keys", pre_rope_keys, "[B, H_kv, n, d]", 4)
        if pre_rope_keys.shape != keys.shape:
            raise ValueError(f"pre_rope_keys must have the keys' shape {list(keys.shape)}, got {describe(pre_rope_keys)}")
        check_same_device("pre_rope_keys", pre_rope_keys, "keys", keys)
    for name, t in (("keys", keys), ("values", values), ("queries", queries), ("pre_rope_keys", pre_rope_keys)):
        if t is not None:
            check_finite(name, t, sync)


def check_positions(positions, keys: torch.Tensor, ordered: bool = True) -> None:
    """positions: integer tensor [n] or [B, H_kv, n] matching keys [B, H_kv, n, d]; `ordered`: also strictly increasing along the tokens (a device sync)."""
    b, h, n, _ = keys.shape
    if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or tuple(positions.shape) not in ((n,), (b, h, n)):
        raise ValueError(f"positions must be an integer tensor [n] = [{n}] or [B, H_kv, n] = [{b}, {h}, {n}], got {describe(positions)}")
    if ordered and n > 1 and not bool((positions.diff(dim=-1) > 0).all()):
        raise ValueError("positions must be strictly increasing along the tokens (the original index of each token, in order)")


def check_scale(scale) -> float | None:
    """The attention scale: None (1/sqrt(d)) or a finite number > 0, as a Python float."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale (the attention scale s) must be a finite number > 0 or None for 1/sqrt(d), got {scale!r}")
    return float(scale)


def check_sink_window(sink, window) -> tuple[int, int]:
    """(sink, window) as Python ints >= 0."""
    return as_count("sink", sink, 0), as_count("window", window, 0)


def split_exact(tokens: Tokens, sink: int, window: int) -> tuple[Tokens, Tokens, Tokens]:
    """(sink tokens, middle, window tokens) of a token bundle."""
    n = tokens.length
    head = min(sink, n)
    tail_start = max(head, n - window)
    return tokens.slice(0, head), tokens.slice(head, tail_start), tokens.slice(tail_start, n)


def compress_tokens(method: Method, tokens: Tokens, budget: int, sink: int, window: int, generator) -> KVSummary:
    """Sink and window exact, the middle compressed by `method` to at most `budget` slots per head."""
    head, middle, tail = split_exact(tokens, sink, window)
    parts = [head.exact()]
    if middle.length > budget:
        middle = replace(
            middle,
            exact_keys=torch.cat([head.keys, tail.keys], 2),
            exact_positions=torch.cat([head.positions, tail.positions], 2),
        )
        method.check_inputs(middle)
        parts.append(method.compress(middle, budget, generator))
    elif middle.length > 0:
        parts.append(middle.exact())
    parts.append(tail.exact())
    return concat([p for p in parts if p.num_slots > 0] or [parts[0]])


class Stream:
    """A method run as a stream, with the first `sink` tokens and the last `window` tokens exact.

    update() takes the next block of tokens (any size); tokens leaving the window are absorbed by
    the method's state. A natively streaming method (Express, SubGen) stores at most `budget`
    slots per head; ClusterGen's and BalanceKV's native streams hold at most budget +
    ceil(slack·budget) between updates. A block-wise one (every score method, Compactor, the hybrid's exact
    set) lets its buffer grow to budget + ceil(slack·budget) slots before compressing it back to
    `budget`, so its cost stays linear in the stream length: between updates it stores at most
    budget + ceil(slack·budget) slots, during one at most that plus the block. slack=None is
    DEFAULT_SLACK; slack=0 re-compresses after every block; an explicit slack for a method that
    never re-compresses is an error. compact() brings the state down to `budget` now (e.g. at the
    end of a prompt). summary() is sink + method summary + window.

    Every method streams exactly while it can: a state that is not exact by itself while it holds
    at most `budget` tokens (`StreamState.exact_within_budget`) gets the tokens leaving the window
    only once more than `budget` of them have left it (all at once), and they are held as they are
    until then. So at a budget of at least the tokens seen the summary is the exact input, for
    every method, and the buffer never allocates more slots than tokens have left the window.
    unrotate (from a cache that can invert its model's rotation, see `Tokens.unrotate`): pre-RoPE
    keys are computed from the keys when a method needs them, instead of passed and stored.
    """

    def __init__(self, method: Method, budget: int, sink: int, window: int, generator: torch.Generator, scale: float | None = None,
                 slack: float | None = None, unrotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        sink, window = check_sink_window(sink, window)
        budget = as_count("budget", budget, 1)
        self.method, self.budget, self.sink, self.window = method, budget, sink, window
        self.generator, self.scale = generator, check_scale(scale)
        self.state = method.new_stream(budget, generator, DEFAULT_SLACK if slack is None else check_slack(slack))
        if slack is not None and not self.state.recompresses:
            raise ValueError(
                f"slack={slack!r}: method {method.name!r} streams natively (at most budget slots, never re-compressed), "
                "so slack does not apply to it; leave slack unset"
            )
        self.unrotate = unrotate
        self.head: Tokens | None = None
        self.recent: Tokens | None = None
        # tokens that left the window, until more than budget did (then None); None from the start for a state exact by itself
        self.exact: _GrowingSlots | None = None if self.state.exact_within_budget else _GrowingSlots()
        self.exact_last: Tokens | None = None
        self.seen = 0
        self.layout: tuple | None = None  # (B, H_kv, d, d_v, dtype, device) of the first update

    def update(self, keys, values, queries=None, pre_rope_keys=None, positions=None, layer_idx=None, num_layers=None) -> None:
        """Take the next block: keys/values [B,H_kv,b,d]; queries [B,H_q,q,d]; positions [b] or [B,H_kv,b] (default: running count).

        Every update must have the first one's batch, KV heads, head dims, dtype and device. NaN or
        inf is a ValueError on the CPU and a device-side assertion elsewhere (no host sync per block).
        """
        check_kv(keys, values, queries, pre_rope_keys, sync=False)
        b, h, n, d = keys.shape
        layout = (b, h, d, values.shape[-1], keys.dtype, keys.device)
        if self.layout is None:
            self.layout = layout
        elif layout != self.layout:
            fb, fh, fd, fdv, fdtype, fdevice = self.layout
            raise ValueError(
                f"stream.update: keys {describe(keys)} / values {describe(values)} do not match the earlier updates: every update must have "
                f"batch {fb}, {fh} KV heads, key dim {fd}, value dim {fdv}, dtype {str(fdtype).removeprefix('torch.')}, device {fdevice}"
            )
        if positions is None:
            positions = torch.arange(self.seen, self.seen + n, device=keys.device)
        check_positions(positions, keys, ordered=False)  # shape only: no sync per streamed block
        positions = positions.to(device=keys.device, dtype=torch.long).expand(b, h, n)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(d)
        qpos = query_positions_for(queries, positions)
        block = Tokens(keys, values, positions, queries, pre_rope_keys, scale, layer_idx, num_layers, qpos, unrotate=self.unrotate)
        self.seen += n
        have = self.head.length if self.head is not None else 0
        take = min(self.sink - have, n)
        if take > 0:
            part = block.slice(0, take)
            self.head = part if self.head is None else cat_tokens([self.head, part])
            block = block.slice(take, n)
        if block.length == 0:
            return
        self.recent = block if self.recent is None or self.recent.length == 0 else cat_tokens([self.recent, block])
        overflow = self.recent.length - self.window
        if overflow > 0:
            staying = self.recent.slice(overflow, self.recent.length)
            exact = [p for p in (self.head, staying) if p is not None]
            leaving = replace(
                self.recent.slice(0, overflow), queries=queries, query_positions=qpos,
                exact_keys=torch.cat([p.keys for p in exact], 2), exact_positions=torch.cat([p.positions for p in exact], 2),
            )
            self.method.check_inputs(leaving)
            self._absorb(leaving)
            self.recent = staying

    def _absorb(self, leaving: Tokens) -> None:
        """Hold `leaving` exactly while at most `budget` tokens have left the window; past that, hand
        everything held, then each later block, to the method's state."""
        if self.exact is None:
            self.state.absorb(leaving)
            return
        append_columns(self.exact, token_columns(leaving), most=min(self.budget, self.exact.length + leaving.length))
        self.exact_last = leaving
        if self.exact.length > self.budget:
            held, self.exact = self.exact_tokens(), None
            self.state.absorb(held)

    def exact_tokens(self) -> Tokens:
        """The tokens held exactly, with the latest block's queries and exact neighbours."""
        return tokens_from_columns(self.exact_last, self.exact.view())

    def summary(self) -> KVSummary:
        parts = [p.exact() for p in (self.head,) if p is not None]
        middle = self.state.summary() if self.exact is None else (self.exact_tokens().exact() if self.exact.length else None)
        if middle is not None:
            parts.append(middle)
        if self.recent is not None and self.recent.length > 0:
            parts.append(self.recent.exact())
        if not parts:
            raise ValueError("the stream has seen no tokens yet")
        return concat(parts)

    def compact(self) -> None:
        """Compress the method's state down to `budget` slots per head now (a no-op for native streams
        and while the tokens are held exactly)."""
        if self.exact is None:
            self.state.compact()

    def nbytes(self) -> int:
        """KV bytes of the sink, the window and the middle (exact, or the method's state)."""
        exact = sum(p.exact().nbytes() for p in (self.head, self.recent) if p is not None)
        return exact + (self.state.nbytes() if self.exact is None else self.exact.kv_bytes())
