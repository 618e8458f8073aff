"""Hybrid: score methods' top tokens kept exactly, the rest summarised by a weighted coreset, in one budget.

A composition of registered methods (docs/design.md, "Composition"), through their public `Method`
interfaces only:

- one or more score methods (e.g. TOVA's heavy hitters; Compactor; KeyDiff)
  pick `n_i = round(exact_fraction_i · budget)` tokens per head, each among the tokens the
  earlier ones left, kept with log-weight 0;
- the coreset (Thinformer Express; BalanceKV) summarises every other token in
  the remaining `budget − Σ n_i` slots, with weights that add up to the tokens it covers.

So the weights of the whole summary add up to the tokens seen, and the attention error is the
coreset's error on the residual it covers (the exact part adds none). The two kinds of exact token
serve the two claims: heavy hitters (the keys the queries attend to most) take the largest terms
out of the attention sums, so the coreset's bound applies to a residual with a smaller total;
outlier keys (Compactor's leverage blend) are the rare tokens retrieval needs (a needle), which a
coreset of the bulk drops.

One-shot: the score methods select over all tokens, the coreset compresses the rest once.
Streamed: the room for the slack and the block in progress comes out of the budget first
(`budget.stream_split`), and what is left is split into Σ n_i and the coreset's budget. New blocks
join the held exact set until it holds Σ n_i + room slots; then the exact set is re-selected over
everything held, as KeyDiff's block prompt processing does (its Eq. 6, with amortised slack: linear
total work); the tokens it lets go are absorbed by the coreset's own stream (`coreset` method's
`new_stream`, within its budget), so nothing leaves the summary unweighted. Stored slots stay within
the budget at every step; `compact()` gives back the exact set's unused room and compacts the
coreset stream.

Papers: Compactor, "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate
Leverage Scores", arXiv:2507.08143; KeyDiff, "KeyDiff: Key Similarity-Based KV Cache Eviction for
Long-Context LLM Inference in Resource-Constrained Environments", arXiv:2504.15364; Thinformer
Express, "Express Language Modeling", arXiv:2606.10944; BalanceKV, "BalanceKV: KV Cache
Compression through Discrepancy Theory", arXiv:2502.07861.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..names import MODES
from ..quantization import QuantizedSlots
from ..saved_state import Count, Instance, Sequence, saved
from ..summary import KVSummary, concat, take_slots
from .base import BlockwiseState, Method, StreamState, first_true, is_pool_span, make_generator, max_pool_scores, top_index
from .budget import round_share, stream_split
from .registry import build_method, register
from .requirements import Requirements
from .tokens import Tokens

_COMPOSED_PARAMS = ("sink", "window")
_DEFAULT_SCORE = ("tova", "compactor")
_DEFAULT_SCORE_PARAMS = (None, {"attention": False})  # Compactor's leverage score alone
_DEFAULT_SPAN = (1, 7)  # tuned on training cases by benchmarks/tuning/hybrid_tuning.py
# Express as the coreset halves in groups of 32 (smaller than Express's own default of 128): the kernels
# cost O(n·max_group) and the hybrid's compression is bound by the number of tensor ops, while the
# attention error stays within noise of larger groups.
_EXPRESS_CORESET_PARAMS = {"max_group": 32}


def _by_position(summary: KVSummary) -> KVSummary:
    """The numerator slots reordered by original position (the normalizer, if any, is left as it is)."""
    order = summary.positions.argsort(dim=-1)
    return replace(summary, keys=take_slots(summary.keys, order), values=take_slots(summary.values, order),
                   log_weights=take_slots(summary.log_weights, order), positions=take_slots(summary.positions, order))


def _pick(method: Method, span: int, tokens: Tokens, count: int, generator: torch.Generator) -> torch.Tensor | None:
    """[B,H,count]: ascending indices into `tokens` of `method`'s `count` plain tokens per head (None when it
    keeps weighted slots); span > 1: the top `count` of its score max-pooled over `span` neighbouring
    tokens, so each high score takes its neighbours along (contiguous picks)."""
    if span == 1 or tokens.length <= count:
        return method.keep_index(tokens, count, generator)
    method.check_inputs(tokens)
    return top_index(max_pool_scores(method.score(tokens, generator).float(), span), count)


def _as_list(value) -> list:
    """A single value or a list/tuple of values, as a list."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


