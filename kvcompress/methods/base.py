"""The two compressor shapes, the method registry and the shared sink/window handling.

docs/design.md, "Two shapes of compressor" and "Streams hold tokens exactly until they pass the budget".

A method is a dataclass whose fields are its parameters. It sees only the compressible middle of
a layer (sink and window are handled here, the same way for every method) as a `Tokens` bundle,
and must honour `budget`: at most `budget` slots per head in what it returns (a method with
budget scope "layer", AdaKV: H_kv·budget slots per batch row in all, shared out unevenly among the heads).

- One-shot: `Method.compress(tokens, budget, generator) -> KVSummary`.
- Streaming: `Method.new_stream(budget, generator, slack) -> StreamState` with `absorb(tokens)`,
  `summary()` and `compact()`. A stream stores at most `budget` slots per head (AdaKV's: H_kv·budget
  per batch row): its slack and the block being absorbed come out of the budget, not on top of it
  (`budget.stream_split`; PyramidKV's layers keep their share of it, more than the budget in the lower
  layers and less in the deeper ones, with the same room on top). A method that is natively one-shot streams block-wise
  (`BlockwiseState`): tokens are buffered until the buffer holds `budget` slots, and what is held is
  compressed back to the target, floor(budget / (1 + slack)), whenever the next tokens do not fit,
  so the total work stays linear in the stream length. A natively streaming method (Express,
  SubGen) holds at most `budget` by construction and never re-compresses (`stream_recompresses`
  False: a slack is refused); ClusterGen's native stream lets completed runs wait, in the room
  beside its target, before traversing them, BalanceKV's lets new slots wait until a head's pool
  is full before halving them all at once. A natively streaming method's one-shot `compress` runs
  its stream over the tokens.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

import torch

from ..checks import as_count
from ..quantization import QuantizedSlots, QuantizedTensor, check_kv_bits, quantize_rows
from ..saved_state import Count, Flag, Generator, Instance, Linked, Mapping, Maybe, Saveable, Sequence, Tensor, saved
from ..summary import KVSummary, _GrowingSlots, concat, gather_slots, take_slots
from .budget import DEFAULT_SLACK, check_slack, stream_split
from .requirements import Requirements
from .tokens import (
    Tokens,
    append_columns,
    positions_index,
    split_exact,
    token_columns,
    tokens_from_columns,
)


class StreamState(Saveable, ABC):
    """Per-layer streaming state of one method over the compressible middle. A state a saved cache can hold declares its
    fields (`saved_state.saved`)."""

    # True: holds every token exactly while at most `budget` were absorbed (else `Stream` holds them until then)
    exact_within_budget: ClassVar[bool] = False

    @abstractmethod
    def absorb(self, tokens: Tokens) -> None:
        """Take the next tokens leaving the exact window. A state storing its slots quantized (`quantized`) also
        takes codes=: the `QuantizedSlots` the tokens were dequantized from, whose codes their slots keep."""

    @abstractmethod
    def summary(self) -> KVSummary | None:
        """The current summary (None before any token)."""

    def summary_parts(self) -> list[KVSummary]:
        """`summary()` as the parts it concatenates, in slot order (none before any token): a caller that adds slots of
        its own concatenates once instead of twice (`ragged.concat_parts`: a part may be a packed `RaggedSummary`)."""
        summary = self.summary()
        return [] if summary is None else [summary]

    def compact(self) -> None:
        """End a run of absorbs now (e.g. at the end of a prompt): give back the room reserved for later tokens, or run
        the work that waits for them (ClusterGen's traversal). What is held is within the budget before and after; a
        state that reserves nothing does nothing."""

    def same_kind(self, other: "StreamState") -> bool:
        """Whether `other` (a saved state, its storage unwrapped: `unwrapped`) is a state of the kind this fresh one is."""
        return type(self) is type(unwrapped(other))

    def quantized(self, bits: int, group_size: int) -> "StreamState":
        """This state storing its keys and values in `bits` bits from now on (before its first token): a native
        stream is wrapped (`QuantizedState`); a block-wise one stores its buffer quantized (`BlockwiseState.quantized`)."""
        return QuantizedState(self, bits, group_size)

    def nbytes(self) -> int:
        """KV bytes the state stores (keys, values and other key copies, including any workspace kept between updates)."""
        s = self.summary()
        return s.nbytes() if s is not None else 0


@dataclass
class Method:
    """Base of every registered method. Subclasses are dataclasses; their fields are parameters.

    What a method needs to run (the inputs it reads beyond keys and values, the heads its budget is shared over,
    the modes it runs in) is one frozen value, `requirements` (`methods.requirements.Requirements`): a class
    attribute, or a property where it depends on the parameters (AdaKV's on its scorer). The cache and the model
    integration read it and nothing else of the method. The other class attributes say how the method behaves,
    for the methods layer and the tests: `randomized`, `reads_keys_values`, `stream_recompresses`,
    `keeps_a_layer_share`, `drops_within_budget`, and `default_sink` / `default_window`, the exact sink and window the
    method runs with when none is given: 4 and 64 here (a StreamingLLM sink and a recent window), which a method
    overrides where its paper or this library sets others (docs/methods.md lists every method's).
    """

    name: ClassVar[str] = ""
    requirements: ClassVar[Requirements] = Requirements()
    # False when keep_index (and score) read neither tokens.keys nor tokens.values: a composition
    # (the hybrid) then hands it placeholders instead of gathering them
    reads_keys_values: ClassVar[bool] = True
    randomized: ClassVar[bool] = False  # draws from the generator: the seed changes the summary
    default_sink: ClassVar[int] = 4
    default_window: ClassVar[int] = 64
    stream_recompresses: ClassVar[bool] = True  # False: the native stream never holds more than budget (no slack)
    # True when `compress` keeps a share of the budget that depends on the layer and averages the budget over the layers
    # (PyramidKV): a `BlockwiseState` then refills to what it kept, below its target in a layer that keeps less
    keeps_a_layer_share: ClassVar[bool] = False
    # True when the method drops tokens even within its budget (KVzap's threshold): it then runs on a middle that fits
    # its budget too (`compress_tokens`), and a stream hands it every token from the first (`Stream`)
    drops_within_budget: ClassVar[bool] = False
    # False when a stream of a batch lets one row change what another keeps (AdaKV's state pads every head of every row
    # to the longest head of the batch, and a scorer that reads every key of a head sees the padding): a stream then
    # takes one row at a time only (`methods.stream.batch_coupling`)
    stream_rows_apart: ClassVar[bool] = True

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "Method":
        """An instance from its parameters by name as plain values (what the command line, `CompressionOptions` and
        saved caches hold: numbers, strings, bools, lists, dicts), each name one of the dataclass fields. A method
        whose parameter is another method (AdaKV's scorer) overrides this to build that part from its name."""
        check_params(cls, params)
        return cls(**params)

    @property
    def queries_read(self) -> int | None:
        """How many of a block's latest queries the method's scores read (None: any number, every query given). A
        stream keeps only those of its latest block to score what it holds at its next re-compression
        (`Tokens.scoring_context`)."""
        return None

    def on_entry(self, tokens: Tokens) -> Tokens:
        """What a stream keeps of a block as it enters (before the sink, window and state see it): the block as it
        is. A method that scores each token from an input too large to keep (KVzap, from the hidden states) returns
        the block with its scores in `Tokens.entry_scores` instead of that input."""
        return tokens

    def compress(self, tokens: Tokens, budget: int, generator: torch.Generator) -> KVSummary:
        """One-shot: summarise `tokens` in at most `budget` slots per head (this default runs the method's stream once over them)."""
        state = self.new_stream(budget, generator)
        state.absorb(tokens)
        state.compact()
        return state.summary()

    def new_stream(self, budget: int, generator: torch.Generator, slack: float | None = None) -> StreamState:
        """Streaming: a fresh state storing at most `budget` slots per head at any time, its slack and the block
        being absorbed included (`BlockwiseState`); slack as `stream_slack` takes it."""
        return BlockwiseState(self, budget, generator, self.stream_slack(slack))

    def compress_held(self, tokens: Tokens, target: int, generator: torch.Generator) -> KVSummary:
        """What a block-wise stream (`BlockwiseState`) keeps of the tokens it holds at a re-compression: `compress`. A
        method whose layers keep shares of the budget (`keeps_a_layer_share`) keeps its layer's share of `target` here,
        whatever the layer holds, so that the layers' streams together keep L·target."""
        return self.compress(tokens, target, generator)

    def layer_budget(self, budget: int, layer_idx: int, middle_length: int | None) -> int:
        """The middle budget per KV head of layer `layer_idx`'s stream when `budget` is what the
        options give every layer and `middle_length` the middle tokens the stream will take (its tokens less the sink
        and window; None when unknown): `budget` itself, every layer the same. A method whose budget is one over every
        layer (budget scope "model") and that streams gives each layer its share of it (AdaKV over KVzap)."""
        return budget

    def stream_slack(self, slack: float | None) -> float:
        """The slack this method's stream runs with: `slack` checked (None: DEFAULT_SLACK). A method whose
        stream never holds more than its budget (`stream_recompresses` False) refuses any slack."""
        if not self.stream_recompresses:
            if slack is not None:
                raise ValueError(
                    f"slack={slack!r}: method {self.name!r} streams natively (at most budget slots, never re-compressed), "
                    "so slack does not apply to it; leave slack unset"
                )
            return 0.0
        return DEFAULT_SLACK if slack is None else check_slack(slack)

    def keep_index(self, tokens: Tokens, budget: int, generator: torch.Generator) -> torch.Tensor | None:
        """[B,H,k]: ascending indices into `tokens` of the plain tokens `compress` keeps (k <= budget per head),
        for a caller that selects the tokens itself (the hybrid); None when `compress` keeps weighted slots
        (log-weights or a normalizer). This default compresses and finds the kept positions; a score
        method returns its top-k without gathering the tokens."""
        summary = self.compress(tokens, budget, generator)
        if summary.normalizer is not None or not bool((summary.log_weights == 0).all()):
            return None
        return positions_index(tokens.positions, summary.positions)

    def parts(self) -> dict[str, "Method"]:
        """The methods this one is made of whose streams it holds, by name (a saved stream refers to them by it)."""
        return {}

    def check_mode(self, mode: str) -> None:
        """Raise a clear error when the method cannot run in cache mode `mode` (not among `requirements.modes`)."""
        modes = self.requirements.modes
        if mode not in modes:
            raise ValueError(f"method {self.name!r} runs in mode {' or '.join(map(repr, modes))} only, got mode={mode!r}")

    def check_stream_window(self, window: int) -> None:
        """Raise a clear error when the method cannot stream with an exact window of `window` tokens (checked when a
        stream or a streaming cache is built, before any token): every window works by default."""

    def check_model(self, compressed_layers: tuple[int, ...], kv_heads: int, hidden_size: int) -> None:
        """Raise a clear error when the method cannot compress a model whose compressed (full-attention) layers are
        `compressed_layers`, with `kv_heads` KV heads each and hidden states of width `hidden_size` (checked when a cache
        is built): weights trained for one model (KVzap's scorer) fit no other; every model fits by default."""

    def file_digests(self) -> dict[str, str]:
        """{name: checksum} of the files the method reads its weights from (KVzap's scorer), which a saved cache records
        and checks when it is loaded, so that it goes on with the same weights; none by default."""
        return {}

    def check_context(self, reconstructed: bool) -> None:
        """Raise a clear error when a prefill-mode cache is about to compress a context with queries other than those the
        method scores with: a method that needs a reconstruction forward (KVzip) takes that forward's queries
        (`reconstructed`), never the context's own (a plain forward, a recorded prefill)."""
        if self.requirements.needs("reconstruction") and not reconstructed:
            raise ValueError(
                f"method {self.name!r} scores the context with the queries of its reconstruction forward, not with the context's "
                "own (a plain forward or a recorded prefill): compress through kvc.generate / kvc.compress_context, or "
                "kvcompress.integration.reconstruction.reconstruct_context(model, cache, context_ids)"
            )

    def check_parts_inputs(self, parts: list["Method"], tokens: Tokens) -> None:
        """`check_inputs` of the methods this one is built from, an error naming this method before the part."""
        for part in parts:
            try:
                part.check_inputs(tokens)
            except ValueError as err:
                raise ValueError(f"method {self.name!r} (through its part {part.name!r}): {err}") from None

    def check_inputs(self, tokens: Tokens) -> None:
        """Raise a clear error when the method's required inputs (`requirements.inputs`) are missing."""
        needs = self.requirements.needs
        if needs("queries") and tokens.queries is None:
            raise ValueError(f"method {self.name!r} scores tokens with queries: pass queries=[B, H_q, n_q, d]")
        if needs("pre_rope_keys") and tokens.pre_rope_keys is None and tokens.unrotate is None:
            raise ValueError(f"method {self.name!r} scores pre-RoPE keys: pass pre_rope_keys=[B, H_kv, n, d]")
        if needs("hidden_states") and tokens.hidden_states is None:
            raise ValueError(f"method {self.name!r} scores the layer's hidden states: pass hidden_states=[B, H_kv, n, d_model] (in a "
                             "model, kvc.generate and a CompressedCache built from a method name capture them; a recorded prefill "
                             "keeps none)")


class UnknownParameters(ValueError):
    """Method parameters that are not taken (`names`, sorted), with the reason as the message."""

    def __init__(self, message: str, names: list[str]):
        super().__init__(message)
        self.names = names


def check_params(cls: type[Method], params: dict[str, Any], also: tuple[str, ...] = ()) -> None:
    """`UnknownParameters` unless every name in `params` is a field of method class `cls` (or one of `also`, which its
    `from_params` takes besides them); ValueError unless every bool field is given a bool, naming the parameter."""
    known = {f.name for f in fields(cls)} | set(also)
    unknown = sorted(set(params) - known)
    if unknown:
        raise UnknownParameters(f"method {cls.name!r} has no parameter(s) {unknown}; its parameters are {sorted(known)}", unknown)
    for f in fields(cls):
        if f.type in ("bool", bool) and f.name in params and not isinstance(params[f.name], bool):
            raise ValueError(
                f"method {cls.name!r} parameter {f.name} must be True or False (on the command line: true or false), got {params[f.name]!r}"
            )


class ScoreMethod(Method, ABC):
    """A score-then-top-k method: subclasses implement `score`; the top `budget` per head are kept."""

    @abstractmethod
    def score(self, tokens: Tokens, generator: torch.Generator) -> torch.Tensor:
        """[B, H_kv, n] importance of each token (higher is kept)."""

    def score_and_middle_lse(self, tokens: Tokens, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(`score`'s scores, the log-sum-exp of each of `tokens.queries`' scaled logits over the middle's keys
        `tokens.keys`, [B, H_kv, group·q] float32 with a KV head's rows its query heads' queries, head by head, or
        None): a scorer that forms that normaliser while scoring hands it on (KVzip), so that a refit of the kept
        slots to the same queries (`methods.attention_matching`) need not form it again; None here."""
        return self.score(tokens, generator), None

    # True when `on_entry` gives each token its final score (`Tokens.entry_scores`): a held token's score never changes
    scores_on_entry: ClassVar[bool] = False

    @property
    def shares_layers(self) -> bool:
        """Whether `layer_shares` knows the layers' shares (False here)."""
        return False

    def layer_shares(self, kept_fraction: float) -> dict[int, float] | None:
        """{layer index: share} (mean 1 over the layers): how one budget over every layer, `kept_fraction` of the
        middle tokens kept, would be shared out among the layers if all their tokens were ranked together by this
        scorer, as known before the context is seen (so that a stream, which never has every layer's scores at once,
        can share a budget over the model); None when the scorer knows no such shares (this default)."""
        return None

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


def first_true(mask: torch.Tensor, count: int, exact: bool = False) -> torch.Tensor:
    """Indices [..., count] of the first `count` True entries of mask [..., n] (ascending), by a stable sort. exact: the
    caller guarantees that every row holds exactly `count` of them, which are then read off one `nonzero` (no sort;
    on CUDA a host sync)."""
    if exact:
        return mask.nonzero()[:, -1].view(*mask.shape[:-1], count)
    return torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[..., :count]


def top_index(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """[B,H,budget]: the indices of the `budget` highest scores [B,H,n] per head, in ascending (original) order (half-precision
    scores ranked in float32; float64 ones, e.g. positions, as they are)."""
    ranked = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
    return ranked.topk(budget, dim=-1).indices.sort(dim=-1).values


def is_pool_span(span) -> bool:
    """Whether `span` is a width `max_pool_scores` takes: an odd int >= 1 (not a bool)."""
    return isinstance(span, int) and not isinstance(span, bool) and span >= 1 and span % 2 == 1


def max_pool_scores(scores: torch.Tensor, span: int) -> torch.Tensor:
    """[B,H,n]: each token's score [B,H,n] raised to the highest within the `span` (odd) tokens centred on it, so a
    high score takes its neighbours along (contiguous picks); a -inf score (a token that must go) stays -inf."""
    if span == 1:
        return scores
    b, h, n = scores.shape
    pooled = torch.nn.functional.max_pool1d(scores.reshape(b * h, 1, n), span, stride=1, padding=span // 2).reshape(b, h, n)
    return pooled.masked_fill(torch.isneginf(scores), -math.inf)


def keep_top(tokens: Tokens, scores: torch.Tensor, budget: int) -> KVSummary:
    """Keep the `budget` highest-scoring tokens per head, in their original order, with log-weight 0.

    scores [B,H,n] may contain -inf for tokens that must go.
    """
    index = top_index(scores, budget)
    keys, values, positions = gather_slots(tokens.keys, tokens.values, tokens.positions, index)
    return KVSummary(keys, values, torch.zeros(positions.shape, device=keys.device, dtype=torch.float32), positions)


@saved("blockwise_state", 2)
class BlockwiseState(StreamState):
    """Block-wise streaming of a one-shot method with amortised re-compression, within its budget.

    `budget` is the most slots per head the state ever stores, the block being absorbed included: the
    stream's working space comes out of it (`budget.stream_split`). The method compresses what is held
    back to `target` = floor(budget / (1 + slack)) slots (at most budget - 1), and the buffer then
    takes blocks in place (no copy of what is held) until it holds `budget` slots: a block that does
    not fit is taken in pieces, the buffer compressed back to `target` each time it is full. So
    `peak_slots` (the buffer a re-compression scores) never passes `budget`, and each token takes part
    in about 1 + 1/slack re-compressions: total work is linear in the stream length even when budget
    grows with it. A method that keeps a layer's share of `target` (`keeps_a_layer_share`, PyramidKV) sets
    the `limit` it compresses back to to what it kept, above the target in a layer that keeps more and below it in
    one that keeps less, and the room budget - target stays the same on top of it: the layers' streams together
    store what L streams of `budget` would.
    slack=0 compresses back to budget - 1 (KeyDiff's block prompt processing, Eq. 6 of arXiv:2504.15364,
    is slack 0 with one block of room: here a budget's worth of stored slots includes the block).
    A budget of 1 leaves no room (a ValueError). `compact()` gives back the room the buffer reserves
    for later blocks; what is held is already within the budget.
    The buffer never allocates more slots than the tokens it has absorbed, so it never holds more
    than a full cache of the same tokens would.
    A method that keeps weighted slots (Random and ClusterGen with weighted=True) compresses the
    held tokens as if each stood for one token; a kept slot's weight is then its held weight times
    the method's, scaled so the weights still sum to the tokens absorbed (as one-shot's do).
    """

    exact_within_budget = True

    def __init__(self, method: Method, budget: int, generator: torch.Generator, slack: float,
                 split: tuple[int, int] | None = None):
        """split: (target, room) when the caller shares the budget out itself (the hybrid); else `stream_split`."""
        self.method, self.budget, self.generator = method, budget, generator
        target, self.slack_slots = split if split is not None else stream_split(budget, check_slack(slack))
        self.limit = target
        self.slots = _GrowingSlots()
        self.last: Tokens | None = None
        self.peak_slots = 0
        self.seen = 0
        self.log_weights: torch.Tensor | None = None  # [B,H,held] once a re-compression kept weighted slots

    @property
    def target(self) -> int:
        """What a re-compression keeps per head: the budget less the room for the slack and the next block."""
        return self.budget - self.slack_slots

    saved_fields = {
        "method": Linked("method", "coreset_method"), "budget": Count(1), "generator": Generator(), "slack_slots": Count(), "limit": Count(1),
        "slots": Instance("growing_slots", "quantized_slots"), "last": Maybe(Instance("tokens")), "peak_slots": Count(), "seen": Count(),
        "log_weights": Maybe(Tensor("B H n")),
    }

    def check_saved(self) -> None:
        held = self.held_slots()
        if self.slack_slots < 1 or self.slack_slots >= self.budget or (self.limit < self.target and not self.method.keeps_a_layer_share) or \
                held > self.limit + self.slack_slots or held > self.seen or held > self.peak_slots:
            raise ValueError(f"{held} slots held do not fit budget {self.budget}, limit {self.limit}, slack {self.slack_slots}, "
                             f"{self.seen} tokens seen and a peak of {self.peak_slots}")
        if (self.last is None) != (self.seen == 0):
            raise ValueError(f"{self.seen} tokens seen but the latest block is {'missing' if self.last is None else 'there'}")
        if self.log_weights is not None and self.log_weights.shape[-1] != self.slots.length:
            raise ValueError(f"log_weights for {self.log_weights.shape[-1]} slots, {self.slots.length} held")
        if self.last is not None and self.slots.tensors:
            columns = self.columns(self.last)  # what each absorbed block stores per slot
            stored = self.slots.view()
            if len(stored) != len(columns) or any(s.dtype != c.dtype or s.shape[3:] != c.shape[3:] for s, c in zip(stored, columns)):
                raise ValueError(f"the slot buffer holds columns {[(list(s.shape), s.dtype) for s in stored]}, the method stores "
                                 f"{[(list(c.shape), c.dtype) for c in columns]} per block")
            if stored[2].shape[2] > 1 and not bool((stored[2].diff(dim=-1) > 0).all()):  # a re-compression finds kept slots by position
                raise ValueError("the slots held are not in ascending order of position in every head")

    def most_slots(self) -> int:
        """The most slots the buffer may allocate: the tokens absorbed so far (what a full cache would hold)."""
        return self.seen

    def columns(self, tokens: Tokens) -> tuple[torch.Tensor, ...]:
        """The per-token tensors [B,H,n,...] stored (`token_columns`)."""
        return token_columns(tokens)

    def absorb(self, tokens: Tokens, codes: QuantizedSlots | None = None) -> None:
        """Buffer `tokens`. When they do not all fit the budget, what is held is first compressed back to the target
        (scored with the previous block's queries, as if it had been compressed at the end of that block: KeyDiff's
        block prompt processing); a block larger than the room is taken in pieces, compressing each time the buffer is
        full. codes: the quantized buffer they were dequantized from (a stream's held tokens), whose codes their slots
        keep in a quantized buffer."""
        known = {} if codes is None else {"known": codes.known()}
        columns = self.columns(tokens)  # of the whole block (Compactor scores a block's tokens with its queries)
        start = 0
        while start < tokens.length:
            rest = tokens.length - start
            if self.held_slots() + rest > self.limit + self.slack_slots and self.held_slots() > self.floor:
                self.recompress(room=self.slack_slots)
            stop = start + min(rest, self.limit + self.slack_slots - self.held_slots())
            piece = tuple(column[:, :, start:stop] for column in columns)
            self.seen += stop - start
            full = self.slots.length + self.limit + self.slack_slots - self.held_slots()  # the buffer's slots once full
            append_columns(self.slots, piece, reserve=full, most=min(full, self.most_slots()), **known)
            if self.log_weights is not None:
                self.log_weights = torch.cat([self.log_weights, self.log_weights.new_zeros(piece[2].shape)], -1)
            self.last = tokens.scoring_context(self.method.queries_read)
            self.peak_slots = max(self.peak_slots, self.held_slots())
            start = stop

    def held_slots(self) -> int:
        """Slots held per head (on average over the heads, for a state whose heads hold different numbers)."""
        return self.slots.length

    def held(self) -> Tokens:
        """Every token held, with the latest block's queries and exact neighbours."""
        held = tokens_from_columns(self.last, self.slots.view())
        return replace(held, pre_rope_keys=held.pre_rope()) if self.method.requirements.needs("pre_rope_keys") else held

    def keep(self, held: Tokens) -> tuple[torch.Tensor, ...]:
        """The stored columns of the tokens the method keeps from `held` (more than the target)."""
        summary = self.method.compress_held(held, self.target, self.generator)
        _check_kept(self.method, summary, self.target)
        extra = self.slots.view()[3:]
        weighted = self.log_weights is not None or not bool((summary.log_weights == 0).all())
        index = positions_index(held.positions, summary.positions) if extra or weighted else None
        if weighted:
            before = (self.log_weights if self.log_weights is not None
                      else torch.zeros(held.positions.shape, device=held.keys.device, dtype=torch.float32))
            kept = take_slots(before, index) + summary.log_weights
            self.log_weights = kept + (before.logsumexp(-1) - kept.logsumexp(-1)).unsqueeze(-1)
        return (summary.keys, summary.values, summary.positions, *(take_slots(t, index) for t in extra))

    def quantized(self, bits: int, group_size: int) -> "BlockwiseState":
        """This state, its buffer stored in `bits` bits from now on (`quantization.QuantizedSlots`: each slot quantized
        once, on arrival; a re-compression selects stored codes). Before the first token only."""
        if self.seen:
            raise ValueError("quantized storage must be set before the stream's first token")
        self.slots = QuantizedSlots(bits, group_size)
        return self

    @property
    def floor(self) -> int:
        """The fewest slots a re-compression may leave: the target, or less where the limit is (`keeps_a_layer_share`)."""
        return min(self.target, self.limit)

    def recompress(self, room: int) -> None:
        """Compress what is held back to the target (when above the floor), into a buffer with `room` more slots reserved."""
        if self.slots.length <= self.floor:
            return
        held = self.held()
        kept = self.keep(held)
        self.limit = kept[0].shape[2] if self.method.keeps_a_layer_share else max(self.target, kept[0].shape[2])
        slots = min(self.limit + room, self.most_slots()) if room else kept[0].shape[2]  # compact(): exactly what is kept
        self._refill(kept, held.positions, slots)

    def _refill(self, kept: tuple[torch.Tensor, ...], held_positions: torch.Tensor, slots: int) -> None:
        """A new buffer of `slots` slots holding the kept columns. Quantized storage keeps the stored codes of the kept
        slots, found by position among the held ones (every block-wise method keeps a subset of what it holds)."""
        if isinstance(self.slots, _GrowingSlots):
            self.slots = _GrowingSlots()
            self.slots.append(kept, reserve=slots, most=slots)
            return
        index = positions_index(held_positions, kept[2]).clamp_(max=held_positions.shape[2] - 1)
        if not torch.equal(take_slots(held_positions, index), kept[2]):
            raise RuntimeError(f"method {self.method.name!r} kept slots that are not among those it held: quantized stream storage "
                               "selects stored codes and cannot hold new ones")
        self.slots = self.slots.take(index, reserve=slots, most=slots)

    def compact(self) -> None:
        """Give back the room reserved for further blocks (e.g. at the end of a prompt): the buffer is sized for exactly
        what it holds, which stays (it is within the budget already; a lower layer of a method that keeps a layer's
        share, PyramidKV, within its share and the slack, as while it streamed)."""
        if self.slots.tensors:
            held = self.slots.view()
            self._refill(held, held[2], held[0].shape[2])

    def summary(self) -> KVSummary | None:
        if self.last is None:
            return None
        held = self.held()
        return held.exact() if self.log_weights is None else KVSummary(held.keys, held.values, self.log_weights, held.positions)

    def nbytes(self) -> int:
        """KV bytes of the buffer as allocated (its room for the next blocks included): keys, values and any
        stored pre-RoPE keys, never more than the tokens absorbed so far would take."""
        return self.slots.kv_bytes()


def unwrapped(state: StreamState) -> StreamState:
    """The method's own state: `state` itself, or the native state a `QuantizedState` stores quantized."""
    return state.state if isinstance(state, QuantizedState) else state


@saved("quantized_state")
class QuantizedState(StreamState):
    """A native stream's state (Express, SubGen, ClusterGen, BalanceKV) with its keys and values stored in `bits` bits.

    The wrapped state lists its tensors: `kv_tensors()` returns every key and value tensor it stores ([..., d] each,
    a slot's key or value a row; bookkeeping such as positions, counts, weights and sums of keys is not listed) in a
    fixed order, and `set_kv_tensors(tensors)` takes tensors of those shapes back in that order.
    Between calls the wrapped state holds placeholders and this wrapper the codes of every tensor the state lists,
    row by row (`quantization.quantize_rows`: a row is one slot's key or value). Each
    call dequantizes them into the state, runs it, and stores what it then lists: a row equal bit for bit to one
    stored before, or to one handed over with the tokens (`absorb(tokens, codes=)`), keeps that row's codes, so a
    slot the state keeps, moves or copies is quantized once, when it enters; a row the state computes (a merged
    cluster centre, a sampled slot) is quantized as it appears. Dequantized rows are what the state reads: its
    decisions see the stored slots, as a block-wise stream's re-compressions do. During a call the state is
    held at full precision, a workspace as a re-compression's is.
    """

    def __init__(self, state: StreamState, bits: int, group_size: int):
        if not (callable(getattr(state, "kv_tensors", None)) and callable(getattr(state, "set_kv_tensors", None))):
            raise ValueError(f"{type(state).__name__} does not list its key and value tensors (kv_tensors, set_kv_tensors), so its "
                             "slots cannot be stored quantized")
        self.state, self.bits, self.group_size = state, bits, group_size
        self.exact_within_budget = state.exact_within_budget
        self.stored: dict[int, QuantizedTensor] = {}  # per row width: the rows of every listed tensor that wide, in order
        self.shapes: list[torch.Size] = []  # of the listed tensors, in order
        self.other_bytes = 0  # what the state's nbytes() counts beside its key and value tensors

    saved_fields = {
        "state": Instance(StreamState), "bits": Count(1),
        "group_size": Count(1), "exact_within_budget": Flag(), "stored": Mapping(Count(1), Instance("quantized_tensor")),
        "shapes": Sequence(Sequence(Count(), kind="size")), "other_bytes": Count(),
    }

    def check_saved(self) -> None:
        check_kv_bits(self.bits)
        if self.exact_within_budget != self.state.exact_within_budget:
            raise ValueError(f"exact_within_budget {self.exact_within_budget} differs from the wrapped state's")
        listed = [t.shape for t in self.state.kv_tensors()]
        if listed != self.shapes:
            raise ValueError(f"the wrapped state lists tensors of shapes {[list(s) for s in listed]}, the codes stand for {[list(s) for s in self.shapes]}")
        rows: dict[int, int] = {}
        for shape in self.shapes:
            if not shape or shape[-1] == 0:
                raise ValueError(f"a listed tensor of shape {list(shape)} has no row width")
            rows[shape[-1]] = rows.get(shape[-1], 0) + shape.numel() // shape[-1]
        coded = {width: q.packed.shape[2] * q.packed.shape[0] * q.packed.shape[1] for width, q in self.stored.items()}
        if rows != coded or any(q.dim != width or q.bits != self.bits for width, q in self.stored.items()):
            raise ValueError(f"codes for rows {coded} of widths and bits {[(q.dim, q.bits) for q in self.stored.values()]}, the tensors "
                             f"listed need rows {rows} in {self.bits} bits")

    def _restore(self) -> None:
        if not self.shapes:
            return
        rows = {width: q.dequantize()[0, 0] for width, q in self.stored.items()}
        start = dict.fromkeys(rows, 0)
        tensors = []
        for shape in self.shapes:
            width, count = shape[-1], shape.numel() // max(shape[-1], 1)
            tensors.append(rows[width][start[width] : start[width] + count].view(shape))
            start[width] += count
        self.state.set_kv_tensors(tensors)

    def _hold_placeholders(self) -> None:
        self.state.set_kv_tensors([t.new_zeros(()).expand(t.shape) for t in self.state.kv_tensors()])

    def _store(self, handed: list[tuple[torch.Tensor, QuantizedTensor]]) -> None:
        """Quantize what the state now lists, each row width in one call (rows known before keep their codes), then
        leave the state placeholders."""
        # the rows as stored, dequantized again: the state may have written into the tensors `_restore` gave it (BalanceKV
        # copies new rows into its buffer in place), so those may not match what each stored code stands for
        known = [(q.dequantize(), q) for q in self.stored.values()] + handed
        tensors = self.state.kv_tensors()
        self.other_bytes = self.state.nbytes() - sum(t.numel() * t.element_size() for t in tensors)
        widths = dict.fromkeys(t.shape[-1] for t in tensors)
        self.stored = {
            width: quantize_rows(torch.cat([t.reshape(-1, width) for t in tensors if t.shape[-1] == width]), self.bits,
                                 self.group_size, known)
            for width in widths
        }
        self.shapes = [t.shape for t in tensors]
        self._hold_placeholders()

    def absorb(self, tokens: Tokens, codes: QuantizedSlots | None = None) -> None:
        """Absorb `tokens`; codes: the quantized buffer they were dequantized from (a stream's held tokens, a hybrid's
        evicted ones), whose codes their rows keep."""
        self._restore()
        self.state.absorb(tokens)
        self._store(codes.known() if codes is not None else [])

    def compact(self) -> None:
        self._restore()
        self.state.compact()
        self._store([])

    def summary(self) -> KVSummary | None:
        self._restore()
        summary = self.state.summary()
        self._hold_placeholders()
        return summary

    def nbytes(self) -> int:
        """The state's own bytes with its key and value tensors counted as stored: codes, scales and zero points."""
        if not self.shapes:
            return self.state.nbytes()
        return self.other_bytes + sum(q.nbytes() for q in self.stored.values())


def make_generator(seed: int | torch.Generator | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator from `seed`: an int seeds it (reproducible), None draws a fresh random seed (a different result each call), a Generator is used as is."""
    if isinstance(seed, torch.Generator):
        return seed
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        seed = as_count("seed", seed, 0)
        if seed >= 2**64:
            raise ValueError(f"seed must be below 2**64 (a torch generator's seed), got {seed}")
        gen.manual_seed(seed)
    return gen


def compress_tokens(method: Method, tokens: Tokens, budget: int, sink: int, window: int, generator) -> KVSummary:
    """Sink and window exact, the middle compressed by `method` to at most `budget` slots per head (kept exactly when it
    fits, unless the method drops tokens within its budget)."""
    head, middle, tail = split_exact(tokens, sink, window)
    if middle.length > budget or (middle.length and method.drops_within_budget):
        middle = _with_exact_neighbours(head, middle, tail)
        method.check_inputs(middle)
        middle = method.compress(middle, budget, generator)
        _check_kept(method, middle, budget)
    return _assemble(head, middle, tail)


def _check_kept(method: Method, summary, budget: int) -> None:
    """A RuntimeError when `method.compress` kept more than `budget` slots per head (a method registered from outside
    that ignores its budget; AdaKV's heads share theirs and PyramidKV's lower layers keep more, by design). A shape is
    read, no value."""
    if not method.requirements.ragged and not method.keeps_a_layer_share and isinstance(summary, KVSummary) and summary.num_slots > budget:
        raise RuntimeError(f"method {method.name!r} kept {summary.num_slots} slots per head for a budget of {budget}: its compress "
                           "must keep at most `budget` slots per head (docs/extending.md)")


def compress_layers(method: Method, layers: list[Tokens], budget: int, sink: int, window: int, generators) -> list[KVSummary]:
    """`compress_tokens` for every compressed layer of a model at once (one context: the same batch, heads and tokens
    in each), for a method whose budget scope is "model" (`Requirements.budget_scope`): each layer's sink and window exact, the middles
    compressed together by `method.compress_layers` to `budget` slots per head on average over every layer."""
    splits = [split_exact(tokens, sink, window) for tokens in layers]
    middles = [middle for _, middle, _ in splits]
    if middles[0].length > budget:
        middles = [_with_exact_neighbours(head, middle, tail) for head, middle, tail in splits]
        for middle in middles:
            method.check_inputs(middle)
        middles = method.compress_layers(middles, budget, list(generators))
    return [_assemble(head, middle, tail) for (head, _, tail), middle in zip(splits, middles)]


def _with_exact_neighbours(head: Tokens, middle: Tokens, tail: Tokens) -> Tokens:
    """The middle with the sink and window beside it as its exact keys (`Tokens.exact_keys`)."""
    return replace(middle, exact_keys=torch.cat([head.keys, tail.keys], 2), exact_positions=torch.cat([head.positions, tail.positions], 2))


def _assemble(head: Tokens, middle: Tokens | KVSummary, tail: Tokens) -> KVSummary:
    """Sink, middle (compressed, or as it is) and window as one summary."""
    parts = [head.exact(), middle if isinstance(middle, KVSummary) else middle.exact(), tail.exact()]
    return concat([p for p in parts if p.num_slots > 0] or [parts[0]])
