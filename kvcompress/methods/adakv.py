"""AdaKV: one budget per layer, shared out among its KV heads by their scores.

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM
Inference", arXiv:2407.11550.

A score method keeps the top `budget` tokens of every KV head. The paper observes that heads differ:
some put almost all their attention on a few tokens, others spread it. With the same total of
H_kv·budget slots per layer (per batch row), the attention lost to eviction is smaller when the
heads that spread their attention keep more and the concentrated ones fewer. AdaKV therefore ranks
the scores of all the layer's heads together and keeps the H_kv·budget highest (the paper's
Alg. 1, a top-k over the concatenated, softmax-normalised scores of every head), with the safeguard
of its Sec. 4.3: each head first keeps its own top floor(alpha_safeguard·budget) tokens, and only the
rest of the layer's total goes to the highest remaining scores, wherever they are.

Scores must be comparable across heads for the joint top-k to mean anything. SnapKV's (the default
scorer, the paper's Ada-SnapKV) are attention probabilities: each observation query's softmax over
every key sums to 1, so a head whose attention sits on the sink or the window has little mass
left for the middle and is given fewer slots, as in the paper. A scorer on another scale (key norms,
similarities) can be normalised per head first (`normalize="softmax"`).

With `scope="model"` the joint top-k runs over every head of every compressed layer at once: the model keeps
L·H_kv·budget middle tokens in all, and a layer whose heads matter more for the scores keeps more of them. This is
how KVzip's paper shares its budget (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction", arXiv:2505.23416: its scores, maximum attention probabilities, are on one scale in every layer).
The cache then compresses the layers together once the whole context has been through the model
(`methods.base.compress_layers`). A stream (modes "chunked" and "decode") never has every layer's scores at once: with
a scorer that knows in advance how the layers would share the budget (`ScoreMethod.layer_shares`: KVzap's, learned on
its training text), each layer's stream keeps its share of the model's budget (`layer_budget`) and ranks its own
heads together; with any other scorer scope "model" runs in mode "prefill" only.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..checks import as_count
from ..quantization import QuantizedRaggedSlots, QuantizedSlots
from ..ragged import RaggedSummary, concat_parts, int32_positions
from ..saved_state import Instance, Maybe, Sequence, Tensor, saved
from ..summary import KVSummary, _GrowingSlots, concat, take_slots
from .attention_matching import refit_kept
from .base import BlockwiseState, Method, ScoreMethod, check_params, first_true, is_pool_span, max_pool_scores
from .budget import check_slack, floor_share, stream_split
from .registry import build_method, get_method_class, method_names, register
from .requirements import Requirements
from .snapkv import SnapKV
from .tokens import Tokens, tokens_from_columns

NORMALIZATIONS = ("none", "softmax")
# The least room (slots per head) a stream whose ranks are fixed on entry leaves itself, up to half its budget: its
# re-compressions then come at most every so many admitted tokens, whatever the slack (`AdaptiveBlockwiseState`)
ENTRY_SCORE_ROOM = 16
SCOPES = ("layer", "model")
LAYER_SPLITS = ("joint", "learned")
REFITS = ("none", "log_weights", "log_weights_values")


def score_method_names() -> list[str]:
    """The registered methods AdaKV can take its scores from: those with a `score` (score-then-top-k methods)."""
    return [name for name in method_names() if issubclass(get_method_class(name), ScoreMethod)]


def head_allocation(scores: torch.Tensor, budget: int, safeguard: int) -> torch.Tensor:
    """kept [B, H, n] bool: H·budget tokens per batch row (all n when n <= budget), shared out among the heads.

    scores [B, H, n]: comparable across the heads of a row (higher is kept; -inf: keep only if nothing else is
    left; NaN counts as -inf). Each head keeps its own top min(safeguard, budget) tokens of finite score; the rest of
    the row's H·budget slots go to the highest remaining scores over every head together (one top-k over the row).
    So a head keeps between min(safeguard, its finite scores) and n tokens, and each row exactly H·budget.
    """
    b, h, n = scores.shape
    if n <= budget:
        return torch.ones(b, h, n, dtype=torch.bool, device=scores.device)
    return joint_top(allocation_priority(scores, min(safeguard, budget))[0], budget)


def allocation_priority(scores: torch.Tensor, guaranteed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(priority [B, H, n] float32, floors [B, H]) of `head_allocation`: the scores (NaN as -inf) with each head's own top
    `guaranteed` finite ones raised to +inf; a head's floor is the lowest of its own top `guaranteed` scores (+inf when
    it guarantees none, -inf when it has fewer finite scores)."""
    priority = scores.float().nan_to_num(nan=-math.inf, posinf=torch.finfo(torch.float32).max)
    if guaranteed <= 0:
        return priority, priority.new_full(priority.shape[:2], math.inf)
    top = priority.topk(guaranteed, dim=-1)
    priority = priority.scatter(-1, top.indices, torch.where(torch.isfinite(top.values), math.inf, top.values))
    return priority, top.values[..., -1].clone()  # not a view of every head's top scores


def joint_top(priority: torch.Tensor, budget: int) -> torch.Tensor:
    """kept [B, H, n] bool: the H·budget highest `priority` [B, H, n] of each batch row, over every head together
    (n > budget)."""
    b, h, n = priority.shape
    chosen = priority.reshape(b, h * n).topk(h * budget, dim=-1).indices
    kept = torch.zeros(b, h * n, dtype=torch.bool, device=priority.device)
    return kept.scatter_(-1, chosen, True).view(b, h, n)