@register
@dataclass
class Hybrid(Method):
    """Top tokens of `score` exact (weight 1) + a `coreset` summary of the rest, in one budget per head.

    score: a registered method that keeps plain tokens (log-weight 0, no normalizer), e.g.
    "tova", "compactor", "keydiff", "knorm", "snapkv"; or a list of them, each choosing its share
    among the tokens the earlier ones left. exact_fraction: share of the budget kept exactly, one
    number in [0, 1) per score method (n_i = round(f_i · budget)); their sum stays below 1 and the
    coreset gets at least one slot, so the weights always cover every token. coreset: any
    registered method whose weights add up to the tokens it covers, e.g. "express", "balancekv".
    score_params (one dict, or None, per score method) / coreset_params: parameters of the composed
    methods, checked by their own constructors; score_params None (default): the default
    composition's (None, {"attention": False}) when `score` is left at its default, else every
    score method's defaults; an
    Express coreset halves in groups of `max_group` = 32 unless coreset_params sets it.
    span: odd number of neighbouring tokens each score method's score is max-pooled over before its
    top-k (SnapKV pools its scores, ChunkKV keeps chunks), so its exact picks come as contiguous
    runs around the high scores; one number, or one per score method; 1 picks single tokens;
    above 1 the method must expose `score` (Compactor does). None (default): the default
    composition's (1, 7) when `score` is left at its default, else 1 for every score method.

    Defaults (tuned on training cases only, by benchmarks/tuning/hybrid_tuning.py): TOVA's heavy
    hitters for 0.1 of the budget, then Compactor's leverage score alone (`attention=False`, the
    Compactor paper's "no a" score: the keys least
    representable by the others, which a coreset of the bulk drops) for 0.3, picked in runs of 7
    (its score max-pooled over 7 neighbours, so a rare token keeps the words around it: a line's
    name and number), and a Thinformer Express coreset (Halve groups of 32, for speed) of the
    rest in the remaining 0.6; no exact sink or window (sink = window = 0,
    as Compactor, KeyDiff and BalanceKV: the heavy hitters take the sinks), so every slot is chosen.
    """

    name = "hybrid"
    randomized = True  # through its coreset (Express and BalanceKV draw random signs)
    default_sink = 0
    default_window = 0
    score: str | tuple[str, ...] = _DEFAULT_SCORE
    coreset: str = "express"
    exact_fraction: float | tuple[float, ...] = (0.1, 0.3)
    score_params: dict | tuple[dict | None, ...] | None = None
    coreset_params: dict | None = None
    span: int | tuple[int, ...] | None = None

    def __post_init__(self):
        scores, fractions = _as_list(self.score), _as_list(self.exact_fraction)
        if not scores:
            raise ValueError(f"score must name at least one method, got {self.score!r}")
        if len(fractions) != len(scores):
            raise ValueError(f"exact_fraction must give one fraction per score method ({len(scores)}), got {self.exact_fraction!r}")
        for f in fractions:
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f < 1.0:
                raise ValueError(f"exact_fraction must be numbers in [0, 1), got {self.exact_fraction!r}")
        if sum(fractions) >= 1.0:
            raise ValueError(f"exact_fraction must add up to less than 1 (the coreset needs a slot), got {self.exact_fraction!r}")
        for role, value in [("score", s) for s in scores] + [("coreset", self.coreset)]:
            if not isinstance(value, str) or value == self.name:
                raise ValueError(f"{role} must be the name of another registered method, got {value!r}")
        default_score = list(scores) == list(_DEFAULT_SCORE)
        if self.score_params is None:
            score_params = list(_DEFAULT_SCORE_PARAMS) if default_score else [None] * len(scores)
        else:
            score_params = _as_list(self.score_params)
        if len(score_params) != len(scores):
            raise ValueError(f"score_params must give one dict (or None) per score method ({len(scores)}), got {self.score_params!r}; "
                             "score_params=None keeps every method's defaults")
        for role, params in [("score_params", p) for p in score_params] + [("coreset_params", self.coreset_params)]:
            if params is not None and not isinstance(params, dict):
                raise ValueError(f"{role} must be a dict of method parameters or None, got {params!r}")
            bad = sorted(set(params or {}) & set(_COMPOSED_PARAMS))
            if bad:
                raise ValueError(f"{role} cannot set {bad}: sink and window belong to the hybrid call")
        span = (_DEFAULT_SPAN if default_score else 1) if self.span is None else self.span
        spans = list(span) if isinstance(span, (list, tuple)) else [span] * len(scores)
        if len(spans) != len(scores) or not all(is_pool_span(w) for w in spans):
            raise ValueError(f"span must be an odd integer >= 1, or one per score method ({len(scores)}), got {self.span!r}")
        self.spans = spans
        self.fractions = [float(f) for f in fractions]
        self.score_methods = [build_method(s, **(p or {})) for s, p in zip(scores, score_params)]
        for method, span in zip(self.score_methods, spans):
            if span > 1 and not callable(getattr(method, "score", None)):
                raise ValueError(f"span={span} pools a score, but score method {method.name!r} exposes none; use span=1 for it")
        coreset_defaults = _EXPRESS_CORESET_PARAMS if self.coreset == "express" else {}
        self.coreset_method = build_method(self.coreset, **{**coreset_defaults, **(self.coreset_params or {})})
        for method in self.components:
            if method.requirements.needs("reconstruction"):  # its queries come from a forward only the model integration runs for it alone
                raise ValueError(f"method {method.name!r} scores with its own reconstruction forward: it cannot be a part of the hybrid")

    @property
    def components(self) -> list[Method]:
        """Every method the hybrid runs: its score methods, then its coreset method."""
        return [*self.score_methods, self.coreset_method]

    @property
    def requirements(self) -> Requirements:
        """Every part's inputs, a budget per head, and the modes every part runs in."""
        parts = self.components
        return Requirements(inputs=frozenset().union(*(m.requirements.inputs for m in parts)),
                            modes=tuple(mode for mode in MODES if all(mode in m.requirements.modes for m in parts)))

    @property
    def queries_read(self) -> int | None:
        """The most any part reads (None when one reads every query)."""
        read = [m.queries_read for m in self.components if m.requirements.needs("queries")]
        return None if not read or None in read else max(read)

    def parts(self) -> dict[str, Method]:
        return {"coreset_method": self.coreset_method}

    def split_budget(self, budget: int) -> tuple[list[int], int]:
        """(exact slots per score method, coreset slots) per head; the coreset always gets at least one."""
        counts, left = [], budget - 1
        for f in self.fractions:
            counts.append(min(round_share(f, budget), left))
            left -= counts[-1]
        return counts, budget - sum(counts)

    def check_stream_window(self, window: int) -> None:
        for method in self.components:
            method.check_stream_window(window)

    def check_model(self, compressed_layers: tuple[int, ...], kv_heads: int, hidden_size: int) -> None:
        for method in self.components:
            method.check_model(compressed_layers, kv_heads, hidden_size)

    def file_digests(self) -> dict[str, str]:
        return {f"{i}.{name}": digest for i, method in enumerate(self.components)
                for name, digest in method.file_digests().items()}

    def check_inputs(self, tokens: Tokens) -> None:
        self.check_parts_inputs(self.components, tokens)

    def top(self, tokens: Tokens, counts: list[int], generator: torch.Generator) -> tuple[Tokens, Tokens]:
        """(the tokens the score methods keep, `counts[i]` per head by method i among those the
        earlier ones left; every other token), both in original order. The others carry pre-RoPE
        keys only when the coreset reads them."""
        kept_mask = torch.zeros_like(tokens.positions, dtype=torch.bool)
        chosen = [(method, span, count) for method, span, count in zip(self.score_methods, self.spans, counts) if count]
        rest, rest_index, n_kept = tokens, None, 0
        for i, (method, span, count) in enumerate(chosen):
            kept = _pick(method, span, rest, count, generator)
            if kept is None or kept.shape[2] != count:
                raise ValueError(
                    f"score={method.name!r} must keep exactly {count} plain tokens per head (log-weight 0, no normalizer); "
                    "use an eviction method such as 'compactor', 'keydiff', 'knorm' or 'tova'"
                )
            kept_mask.scatter_(2, kept if rest_index is None else rest_index.gather(2, kept), True)
            n_kept += count
            if i + 1 < len(chosen):  # the tokens left, in their original order, with what the next method reads
                rest_index = first_true(~kept_mask, tokens.length - n_kept, exact=True)  # each method kept `count` per head
                rest = tokens.select(rest_index, chosen[i + 1][0].reads_keys_values)
        # the others first and the kept last, each in original order
        order = first_true(~kept_mask, tokens.length)
        n_rest = tokens.length - n_kept
        others = tokens if self.coreset_method.requirements.needs("pre_rope_keys") else replace(tokens, pre_rope_keys=None)
        return tokens.select(order[..., n_rest:]), others.select(order[..., :n_rest])

    def compress(self, tokens: Tokens, budget: int, generator: torch.Generator) -> KVSummary:
        if tokens.length <= budget:
            return tokens.exact()
        counts, n_coreset = self.split_budget(budget)
        exact, rest = self.top(tokens, counts, generator)
        coreset = self.coreset_method.compress(rest, n_coreset, generator)
        return _by_position(concat([exact.exact(), coreset]))

    def new_stream(self, budget: int, generator: torch.Generator, slack: float | None = None) -> "HybridState":
        return HybridState(self, budget, generator, self.stream_slack(slack))


@saved("hybrid_state", 2)
class HybridState(BlockwiseState):
    """Streamed hybrid: the exact set buffered with amortised slack (`BlockwiseState`) and re-selected
    only at a re-compression, which hands every token it lets go to the coreset's stream.

    The hybrid's budget is split once (`budget.stream_split` on the whole budget): the room for the slack
    and the block in progress, then the rest shared out as one-shot does (`Hybrid.split_budget`): Σ n_i
    exact slots and the coreset's budget. The exact set's buffer holds at most Σ n_i + room slots, the
    coreset's stream at most its budget (its own slack within it), so the state never stores more than
    `budget` slots per head; every token seen is either held exactly (weight 1) or covered by the
    coreset, so the weights add up to the tokens seen.
    """

    exact_within_budget = False  # the exact set re-compresses past its own share of the budget

    def __init__(self, method: Hybrid, budget: int, generator: torch.Generator, slack: float):
        target, room = stream_split(budget, slack)
        self.counts, self.coreset_slots = method.split_budget(target)
        super().__init__(method, sum(self.counts) + room, generator, slack, split=(sum(self.counts), room))
        try:
            self.coreset = self.coreset_stream(method, self.coreset_slots, generator, slack)
        except ValueError as error:
            smallest = next((b for b in range(budget + 1, 64 * budget + 64) if self.accepts(method, b, slack)), None)
            raise ValueError(f"hybrid stream budget={budget}: its {method.coreset_method.name} coreset gets {self.coreset_slots} of the "
                             f"slots (the rest hold the exact tokens and the stream's room), too few ({error}); the smallest budget "
                             f"the hybrid streams with is {smallest}") from error

    @staticmethod
    def coreset_stream(method: Hybrid, slots: int, generator: torch.Generator, slack: float) -> StreamState:
        coreset = method.coreset_method
        return coreset.new_stream(slots, generator, slack if coreset.stream_recompresses else None)

    @classmethod
    def accepts(cls, method: Hybrid, budget: int, slack: float) -> bool:
        """Whether a stream of `budget` gives the coreset a budget its stream takes."""
        try:
            cls.coreset_stream(method, method.split_budget(stream_split(budget, slack)[0])[1], make_generator(0), slack)
        except ValueError:
            return False
        return True

    saved_fields = {
        **BlockwiseState.saved_fields, "counts": Sequence(Count()), "coreset_slots": Count(1),
        "coreset": Instance(StreamState),
    }

    def check_saved(self) -> None:
        super().check_saved()
        if sum(self.counts) != self.target:
            raise ValueError(f"the exact set's counts {self.counts} do not add up to its target {self.target}")

    def most_slots(self) -> int:
        """The tokens absorbed so far less the coreset's budget: the two together never allocate more than a full cache."""
        return max(1, self.seen - self.coreset_slots)

    def keep(self, held: Tokens) -> tuple[torch.Tensor, ...]:
        exact, evicted = self.method.top(held, self.counts, self.generator)
        if isinstance(self.slots, QuantizedSlots):  # the evicted tokens keep the codes they were stored with
            self.coreset.absorb(evicted, codes=self.slots)
        else:
            self.coreset.absorb(evicted)
        return self.columns(exact)

    def compact(self) -> None:
        super().compact()
        self.coreset.compact()

    def same_kind(self, other: StreamState) -> bool:
        return super().same_kind(other) and self.coreset.same_kind(other.coreset)

    def quantized(self, bits: int, group_size: int) -> "HybridState":
        """The exact set's buffer and the coreset's stream both stored in `bits` bits."""
        self.coreset = self.coreset.quantized(bits, group_size)
        return super().quantized(bits, group_size)

    def summary(self) -> KVSummary | None:
        exact = super().summary()
        parts = [p for p in (exact if exact is not None and exact.num_slots else None, self.coreset.summary()) if p is not None]
        return _by_position(concat(parts)) if parts else None

    def nbytes(self) -> int:
        return super().nbytes() + self.coreset.nbytes()