def padded_index(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [B, H, m], real [B, H, m]) with m the most tokens any head keeps: the kept tokens of each head in
    ascending order, then (real False) the fill-up to m, whichever tokens come first."""
    counts = kept.sum(-1)
    width = int(counts.max()) if counts.numel() else 0
    index = first_true(kept, width)
    real = torch.arange(width, device=kept.device) < counts.unsqueeze(-1)
    return index, real


@register
@dataclass
class AdaKV(Method):
    """Head-adaptive budgets: the top H_kv·budget scores of all the layer's KV heads together are kept (per batch row),
    every head keeping at least its own top floor(alpha_safeguard·budget) (Ada-KV, arXiv:2407.11550; module docstring).

    scorer: a score method instance (`ScoreMethod`: SnapKV() (default, the paper's Ada-SnapKV), PyramidKV, H2O,
    TOVA, ExpectedAttention, Knorm, KeyDiff, Random, StreamingLLM, KVzip, ...; e.g. `AdaKV(scorer=KVzip(scoring="chunk"))`)
    whose `score(tokens) -> [B, H_kv, n]` ranks the tokens; only its score is used (a parameter that changes how it
    keeps tokens rather than how it scores them, e.g. KeyDiff's block_size or PyramidKV's layer budgets, has no
    effect here). What the scorer needs, AdaKV needs (`requirements`). By name (the command line, `build_method`,
    `CompressionOptions`, a saved cache's settings): scorer="kvzip" and scorer_params={...}, its parameters
    (`from_params` builds the instance).
    alpha_safeguard in [0, 1]: the share of `budget` every head keeps of its own (the paper's alpha, 0.2); 1 keeps the
    scorer's own top `budget` per head (the scorer itself), 0 a free top-k over the layer.
    normalize: how scores are made comparable across heads before the joint top-k: "none" (as given: right for
    attention probabilities, SnapKV's, H2O's, TOVA's) or "softmax" (each head's scores replaced by their log-softmax
    over the head's tokens, for scores on another scale, e.g. Knorm's negative key norms).
    scope: where the joint top-k runs: "layer" (the heads of one layer, the paper's) or "model" (the heads of every
    compressed layer together, KVzip's allocation; budget scope "model"): then `budget` is the mean over
    every layer's heads, and a layer keeps anywhere from H_kv·min(floor(alpha_safeguard·budget), n) to H_kv·n middle
    tokens per batch row; streams (chunked, decode) only with a scorer that has `layer_shares` (KVzap), each layer
    then keeping its share of the budget (`layer_budget`), else mode "prefill" only. span (odd, default 1: none): each score is raised to the highest within
    the `span` tokens centred on it before the top-k, so a kept token takes its neighbours along (SnapKV's
    pooling, with a maximum; kept phrases stay whole; in a stream, the neighbours among the held tokens). A single
    call of `compress` (one layer's tensors, `kvc.compress`) is one layer, so there both scopes agree.
    evicted_slots (default 0: none): each head's evicted tokens are not dropped but summarised in this many slots
    (`evicted_summary`): in position order, cut into runs of (nearly) equal count, each run one slot holding its
    tokens' mean key and mean value with log-weight log(count). The slots come out of the budget: a head keeps
    `evicted_slots` fewer tokens' worth of the joint top-k (budget - evicted_slots per head on average), so a layer
    row still stores H_kv·budget middle slots. Mode "prefill" only.
    refit (default "none"): after the top-k, the kept slots are refitted to attend as the whole middle did for the
    scorer's queries (`methods.attention_matching`; Zweiger et al., "Fast KV Compaction via Attention Matching",
    arXiv:2602.16284): "log_weights" fits each kept slot's log-weight so the middle's attention mass is restored,
    "log_weights_values" also fits the slots' values so the middle's attention output is; the keys stay the kept
    tokens'. Needs a scorer with queries (snapkv, kvzip, ...), mode "prefill" only, and evicted_slots 0.
    layer_split (scope "model", mode "prefill"): how the model's budget is split among the layers: "joint" (default: the
    one top-k over every layer's heads) or "learned" (each layer keeps its learned share, `layer_budget`, shared among
    its heads by a top-k over the layer's heads: the split a stream uses, in one shot; needs a scorer with
    `layer_shares`, KVzap). A stream always splits by the learned shares.

    Contract (budget scope "layer" or "model", `requirements`): `budget` is the mean number of middle slots per KV head; a layer row keeps exactly
    H_kv·budget middle tokens (all of them when they fit `budget` per head), a head between
    min(floor(alpha_safeguard·budget), n) and n. The summary is [B, H_kv, m, d] with m the most any head keeps,
    the shorter heads padded at the end with empty slots (log-weight -inf, position -1, zero keys and values: never
    attended). With evicted_slots = E the kept tokens are H_kv·(budget - E) per layer row (the safeguard taken of
    budget - E), and each head's E summary slots follow its m (log-weight log(count), or empty). Sink and window
    stay exact around it, as for every method. A cache stores such a summary ragged
    (`kvcompress.ragged.RaggedSummary`: only the kept slots) in prefill mode and once a chunked prompt ends.

    Streams (chunked and decode modes, `kvc.stream`) run block-wise (`AdaptiveBlockwiseState`): after a
    re-compression each head's kept tokens are stored packed as well, at full precision or with kv_bits, and the
    tokens taken in since then wait in a rectangular buffer within the room the budget leaves; a decode-mode cache
    holds its stream to the end.
    """

    name = "adakv"
    scorer: ScoreMethod = field(default_factory=SnapKV)
    alpha_safeguard: float = 0.2
    normalize: str = "none"
    scope: str = "layer"
    span: int = 1
    evicted_slots: int = 0
    refit: str = "none"
    layer_split: str = "joint"

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "AdaKV":
        """AdaKV from plain values: scorer, the name of a registered score method, and scorer_params, its parameters (a
        dict, None for its defaults), build the scorer instance; the other parameters are AdaKV's own."""
        check_params(cls, params, also=("scorer_params",))
        params = dict(params)
        scorer, scorer_params = params.pop("scorer", SnapKV.name), params.pop("scorer_params", None)
        accepted = score_method_names()
        if not isinstance(scorer, str) or scorer not in accepted:
            raise ValueError(f"scorer must be the name of a registered score method (one with a score to rank tokens by): one of "
                             f"{', '.join(accepted)}; got {scorer!r}")
        if scorer_params is not None and not isinstance(scorer_params, dict):
            raise ValueError(f"scorer_params must be a dict of {scorer!r}'s parameters or None (its defaults), got {scorer_params!r}")
        return cls(scorer=build_method(scorer, **(scorer_params or {})), **params)

    def __post_init__(self):
        if not isinstance(self.scorer, ScoreMethod):
            raise ValueError(f"scorer must be a score method (a ScoreMethod instance, e.g. SnapKV() or KVzip(); by name through "
                             f"build_method or the command line: one of {', '.join(score_method_names())}), got {self.scorer!r}")
        if self.scorer.drops_within_budget:  # KVzap's threshold: a rule of its own that AdaKV's allocation would not apply
            raise ValueError(f"scorer {self.scorer.name!r} with a threshold drops tokens by its own rule, which AdaKV does not apply "
                             f"(it shares the budget among heads by the scores): run method={self.scorer.name!r} for the threshold "
                             "rule, or leave threshold out of scorer_params")
        alpha = self.alpha_safeguard
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha_safeguard must be a number in [0, 1] (the share of the budget every head keeps of its own), "
                             f"got {alpha!r}")
        if self.normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {self.normalize!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES} (the heads one joint top-k runs over: one layer's, or every "
                             f"layer's), got {self.scope!r}")
        if not is_pool_span(self.span):
            raise ValueError(f"span must be an odd integer >= 1 (the tokens a score is max-pooled over, centred on each token; "
                             f"1: no pooling), got {self.span!r}")
        self.evicted_slots = as_count("evicted_slots", self.evicted_slots, 0)
        if self.refit not in REFITS:
            raise ValueError(f"refit must be one of {REFITS} (what of the kept slots is fitted to the middle's attention: nothing, "
                             f"their log-weights, or their log-weights and values), got {self.refit!r}")
        if self.layer_split not in LAYER_SPLITS:
            raise ValueError(f"layer_split must be one of {LAYER_SPLITS} (how scope 'model' splits the budget among the layers: one "
                             f"top-k over every layer's heads, or each layer its learned share), got {self.layer_split!r}")
        if self.layer_split == "learned" and (self.scope != "model" or not self.scorer.shares_layers):
            raise ValueError(f"layer_split='learned' splits scope 'model''s budget by the scorer's learned layer shares: it needs "
                             f"scope='model' and a scorer with layer shares (kvzap), got scope={self.scope!r} and scorer "
                             f"{self.scorer.name!r}")
        if self.refit != "none" and self.evicted_slots:
            raise ValueError(f"refit={self.refit!r} fits the kept slots alone; it cannot be combined with evicted_slots="
                             f"{self.evicted_slots}: set one of them off")
        if self.refit != "none" and not self.scorer.requirements.needs("queries"):
            raise ValueError(f"refit={self.refit!r} fits the kept slots to the scorer's queries, and scorer {self.scorer.name!r} takes "
                             "none: use a scorer with queries (snapkv, kvzip, ...) or refit='none'")

    @property
    def requirements(self) -> Requirements:
        """The scorer's inputs; the budget shared among a layer's heads (scope "layer") or every layer's (scope "model");
        the scorer's modes, or mode "prefill" alone when a setting needs the whole context at once (`whole_context`)."""
        needs = self.scorer.requirements
        modes = ("prefill",) if self.whole_context() is not None else needs.modes
        return Requirements(inputs=needs.inputs, budget_scope=self.scope, modes=modes)

    @property
    def queries_read(self) -> int | None:
        """The scorer's (a refit reads every query, in mode "prefill" only)."""
        return self.scorer.queries_read if self.refit == "none" else None

    @property
    def randomized(self) -> bool:
        """The scorer's: AdaKV itself draws nothing."""
        return self.scorer.randomized

    @property
    def reconstruction_chunk_size(self) -> int:
        """The scorer's (KVzip's): the chunk of context its reconstruction forward repeats at a time."""
        return self.scorer.reconstruction_chunk_size

    def whole_context(self) -> tuple[str, str, str] | None:
        """(the setting, why it needs the whole context at once, the setting that streams) when this instance runs in mode
        "prefill" only and has no stream; None when it streams as its scorer does."""
        if self.scope == "model" and not self.scorer.shares_layers:
            return ("scope='model'", f"its top-k runs over every layer's scores of the whole context at once, and scorer "
                    f"{self.scorer.name!r} knows no per-layer shares of the budget in advance (KVzap's do)", "scope='layer'")
        if self.evicted_slots:
            return (f"evicted_slots={self.evicted_slots}", "its summary of the evicted tokens is made once, from the whole context",
                    "evicted_slots=0")
        if self.refit != "none":
            return (f"refit={self.refit!r}", "its fit uses the queries of the whole context at once", "refit='none'")
        return None

    def check_model(self, compressed_layers: tuple[int, ...], kv_heads: int, hidden_size: int) -> None:
        self.scorer.check_model(compressed_layers, kv_heads, hidden_size)

    def file_digests(self) -> dict[str, str]:
        return self.scorer.file_digests()

    def check_mode(self, mode: str) -> None:
        whole = self.whole_context()
        if whole is not None and mode != "prefill":
            setting, why, streams = whole
            raise ValueError(f"method 'adakv' with {setting} runs in mode 'prefill' only, got mode={mode!r}: {why}, which a stream "
                             f"of blocks ('chunked', 'decode') never has; use mode='prefill' or {streams}")
        self.scorer.check_mode(mode)

    @property
    def ranks_by_entry_score(self) -> bool:
        """Whether a token's rank is fixed when it enters a stream: the scorer scores on entry (`scores_on_entry`,
        KVzap) and `head_scores` passes its scores on unchanged (normalize "none", span 1). `AdaptiveBlockwiseState` then
        turns away, as they enter, tokens no later re-compression could keep, and leaves itself at least
        `ENTRY_SCORE_ROOM` slots of room."""
        return self.scorer.scores_on_entry and self.normalize == "none" and self.span == 1

    @property
    def stream_rows_apart(self) -> bool:
        """A stream pads every head of a batch's held tokens to the longest head of the batch (`AdaptiveBlockwiseState`):
        scores fixed on entry do not see the padding, a scorer's softmax or pooling over a head's keys does."""
        return self.ranks_by_entry_score

    def layer_budget(self, budget: int, layer_idx: int, middle_length: int | None) -> int:
        """scope "model" (in a stream, or in prefill mode with layer_split "learned"): layer `layer_idx`'s share of the
        model's budget, `budget` per head on average over the layers. Its share s is alpha_safeguard + (1 - alpha_safeguard)·(the scorer's `layer_shares` at the kept
        fraction budget / middle_length), mean 1 over the layers, as every head keeps floor(alpha_safeguard·budget) in
        prefill mode; the layer's budget is 2 + floor((budget - 2)·s), at least the 2 slots a stream works in
        (`budget.stream_split`), so the L layers' budgets sum to at most L·budget. scope "layer": `budget`."""
        if self.scope != "model" or budget <= 2:
            return budget
        if middle_length is None:
            raise ValueError("adakv with scope='model' shares the model's budget among the layers of a stream by the fraction of the "
                             "stream it keeps: give the cache the stream's length (CompressedCache(..., stream_length=N)) or use "
                             "scope='layer'")
        shares = self.scorer.layer_shares(min(1.0, budget / as_count("middle_length", middle_length, 1)))
        if shares is None or layer_idx not in shares:
            raise ValueError(f"adakv with scope='model' in a stream needs the scorer's share for layer {layer_idx}; scorer "
                             f"{self.scorer.name!r} has {'none' if shares is None else f'shares for layers {sorted(shares)}'}")
        share = self.alpha_safeguard + (1.0 - self.alpha_safeguard) * shares[layer_idx]
        return 2 + math.floor((budget - 2) * share)

    def safeguard(self, budget: int) -> int:
        """Tokens every head keeps of its own at this budget: floor(alpha_safeguard·budget)."""
        return floor_share(self.alpha_safeguard, budget)

    def check_inputs(self, tokens: Tokens) -> None:
        self.check_parts_inputs([self.scorer], tokens)

    def on_entry(self, tokens: Tokens) -> Tokens:
        """The scorer's (KVzap's scores a block as it enters a stream)."""
        return self.scorer.on_entry(tokens)

    def head_scores(self, tokens: Tokens, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scores [B, H_kv, n] float32: the scorer's, made comparable across heads (`normalize`), then max-pooled over
        `span` neighbouring tokens; the middle's normalisers the scorer formed for its queries, or None:
        `ScoreMethod.score_and_middle_lse`, which `refit` uses)."""
        scores, middle_lse = self.scorer.score_and_middle_lse(tokens, generator)
        scores = scores.float()
        if self.normalize == "softmax":
            scores = torch.log_softmax(scores, dim=-1).nan_to_num(nan=-math.inf)
        return max_pool_scores(scores, self.span), middle_lse

    def kept_budget(self, budget: int) -> int:
        """Tokens kept per head on average at this budget: the budget less the `evicted_slots` that summarise the rest."""
        if self.evicted_slots >= budget:
            raise ValueError(f"evicted_slots={self.evicted_slots} leaves no slot to keep tokens in at budget {budget} per head: "
                             f"evicted_slots must be smaller than the budget (a lower compression_ratio or fewer evicted_slots)")
        return budget - self.evicted_slots

    def allocate(self, tokens: Tokens, budget: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(kept [B, H_kv, n] bool, the scores it was chosen by [B, H_kv, n], the middle's normalisers or None):
        `head_allocation` of `head_scores`."""
        scores, middle_lse = self.head_scores(tokens, generator)
        return head_allocation(scores, budget, self.safeguard(budget)), scores, middle_lse

    def summary(self, tokens: Tokens, kept: torch.Tensor, middle_lse: torch.Tensor | None = None) -> KVSummary:
        """The kept tokens (refitted: `refit`, with the scorer's normalisers `middle_lse` where it formed them), then
        (evicted_slots > 0) the summary of the evicted ones (`evicted_summary`)."""
        summary = kept_summary(tokens, kept)
        if self.refit != "none":
            fit_values = self.refit == "log_weights_values"
            log_weights, values = refit_kept(tokens, *padded_index(kept), summary.values, values=fit_values,
                                             middle_lse=middle_lse)
            return KVSummary(summary.keys, values, log_weights, summary.positions)
        if not self.evicted_slots:
            return summary
        return concat([summary, evicted_summary(tokens, ~kept, self.evicted_slots)])

    def compress(self, tokens: Tokens, budget: int, generator: torch.Generator) -> KVSummary:
        if tokens.length <= budget:
            return tokens.exact()
        kept, _, middle_lse = self.allocate(tokens, self.kept_budget(budget), generator)
        return self.summary(tokens, kept, middle_lse)

    def compress_layers(self, layers: list[Tokens], budget: int, generators: list[torch.Generator]) -> list[KVSummary]:
        """scope "model": the middles of every compressed layer [B, H_kv, n, d] (one context: the same B, H_kv and n in
        each), compressed together: one `head_allocation` over the scores of every layer's heads, L·H_kv·budget tokens
        per batch row in all; -> one summary per layer (`compress`'s layout)."""
        if layers[0].length <= budget:
            return [tokens.exact() for tokens in layers]
        kept, middle_lse = self.allocate_layers(layers, budget, generators)
        return [self.summary(*layer) for layer in zip(layers, kept, middle_lse)]

    def allocate_layers(self, layers: list[Tokens], budget: int,
                        generators: list[torch.Generator]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """scope "model": (kept [B, H_kv, n] bool per layer, the scorer's middle normalisers per layer or None) at
        `kept_budget(budget)` per head on average: layer_split "joint", one `head_allocation` of every layer's
        `head_scores`; "learned", a `head_allocation` of each layer's at its `layer_budget`."""
        scores, middle_lse = zip(*(self.head_scores(tokens, generator) for tokens, generator in zip(layers, generators)))
        kept_budget = self.kept_budget(budget)
        if self.layer_split == "learned":
            budgets = [self.layer_budget(kept_budget, tokens.layer_idx, tokens.length) for tokens in layers]
            return [head_allocation(layer, b, self.safeguard(b)) for layer, b in zip(scores, budgets)], list(middle_lse)
        kept = head_allocation(torch.cat(scores, dim=1), kept_budget, self.safeguard(kept_budget))
        return list(kept.split(layers[0].keys.shape[1], dim=1)), list(middle_lse)

    def new_stream(self, budget: int, generator: torch.Generator, slack: float | None = None) -> "AdaptiveBlockwiseState":
        whole = self.whole_context()
        if whole is not None:
            setting, why, streams = whole
            raise ValueError(f"adakv with {setting} has no stream: {why}; use {streams} to stream (kvc.stream, modes 'chunked' and "
                             "'decode')")
        return AdaptiveBlockwiseState(self, budget, generator, self.stream_slack(slack))


def kept_summary(tokens: Tokens, kept: torch.Tensor) -> KVSummary:
    """The tokens `kept` [B, H, n] bool of `tokens`, each head's in ascending order, shorter heads padded at the end
    with empty slots (log-weight -inf, position -1, zero keys and values) to the most any head keeps."""
    index, real = padded_index(kept)
    empty = ~real
    keys = take_slots(tokens.keys, index).masked_fill(empty.unsqueeze(-1), 0)
    values = take_slots(tokens.values, index).masked_fill(empty.unsqueeze(-1), 0)
    positions = take_slots(tokens.positions, index).masked_fill(empty, -1)
    log_weights = torch.zeros(real.shape, device=keys.device, dtype=torch.float32).masked_fill(empty, float("-inf"))
    return KVSummary(keys, values, log_weights, positions)


def evicted_summary(tokens: Tokens, evicted: torch.Tensor, slots: int) -> KVSummary:
    """The tokens `evicted` [B, H, n] bool of `tokens` summarised in `slots` slots per head: each head's evicted tokens,
    in position order, cut into `slots` runs of (nearly) equal count; a run's slot holds its tokens' mean key and mean
    value (computed in float32, stored in the keys' dtype), its last position, and log-weight log(count), so it
    attends as if each of its tokens had the mean key. By Jensen's inequality that mass, count·exp(s<q, mean key>),
    is never more than the tokens' own, Σ exp(s<q, k>). A head with fewer than `slots` evicted tokens leaves the
    rest empty (log-weight -inf, position -1, zero key and value)."""
    count = evicted.sum(-1, keepdim=True)
    rank = evicted.long().cumsum(-1) - 1
    run = torch.where(evicted, rank * slots // count.clamp_min(1), slots)  # `slots`: not evicted, in no run
    members = torch.nn.functional.one_hot(run, slots + 1)[..., :slots].float()  # [B, H, n, slots]
    sizes = members.sum(2)  # [B, H, slots]
    share = members / sizes.clamp_min(1).unsqueeze(2)
    keys = torch.einsum("bhns,bhnd->bhsd", share, tokens.keys.float()).to(tokens.keys.dtype)
    values = torch.einsum("bhns,bhnd->bhsd", share, tokens.values.float()).to(tokens.values.dtype)
    positions = torch.where(members.bool(), tokens.positions.unsqueeze(-1), -1).amax(2)
    log_weights = torch.where(sizes > 0, sizes.clamp_min(1).log(), float("-inf"))
    return KVSummary(keys, values, log_weights, positions)


@saved("adaptive_blockwise_state", 4)
class AdaptiveBlockwiseState(BlockwiseState):
    """`BlockwiseState` for head-adaptive budgets, stored ragged: a re-compression keeps H_kv·target tokens per batch
    row (`AdaKV.allocate`'s rule, `head_allocation`), each head as many as it wins, packed head after head
    (`kept`, a `RaggedSummary`, with kv_bits a `QuantizedRaggedSlots`: only the kept slots are stored); the tokens
    absorbed since then wait in the rectangular buffer (`slots`: every head takes every token) until it holds
    `slack_slots` (the room `budget.stream_split` leaves) per head, when everything held is re-allocated again. So
    a layer row stores at most H_kv·budget slots at any time, the block being absorbed included, as the other
    block-wise streams do per head, while each head keeps what the joint top-k gives it.

    A re-compression scores the held tokens as one rectangle, each head's kept tokens unpacked and padded to the
    longest head with empty slots (zero keys and values, position -1), then its new tokens; the empty slots' scores
    are set to -inf before the joint top-k, so they are never kept. A scorer that reads every key of a head (SnapKV's
    softmax, KeyDiff's mean key) sees the zero keys beside the real ones: a departure from scoring the held tokens
    alone (KeyDiff's scores do not change: a zero key moves the mean's length, not its direction). In a batch the
    padding runs to the longest head of any row, so a row would be scored beside the others: such a stream takes one
    row (`AdaKV.stream_rows_apart`).

    Scores fixed when a token enters (`Tokens.entry_scores`: KVzap's, ranked as they are, `AdaKV.ranks_by_entry_score`)
    let the stream turn tokens away as they enter. After a re-compression, a head's floor (the lowest of its own top
    floor(alpha_safeguard·target) scores) and the row's cutoff (the lowest score that won a slot of the joint top-k)
    can only rise at later re-compressions, which rank a superset of candidates for the same number of slots; so a new
    token scoring below both in every head of every row could never be kept, and is not stored (`admission`: the
    floors of `allocation_priority`, and each row's lowest priority kept, +inf when every kept slot is guaranteed). The
    stream then re-compresses only when tokens that may still be kept overflow its room, and then once for the block:
    what is held and the block's admitted tokens but the last room's worth are ranked together, the block's tokens read
    where the block is (never buffered first) and only those that win a slot stored; the last ones then wait in the
    room, as a stream taking the block a room at a time would leave them. So the layer row stores at most H_kv·budget
    slots throughout, and a block costs at most one re-compression whatever the room; the room is at least
    `ENTRY_SCORE_ROOM` slots (up to half the budget), so that a small budget (a layer with a small share of the
    model's) does not re-compress at nearly every admitted token of decode mode's answer.

    With kv_bits every slot is stored quantized, each on its own (`QuantizedSlots`: keys and values per slot over groups
    of channels) once, when it enters: the new tokens wait in a quantized buffer, and a re-compression keeps the stored
    codes of the tokens it keeps, packed as they are at full precision (`QuantizedRaggedSlots`). So everything above
    holds in kv_bits bits: the same slots, each dequantized as it was quantized on entry.
    """

    saved_fields = {**BlockwiseState.saved_fields, "kept": Maybe(Instance("ragged_summary", "quantized_ragged_slots")), "kept_extra": Sequence(Tensor("* ..."), kind="tuple"),
                    "admission": Maybe(Sequence(Tensor("* ..."), kind="tuple", size=2))}

    # (floors [B, H], cutoffs [B]) of the last re-compression over entry scores, or None (none yet, or scores that are
    # not fixed on entry); saved with the stream, which admits later tokens by it (the class docstring)
    admission: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, method: Method, budget: int, generator: torch.Generator, slack: float):
        _, room = stream_split(budget, check_slack(slack))
        if method.ranks_by_entry_score:
            room = max(room, min(ENTRY_SCORE_ROOM, budget // 2))
        super().__init__(method, budget, generator, slack, split=(budget - room, room))
        # the tokens the last re-compression kept, packed (None before the first); quantized with kv_bits
        self.kept: RaggedSummary | QuantizedRaggedSlots | None = None
        self.kept_extra: tuple[torch.Tensor, ...] = ()  # their other stored columns (pre-RoPE keys), packed as `kept`

    def absorb(self, tokens: Tokens, codes=None) -> None:
        """`BlockwiseState.absorb`; with scores fixed on entry, only of the tokens a later re-compression could still
        keep (`admission`, checked again after each re-compression the block causes); the others count as seen and are
        not stored."""
        if codes is not None or tokens.entry_scores is None or not self.method.ranks_by_entry_score:
            return super().absorb(tokens, codes)
        rest = self._admitted(tokens)
        while rest is not None:
            room = self.limit + self.slack_slots - self.held_slots()
            if rest.length <= room:
                return super().absorb(rest)
            if self.kept is not None:  # one re-compression over what is held and the rest of the block but its last room
                tail = min(rest.length, self.slack_slots)
                self.seen += rest.length - tail
                self.last = tokens.scoring_context(self.method.queries_read)
                self._recompress_by_entry_scores(rest.slice(0, rest.length - tail) if tail < rest.length else None)
                rest = self._admitted(rest.slice(rest.length - tail, rest.length))
                continue
            if room <= 0:  # the first re-compression, of the buffer alone
                self.recompress(room=self.slack_slots)
                rest = self._admitted(rest)
                continue
            super().absorb(rest.slice(0, room))
            rest = rest.slice(room, rest.length)

    def _admitted(self, tokens: Tokens) -> Tokens | None:
        """The tokens scoring at least a head's floor or the row's cutoff of the last re-compression in some head of some
        row (all of them before the first); the rest are counted as seen. None when none is left."""
        if self.admission is None:
            return tokens
        floors, cutoffs = self.admission
        scores = tokens.entry_scores
        admitted = ((scores >= floors.unsqueeze(-1)) | (scores >= cutoffs[:, None, None])).flatten(0, 1).any(0)  # [n]
        kept = admitted.nonzero().squeeze(1)
        self.seen += tokens.length - kept.numel()
        if kept.numel() == tokens.length:
            return tokens
        return tokens.select(kept.expand(*scores.shape[:2], -1)) if kept.numel() else None

    def check_saved(self) -> None:
        super().check_saved()
        if self.kept is not None:
            b, h = self.kept.counts.shape
            if int(self.kept.counts.sum()) != b * h * self.target or self.log_weights is not None or self.limit != self.target:
                raise ValueError(f"{int(self.kept.counts.sum())} packed slots for {b}x{h} heads of target {self.target}")
            if any(t.shape[0] != self.kept.positions.shape[0] for t in self.kept_extra):
                raise ValueError("the packed extra columns do not match the packed slots")
            if self._quantized():
                layout = (self.slots.bits, self.slots.group_size, self.slots.dims)
                kept = (self.kept.keys.bits, self.kept.keys.group_size, (self.kept.keys.dim, self.kept.values.dim)) \
                    if isinstance(self.kept, QuantizedRaggedSlots) else None
                if kept != layout:
                    raise ValueError(f"a quantized buffer of (bits, group size, dims) {layout} holds kept slots "
                                     f"{'of ' + str(kept) if kept else 'at full precision'}: expected quantized_ragged_slots of the same")
            elif not isinstance(self.kept, RaggedSummary):
                raise ValueError(f"a full-precision buffer holds kept slots stored as {type(self.kept).saved_name}: expected a ragged_summary")
        if self.admission is not None:
            floors, cutoffs = self.admission
            if self.kept is None or floors.shape != self.kept.counts.shape or cutoffs.shape != floors.shape[:1]:
                raise ValueError(f"admission floors {list(floors.shape)} and cutoffs {list(cutoffs.shape)} must be [B, H] and [B] "
                                 "of a stream that has re-compressed")

    def held_slots(self) -> int:
        return self.slots.length + (self.target if self.kept is not None else 0)

    def most_slots(self) -> int:
        return self.seen - (self.target if self.kept is not None else 0)

    def _quantized(self) -> bool:
        return isinstance(self.slots, QuantizedSlots)

    def _stored_new(self) -> tuple[torch.Tensor, ...]:
        """The buffer's columns [B, H, r, ...] as stored (`_stored_kept`'s order: with kv_bits, codes, scales and zero
        points for keys and values)."""
        return self.slots.stored() if self._quantized() else self.slots.view()

    def _stored_kept(self) -> tuple[torch.Tensor, ...]:
        """The kept tokens' packed columns [T, ...] as stored: keys and values (with kv_bits, their codes, scales and
        zero points), positions, then the extra columns."""
        kept = self.kept.stored_columns() if self._quantized() else (self.kept.keys, self.kept.values, self.kept.positions)
        return (*kept, *self.kept_extra)

    def _held_columns(self) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """(every held column [B, H, m + r, ...] as stored (`_stored_kept`'s order): the kept tokens unpacked to a
        rectangle, the padding's columns zeros and its positions -1, then the new tokens; empty [B, H, m + r] bool, the
        padding's slots, or None before the first re-compression)."""
        new = self._stored_new()
        if self.kept is None:
            return new, None
        place, at = self.kept._slots(), self._positions_column()
        kept = tuple(self.kept.unpacked(c.long(), -1, place) if i == at else self.kept.unpacked(c, 0, place)
                     for i, c in enumerate(self._stored_kept()))
        columns = tuple(torch.cat([k, n], 2) for k, n in zip(kept, new)) if new else kept
        return columns, columns[at] < 0  # an empty slot's position is -1, every token's at least 0

    def _positions_column(self) -> int:
        """Where the positions are among the stored columns (after keys and values, or their codes, scales and zero points)."""
        return 6 if self._quantized() else 2

    def _held_tokens(self, columns: tuple[torch.Tensor, ...]) -> Tokens:
        """The tokens of held columns as stored (`_held_columns`; with kv_bits their keys and values dequantized), with the
        latest block's queries and exact neighbours, and pre-RoPE keys for a method that reads them."""
        held = tokens_from_columns(self.last, self.slots.decoded(columns) if self._quantized() else columns)
        return replace(held, pre_rope_keys=held.pre_rope()) if self.method.requirements.needs("pre_rope_keys") else held

    def held(self) -> Tokens:
        return self._held_tokens(self._held_columns()[0])

    def recompress(self, room: int) -> None:
        if self.held_slots() <= self.target:
            return
        fixed = self.last.entry_scores is not None and self.method.ranks_by_entry_score
        if fixed and self.kept is not None:
            self._recompress_by_entry_scores()
        else:
            self._recompress_held(fixed)

    def _recompress_held(self, fixed: bool) -> None:
        """`recompress` in general: every held column unpacked to one rectangle (`_held_columns`), scored by the method
        (the empty slots -inf), the kept tokens' columns gathered from it. fixed: the scores are the entry scores."""
        columns, empty = self._held_columns()
        scores, _ = self.method.head_scores(self._held_tokens(columns), self.generator)
        if empty is not None:
            scores = scores.masked_fill(empty, -math.inf)
        kept = self._allocate(scores, fixed)
        slots = kept.flatten().nonzero().squeeze(1)  # the kept slots of the [B·H·n] rectangle, head after head: packed order
        self._store([column.flatten(0, 2).index_select(0, slots) for column in columns], kept)

    def _recompress_by_entry_scores(self, block: Tokens | None = None) -> None:
        """`recompress` when the ranks are the entry scores (`AdaKV.ranks_by_entry_score`) and a re-compression kept
        tokens before, with the outcome of `_recompress_held`: only the kept tokens' scores are unpacked to the
        rectangle the allocation ranks (the kept slots of each head, empty ones to the longest head, then the new
        tokens: the same scores `head_scores` would give); each stored column of the tokens kept is then gathered at
        once from the packed slots and the buffer, never unpacked. block: tokens arriving now that take part without
        being buffered first (the new tokens are the buffer's then theirs): only those kept are stored."""
        new = self._stored_new()
        if block is not None:
            arriving = self.columns(block)
            if self._quantized():
                arriving = self.slots.encode(arriving)
            new = tuple(torch.cat([n, a], 2) for n, a in zip(new, arriving)) if new else arriving
        kept_scores = self.kept.unpacked(self.kept_extra[-1], -math.inf)  # the entry scores are the last column
        kept = self._allocate(torch.cat([kept_scores, new[-1].float()], 2), fixed=True)
        width, old_width = kept.shape[2], self.kept.num_slots
        slots = kept.flatten().nonzero().squeeze(1)  # packed order, as in `recompress`
        head, column_index = slots.div(width, rounding_mode="floor"), slots.remainder(width)
        counts = self.kept.counts.flatten().long()
        old_source = (counts.cumsum(0) - counts)[head] + column_index
        new_source = self.kept.positions.shape[0] + head * (width - old_width) + column_index - old_width
        source = torch.where(column_index < old_width, old_source, new_source)  # into [packed kept slots; buffer rows]
        at = self._positions_column()
        fresh = (*new[:at], int32_positions(new[at]), *new[at + 1 :])
        self._store([torch.cat([o, f.flatten(0, 2)]).index_select(0, source) for o, f in zip(self._stored_kept(), fresh)], kept)

    def _allocate(self, scores: torch.Tensor, fixed: bool) -> torch.Tensor:
        """kept [B, H, n]: the re-compression's `head_allocation` of the held tokens' scores [B, H, n] (empty slots
        -inf) to the target; with scores fixed on entry, the `admission` rule it leaves for later tokens."""
        priority, floors = allocation_priority(scores, min(self.method.safeguard(self.target), self.target))
        kept = joint_top(priority, self.target)  # `head_allocation`: more than the target are held
        self.admission = (floors, priority.masked_fill(~kept, math.inf).flatten(1).amin(-1)) if fixed else None
        return kept

    def _store(self, packed: list[torch.Tensor], kept: torch.Tensor) -> None:
        """Keep the packed columns [T, ...] of the tokens `kept` [B, H, n] chose, as stored (`_stored_kept`'s order);
        the buffer starts empty again (the room is allocated with the next token)."""
        at, counts = self._positions_column(), kept.sum(-1).to(torch.int32)
        if self._quantized():
            self.kept = QuantizedRaggedSlots.of_stored(packed[: at + 1], counts, self.slots)
            self.slots = self.slots.emptied()
        else:
            self.kept = RaggedSummary(packed[0], packed[1], None, int32_positions(packed[2]), counts)
            self.slots = _GrowingSlots()
        self.kept_extra = tuple(packed[at + 1 :])
        self.limit = self.target

    def compact(self) -> None:
        if self.slots.tensors:
            held = self.slots.view()
            self._refill(held, held[2], held[0].shape[2])

    def summary_parts(self) -> list[KVSummary | RaggedSummary]:
        """The kept tokens, packed (a `RaggedSummary`: attention reads it where it is stored), then the new ones."""
        if self.kept is None:
            return super().summary_parts()
        parts = [self.kept.ragged() if self._quantized() else self.kept]
        if self.slots.length:
            keys, values, positions, *_ = self.slots.view()
            parts.append(KVSummary.exact(keys, values, positions))
        return parts

    def summary(self) -> KVSummary | None:
        return super().summary() if self.kept is None else concat_parts(self.summary_parts())

    def nbytes(self) -> int:
        """KV bytes: the packed kept slots (with their per-head counts and any packed pre-RoPE keys) and the buffer of
        new tokens as allocated."""
        kept = self.kept.nbytes() + sum(t.numel() * t.element_size() for t in self.kept_extra if t.ndim == 2) if self.kept is not None else 0
        return kept + self.slots.kv_bytes()

