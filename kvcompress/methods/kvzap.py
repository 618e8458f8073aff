"""KVzap: learned KVzip scores, computed from what a layer already has when a token enters the cache.

Jégou and Jeblick, "KVzap: Fast, Adaptive, and Faithful KV Cache Pruning", arXiv:2601.07891.

KVzip (Kim et al., arXiv:2505.23416; `methods.kvzip`) scores a context token by the largest attention it receives
while the model repeats the context: query-agnostic and accurate, but it costs a second forward over the whole
context and needs the context at once. KVzap trains a small surrogate per layer to predict that score from the
token's own layer input, so that a token is scored the moment it enters the cache, in one-shot and streaming modes
alike, for a few multiply-adds per token.

The surrogate (`Surrogate`) maps each token's hidden state at the layer's input (after the layer's input norm: what
the attention module receives, `Tokens.hidden_states`) to one score per KV head, either linearly (W x + b) or through a
2-layer MLP (W2 gelu(W1 x + b1) + b2), the input's standardisation folded into the first layer. On tuning text the
hidden states predicted KVzip's scores better than the layer's own keys or keys and values (`docs/design.md`,
"KVzap: KVzip's scores, learned").
Its target is KVzip's log-score (`integration.scorer_training`), a log-probability on the same scale in every layer
and head, so heads or layers can share a budget by score (`AdaKV(scorer=KVzap())`).

A token is scored once, when it enters: in prefill mode from the context's hidden states, in a stream as each block
arrives (`on_entry`: the stream keeps the score, one number per head, and never the hidden state), so the same scorer
runs in prefill, chunked and decode modes within the stream's memory, with no second forward.

A scorer file also records each layer's distribution of predicted scores on the training text (`score_quantiles`).
From it, `layer_shares` tells how one budget over every layer would be shared out if all layers' tokens were ranked
together, which lets `AdaKV(scorer=KVzap(), scope="model")` give each layer of a stream its share of the model's budget
before the context is seen (a stream never has every layer's scores at once).

Two ways to keep tokens:
- a budget (the compression ratio): the top `budget` per head (`ScoreMethod.compress`), in every mode;
- KVzap's threshold (`threshold`, a log-score): a token is kept when its predicted score is at least the threshold,
  within the budget (a ratio of 0 sets no budget, so the threshold alone decides); heads keep different numbers of
  tokens, stored ragged, and the realised ratio is what the stored summary holds. In every mode: a stream decides
  as each token leaves the exact window (`ThresholdState`), which keeps what one pass over the whole context keeps.

Weights: `kvcompress train-scorer` fits them (`integration.scorer_training`); the default model's ship with the
package (`SHIPPED`), any other model's load from a path (`scorer=`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

import torch

from ..checks import as_real
from ..ragged import RaggedSummary, int32_positions
from ..saved_state import Count, Instance, Linked, Maybe, Tensor, canonical_safetensors, saved, write_whole
from ..summary import KVSummary
from .adakv import kept_summary
from .base import ScoreMethod, StreamState, top_index
from .registry import register
from .requirements import Requirements
from .tokens import Tokens

SURROGATE_FORMAT = "kvcompress-kvzap-surrogate"
SURROGATE_VERSION = 2  # 2: the tensors' checksum in the metadata
KINDS = ("linear", "mlp")
# scorer="default": the weights shipped for the default model, in the package's `scorers` folder
SHIPPED = {"default": "smollm2-135m-kvzap.safetensors"}
TRAIN_COMMAND = "kvcompress train-scorer --out FILE"
ANOTHER_MODEL = ("it belongs to another model. KVzap's scores (method 'kvzap', and the default: AdaKV over them) need a scorer "
                 f"trained for this model: train it with `{TRAIN_COMMAND}` and pass method='adakv', scorer='kvzap', "
                 "scorer_params={'scorer': FILE}, or name another method (e.g. method='snapkv')")
# quantile levels 0, 1/(Q-1), ..., 1 of each layer's predicted scores on the training text (`Surrogate.score_quantiles`)
SCORE_QUANTILES = 257


class SurrogateError(ValueError):
    """A scorer file that cannot be used: missing, unreadable, of another format, or of another model's shapes."""


@dataclass(frozen=True)
class Surrogate:
    """Per-layer, per-KV-head surrogates of one model, stacked over its full-attention layers.

    Each head's surrogate reads a token's hidden state at the layer's input (width d_model). kind: "linear" or "mlp". layers: the model's layer index of each row of the stacks. first_weight [L, H_kv, d_in, h]
    and first_bias [L, H_kv, h] (h = 1 for "linear"); second_weight [L, H_kv, h, 1] and second_bias [L, H_kv, 1]
    ("mlp" only, else None); float32, the input's standardisation folded in. model: the name of the model the weights
    were trained on; meta: how they were trained (text, seed, fidelity), as recorded. score_quantiles [L, Q] float32 or
    None (a file written before they were recorded): each layer's predicted scores on the training text, every head
    and token pooled, at the quantile levels 0, 1/(Q-1), ..., 1 (non-decreasing); `layer_shares` reads them.
    """

    kind: str
    layers: tuple[int, ...]
    first_weight: torch.Tensor
    first_bias: torch.Tensor
    second_weight: torch.Tensor | None = None
    second_bias: torch.Tensor | None = None
    model: str = ""
    meta: dict = field(default_factory=dict)
    score_quantiles: torch.Tensor | None = None
    source: str = field(default="", compare=False)  # the file it was loaded from ("" when built in memory), for messages

    @property
    def digest(self) -> str:
        """SHA-256 of the weights and score quantiles (`tensors_digest`): what a file records and a saved cache checks."""
        return tensors_digest(self.tensors())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors a file holds, by name, float32."""
        tensors = {"first_weight": self.first_weight, "first_bias": self.first_bias}
        if self.kind == "mlp":
            tensors |= {"second_weight": self.second_weight, "second_bias": self.second_bias}
        if self.score_quantiles is not None:
            tensors["score_quantiles"] = self.score_quantiles
        return {k: v.float().contiguous() for k, v in tensors.items()}

    def check_fits(self, compressed_layers: tuple[int, ...], kv_heads: int, hidden_size: int) -> None:
        """A SurrogateError unless these surrogates cover exactly a model's compressed (full-attention) layers
        `compressed_layers`, for its `kv_heads` KV heads and hidden states of width `hidden_size`: a file trained for
        another model would score layers it never saw, or share a budget over layers the model does not have."""
        if tuple(sorted(self.layers)) != tuple(compressed_layers) or (kv_heads, hidden_size) != (self.kv_heads, self.input_width):
            raise SurrogateError(f"{self.named} covers layers {list(self.layers)} with {self.kv_heads} KV heads of width "
                                 f"{self.input_width}; this model compresses layers {list(compressed_layers)} with {kv_heads} of "
                                 f"width {hidden_size}: {ANOTHER_MODEL}")

    @property
    def named(self) -> str:
        """How errors name these weights: the KVzap scorer, its file and the model it was trained on."""
        return f"the KVzap scorer{f' {self.source!r}' if self.source else ''} (trained on model {self.model!r})"

    @property
    def kv_heads(self) -> int:
        return self.first_weight.shape[1]

    @property
    def input_width(self) -> int:
        return self.first_weight.shape[2]

    def row(self, layer_idx: int | None) -> int:
        """The stacks' row of model layer `layer_idx` (a clear error for a layer the file has no surrogate for)."""
        if layer_idx not in self.layers:
            raise SurrogateError(f"{self.named} has no surrogate for layer {layer_idx}: it "
                                 f"covers layers {list(self.layers)}; a cache passes each layer's index (kvc.compress takes "
                                 f"layer=(layer_idx, num_layers)); for another model train a scorer with `{TRAIN_COMMAND}`")
        return self.layers.index(layer_idx)

    def reads(self, kv_heads: int, input_width: int) -> bool:
        """Whether these surrogates read hidden states of `input_width` for `kv_heads` KV heads (the model they were trained
        on has that shape)."""
        return (kv_heads, input_width) == (self.kv_heads, self.input_width)

    def predict(self, inputs: torch.Tensor, layer_idx: int | None) -> torch.Tensor:
        """[B, H_kv, n] float32: predicted KVzip log-scores at layer `layer_idx` of inputs [B, H_kv, n, d_in] (any float dtype;
        head h's rows are what head h's surrogate reads)."""
        if not self.reads(inputs.shape[1], inputs.shape[-1]):
            raise SurrogateError(f"{self.named} reads hidden states of width {self.input_width} "
                                 f"for {self.kv_heads} KV heads, got {inputs.shape[1]} heads of width {inputs.shape[-1]}: "
                                 f"{ANOTHER_MODEL}")
        i = self.row(layer_idx)
        device = inputs.device
        out = torch.matmul(inputs.float(), self.first_weight[i].to(device)) + self.first_bias[i].to(device).unsqueeze(1)
        if self.kind == "mlp":
            out = torch.matmul(torch.nn.functional.gelu(out), self.second_weight[i].to(device)) + self.second_bias[i].to(device).unsqueeze(1)
        return out.squeeze(-1)

    def layer_shares(self, kept_fraction: float) -> dict[int, float]:
        """{layer index: share}, mean 1: each layer's part of one budget over every layer that keeps `kept_fraction` in
        (0, 1] of the tokens, if the tokens of every layer were ranked together by predicted score (AdaKV's scope
        "model"), as the training text's score quantiles tell: the threshold t at which the layers keep
        `kept_fraction` of their tokens on average, each layer's share the fraction of its own scores at or above t
        over that average. Each layer's distribution is read piecewise linearly between its quantiles, so the shares
        are exact for those distributions. A SurrogateError for a file with no quantiles."""
        import numpy as np

        if self.score_quantiles is None:
            raise SurrogateError(f"{self.named} records no score quantiles, so it cannot share "
                                 f"a budget over the layers of a stream: train it again with `{TRAIN_COMMAND}`")
        if isinstance(kept_fraction, bool) or not isinstance(kept_fraction, (int, float)) or not 0.0 < kept_fraction <= 1.0:
            raise ValueError(f"kept_fraction must be a number in (0, 1] (the share of the tokens kept), got {kept_fraction!r}")
        quantiles = self.score_quantiles.double().numpy()
        levels = np.linspace(0.0, 1.0, quantiles.shape[1])
        knots = np.unique(quantiles)
        above = np.mean([1.0 - np.interp(knots, row, levels) for row in quantiles], axis=0)  # non-increasing in the knots
        threshold = np.interp(kept_fraction, above[::-1], knots[::-1])
        shares = np.array([1.0 - np.interp(threshold, row, levels) for row in quantiles]) / kept_fraction
        shares *= len(shares) / shares.sum()  # mean exactly 1 (the interpolation's rounding aside)
        return {layer: float(share) for layer, share in zip(self.layers, shares)}

    def save(self, path: str | Path) -> None:
        """Write the weights (and score quantiles) as safetensors, with their format, kind, layers, model and meta in its
        metadata."""
        from safetensors.torch import save

        tensors = self.tensors()
        header = {"format": SURROGATE_FORMAT, "version": str(SURROGATE_VERSION), "kind": self.kind,
                  "layers": json.dumps(list(self.layers)), "model": self.model, "meta": json.dumps(self.meta, sort_keys=True),
                  "sha256": tensors_digest(tensors)}
        # written whole (a failed write leaves the file there before), with the umask's permissions (safetensors'
        # save_file makes the file private to its owner)
        write_whole(path, canonical_safetensors(save(tensors, metadata=header)))

    @classmethod
    def load(cls, path: str | Path) -> "Surrogate":
        """The weights in `path` (written by `save`), checked whole: a `SurrogateError` naming the file and what is wrong."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise SurrogateError(f"KVzap scorer file {str(path)!r} {'is a directory' if path.is_dir() else 'does not exist'}; train "
                                 f"one with `{TRAIN_COMMAND}`")
        try:
            with safe_open(str(path), framework="pt") as f:
                header = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as error:  # safetensors raises its own types for a damaged file
            raise SurrogateError(f"KVzap scorer file {str(path)!r} is not a readable safetensors file ({error}); train one with "
                                 f"`{TRAIN_COMMAND}`") from None
        return cls.from_parts(header, tensors, str(path))

    @classmethod
    def from_parts(cls, header: dict, tensors: dict, source: str) -> "Surrogate":
        """Check a file's metadata and tensors against the format, then build (`load`)."""
        def fail(what):
            raise SurrogateError(f"KVzap scorer file {source!r}: {what}; train one with `{TRAIN_COMMAND}`")

        if header.get("format") != SURROGATE_FORMAT:
            fail(f"format {header.get('format')!r}, expected {SURROGATE_FORMAT!r} (written by `kvcompress train-scorer`)")
        if header.get("version") != str(SURROGATE_VERSION):
            fail(f"version {header.get('version')!r}; this kvcompress reads version {SURROGATE_VERSION}: train it again")
        if header.get("kind") not in KINDS:
            fail(f"kind {header.get('kind')!r}: expected one of {KINDS}")
        try:
            layers, meta = tuple(json.loads(header.get("layers", ""))), json.loads(header.get("meta", "{}"))
        except ValueError:
            fail("layers and meta must be JSON")
        if not layers or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers) or len(set(layers)) != len(layers):
            fail(f"layers must be distinct layer indices, got {header.get('layers')!r}")
        names = {"first_weight", "first_bias"} | ({"second_weight", "second_bias"} if header["kind"] == "mlp" else set())
        if set(tensors) - {"score_quantiles"} != names:
            fail(f"tensors {sorted(tensors)}, expected {sorted(names)} (and optionally score_quantiles) for kind {header['kind']!r}")
        quantiles = tensors.pop("score_quantiles", None)
        w1, b1 = tensors["first_weight"], tensors["first_bias"]
        shapes_ok = w1.ndim == 4 and w1.shape[0] == len(layers) and min(w1.shape) >= 1 and tuple(b1.shape) == (*w1.shape[:2], w1.shape[3])
        if header["kind"] == "mlp":
            w2, b2 = tensors["second_weight"], tensors["second_bias"]
            shapes_ok = shapes_ok and tuple(w2.shape) == (*w1.shape[:2], w1.shape[3], 1) and tuple(b2.shape) == (*w1.shape[:2], 1)
        else:
            shapes_ok = shapes_ok and w1.shape[3] == 1
        if not shapes_ok:
            fail("tensor shapes " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in sorted(tensors.items())) + f" do not fit {len(layers)} layers")
        if not all(t.is_floating_point() and bool(torch.isfinite(t).all()) for t in tensors.values()):
            fail("weights must be finite floating-point numbers")
        if quantiles is not None and not (quantiles.ndim == 2 and quantiles.shape[0] == len(layers) and quantiles.shape[1] >= 2
                                          and quantiles.is_floating_point() and bool(torch.isfinite(quantiles).all())
                                          and bool((quantiles.diff(dim=1) >= 0).all())):
            fail(f"score_quantiles must be [{len(layers)} layers, >= 2 levels] finite and non-decreasing along each row, got "
                 f"{tuple(quantiles.shape)} {quantiles.dtype}")
        if header.get("sha256") != tensors_digest({**tensors, **({} if quantiles is None else {"score_quantiles": quantiles})}):
            fail("its tensors do not match the checksum it records (sha256): the file is damaged")
        return cls(header["kind"], layers, w1.float(), b1.float(), tensors.get("second_weight"),
                   tensors.get("second_bias"), header.get("model", ""), meta, None if quantiles is None else quantiles.float(), source)


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors' names, shapes and float32 bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].float().contiguous()
        digest.update(f"{name}{tuple(t.shape)}".encode())
        digest.update(t.numpy().tobytes())
    return digest.hexdigest()


def shipped_path(name: str) -> Path:
    """The path of a scorer shipped in the package (`SHIPPED`)."""
    return Path(str(resources.files("kvcompress") / "scorers" / SHIPPED[name]))


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, mtime_ns: int) -> Surrogate:
    return Surrogate.load(path)


def load_surrogate(scorer: str) -> Surrogate:
    """The surrogate `scorer` names: a key of `SHIPPED` (the package's own weights) or the path of a file `train-scorer`
    wrote. Loaded once per file version (a file rewritten in place is read again)."""
    path = shipped_path(scorer) if scorer in SHIPPED else Path(scorer)
    if not path.is_file():
        raise SurrogateError(f"KVzap scorer file {str(path)!r} {'is a directory' if path.is_dir() else 'does not exist'}: scorer takes {sorted(SHIPPED)} (the weights shipped "
                             f"for the default model) or the path of a file written by `{TRAIN_COMMAND}`")
    return _load_cached(str(path.resolve()), path.stat().st_mtime_ns)


@register
@dataclass
class KVzap(ScoreMethod):
    """Keep the tokens a learned surrogate of KVzip's score ranks highest (module docstring).

    scorer: "default" (the weights shipped for the default model) or the path of a file written by
    `kvcompress train-scorer`. threshold: None (keep the top `budget` per head, every mode), or a log-score: keep each
    token the surrogate scores at least this high, within the budget (KVzap's rule; heads keep different numbers of
    tokens; every mode, a stream through `ThresholdState`).
    """

    name = "kvzap"
    scores_on_entry = True
    default_sink = 4
    default_window = 64
    scorer: str = "default"
    threshold: float | None = None

    def __post_init__(self):
        if not isinstance(self.scorer, (str, os.PathLike)) or not str(self.scorer):
            raise ValueError(f"scorer must be {sorted(SHIPPED)} or the path of a KVzap scorer file, got {self.scorer!r}")
        self.scorer = str(self.scorer)
        if self.threshold is not None:
            self.threshold = as_real("threshold", self.threshold, "a log-score, e.g. -6.0, or None")
        self.surrogate = load_surrogate(self.scorer)
        self._memoize_layer_shares()

    def _memoize_layer_shares(self) -> None:
        # every layer's stream of a cache asks for the shares at the same kept fraction: computed once per fraction
        self._layer_shares = functools.lru_cache(maxsize=16)(self.surrogate.layer_shares)

    def __getstate__(self) -> dict:
        """Pickled (options sent to another process) with its surrogate, without the memo of `layer_shares` (a cache
        around a bound method, which pickle cannot write); unpickling builds a new one."""
        return {name: value for name, value in self.__dict__.items() if name != "_layer_shares"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._memoize_layer_shares()

    @property
    def requirements(self) -> Requirements:
        """The hidden states; with a threshold, heads keep different numbers of tokens (budget scope "layer", stored
        ragged)."""
        if self.threshold is None:
            return Requirements(inputs={"hidden_states"})
        return Requirements(inputs={"hidden_states"}, budget_scope="layer")

    @property
    def drops_within_budget(self) -> bool:
        """With a threshold, tokens scoring below it are dropped however many fit the budget (ratio 0: no budget)."""
        return self.threshold is not None

    @property
    def stream_recompresses(self) -> bool:
        """With a threshold, a stream decides each token once and never holds more than its budget: no slack."""
        return self.threshold is None

    def new_stream(self, budget: int, generator: torch.Generator, slack: float | None = None) -> StreamState:
        """A budget: the block-wise stream of every score method. A threshold: `ThresholdState`."""
        if self.threshold is None:
            return super().new_stream(budget, generator, slack)
        self.stream_slack(slack)  # refuses a slack: there is no re-compression to space out
        return ThresholdState(self, budget)

    def check_inputs(self, tokens: Tokens) -> None:
        if tokens.entry_scores is None:
            super().check_inputs(tokens)

    def check_model(self, compressed_layers: tuple[int, ...], kv_heads: int, hidden_size: int) -> None:
        self.surrogate.check_fits(compressed_layers, kv_heads, hidden_size)

    def file_digests(self) -> dict[str, str]:
        """{"scorer": the scorer's checksum}: the weights a saved stream goes on scoring with."""
        return {"scorer": self.surrogate.digest}

    def on_entry(self, tokens: Tokens) -> Tokens:
        """The block with its scores (`Tokens.entry_scores`) in place of its hidden states, which a stream never keeps."""
        if tokens.entry_scores is not None or tokens.hidden_states is None:
            return tokens
        return replace(tokens, hidden_states=None, entry_scores=self.score(tokens, None))

    def score(self, tokens: Tokens, generator: torch.Generator | None) -> torch.Tensor:
        """[B, H_kv, n] float32: the predicted KVzip log-score of every token (the scores it was given on entry, if any)."""
        if tokens.entry_scores is not None:
            return tokens.entry_scores
        self.check_inputs(tokens)
        return self.surrogate.predict(tokens.hidden_states, tokens.layer_idx)

    @property
    def shares_layers(self) -> bool:
        """Whether the scorer file records score quantiles (`layer_shares`)."""
        return self.surrogate.score_quantiles is not None

    def layer_shares(self, kept_fraction: float) -> dict[int, float] | None:
        """The surrogate's shares of a budget over every layer (`Surrogate.layer_shares`, from its scores on the training
        text); None for a scorer file that records no score quantiles."""
        return self._layer_shares(kept_fraction) if self.shares_layers else None

    def compress(self, tokens: Tokens, budget: int, generator: torch.Generator):
        if self.threshold is None:
            return super().compress(tokens, budget, generator)
        scores = self.score(tokens, generator)
        kept = scores >= self.threshold
        if tokens.length > budget:  # within the budget: a head keeps at most its top `budget`
            top = torch.zeros_like(kept).scatter_(-1, top_index(scores, budget), True)
            kept &= top
        return kept_summary(tokens, kept)


@saved("kvzap_threshold_state")
class ThresholdState(StreamState):
    """KVzap's threshold in a stream: each head keeps the tokens its surrogate scored at least `method.threshold` when
    they entered (`Tokens.entry_scores`), at most its `budget` best, packed head after head (`kept`, a `RaggedSummary`,
    with their scores in `kept_scores`). A head's best `budget` of everything it has seen are the best `budget` of what
    it kept and of the new tokens, so the state always holds what `KVzap.compress` keeps of every token absorbed so far,
    and it is never more than the budget per head: there is no room and no re-compression. Each absorb unpacks what is
    kept beside the new tokens (a workspace, as a re-compression's is) and packs the result again. A token is decided
    when it leaves the exact window: the stream hands the state every token from the first (`drops_within_budget`)."""

    saved_fields = {"method": Linked("method"), "budget": Count(1), "kept": Maybe(Instance("ragged_summary")),
                    "kept_scores": Maybe(Tensor("T")), "seen": Count()}

    def __init__(self, method: "KVzap", budget: int):
        self.method, self.budget = method, budget
        self.kept: RaggedSummary | None = None
        self.kept_scores: torch.Tensor | None = None  # [T] float32, the entry scores of the packed slots
        self.seen = 0

    def check_saved(self) -> None:
        if (self.kept is None) != (self.kept_scores is None):
            raise ValueError("kept slots and their scores must be saved together")
        if self.kept is not None:
            most = int(self.kept.counts.max())
            if self.kept_scores.shape != (self.kept.keys.shape[0],) or most > min(self.budget, self.seen):
                raise ValueError(f"{self.kept.keys.shape[0]} packed slots with {self.kept_scores.shape[0]} scores, {most} in one head, "
                                 f"for a budget of {self.budget} and {self.seen} tokens seen")
            if bool((self.kept_scores < self.method.threshold).any()):
                raise ValueError(f"kept slots score below the threshold {self.method.threshold}")

    def absorb(self, tokens: Tokens, codes=None) -> None:
        """Keep the new tokens that score at least the threshold, and per head the best `budget` of those and the kept."""
        if tokens.entry_scores is None:
            tokens = self.method.on_entry(tokens)
        scores = tokens.entry_scores.float().masked_fill(tokens.entry_scores < self.method.threshold, -math.inf)
        keys, values, positions = tokens.keys, tokens.values, tokens.positions
        if self.kept is not None:
            held = self.kept.summary()
            held_scores = self.kept_scores.new_full((held.positions.numel(),), -math.inf)
            held_scores = held_scores.index_copy_(0, self.kept._slots(), self.kept_scores).view(held.positions.shape)
            keys, values = torch.cat([held.keys, keys], 2), torch.cat([held.values, values], 2)
            positions, scores = torch.cat([held.positions, positions], 2), torch.cat([held_scores, scores], 2)
        self.seen += tokens.length
        kept = torch.isfinite(scores)
        if scores.shape[2] > self.budget:
            kept &= torch.zeros_like(kept).scatter_(-1, top_index(scores, self.budget), True)
        self.kept = RaggedSummary(keys[kept], values[kept], None, int32_positions(positions[kept]), kept.sum(-1).to(torch.int32))
        self.kept_scores = scores[kept]

    def summary(self) -> KVSummary | None:
        return None if self.kept is None else self.kept.summary()

    def kv_tensors(self) -> list[torch.Tensor]:
        """The packed keys and values (`QuantizedState` stores them in kv_bits)."""
        return [] if self.kept is None else [self.kept.keys, self.kept.values]

    def set_kv_tensors(self, tensors: list[torch.Tensor]) -> None:
        if self.kept is not None:
            self.kept = replace(self.kept, keys=tensors[0], values=tensors[1])

    def nbytes(self) -> int:
        """The packed keys and values and their per-head counts."""
        return 0 if self.kept is None else self.kept.nbytes()


def fit_surrogate(hidden: dict[int, torch.Tensor], targets: dict[int, torch.Tensor], kind: str = "linear", *,
                  mlp_width: int = 16, steps: int = 300, ridge: float = 1e-2, seed: int = 0, model: str = "") -> Surrogate:
    """Fit one surrogate per layer and KV head to training pairs (`integration.scorer_training.ScoringPairs`, several
    contexts concatenated): hidden {layer: [N, d_model]} -> targets {layer: [H_kv, N]}.

    The inputs are standardised (per feature, over the N tokens). "linear": ridge regression, (XᵀX + ridge·N·I) W = XᵀY
    solved by a Cholesky factorisation, all heads at once. "mlp": `mlp_width` hidden units per head, gelu, fitted by Adam
    (full batch, `steps` steps, learning rate 1e-2, seeded by `seed`) on the mean squared error. The standardisation is
    then folded into the first layer, so `Surrogate.predict` reads raw hidden states."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not hidden or set(hidden) != set(targets):
        raise ValueError(f"hidden and targets must cover the same layers, got {sorted(hidden)} and {sorted(targets)}")
    layers = tuple(sorted(hidden))
    generator = torch.Generator().manual_seed(seed)
    parts = {"first_weight": [], "first_bias": [], "second_weight": [], "second_bias": []}
    for layer in layers:
        x, y = hidden[layer].float(), targets[layer].float().T  # [N, d], [N, H]
        if x.shape[0] != y.shape[0] or x.shape[0] < 2:
            raise ValueError(f"layer {layer}: {x.shape[0]} hidden states for {y.shape[0]} targets (at least 2 tokens each)")
        mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
        z = (x - mean) / std
        heads, n, d = y.shape[1], x.shape[0], x.shape[1]
        if kind == "linear":
            gram = z.T @ z + ridge * n * torch.eye(d, dtype=torch.float32)
            w = torch.cholesky_solve((z.T @ (y - y.mean(0))), torch.linalg.cholesky(gram))  # [d, H]
            w1, b1 = w.T.unsqueeze(-1), y.mean(0).unsqueeze(-1)  # [H, d, 1], [H, 1]
            w2 = b2 = None
        else:
            w1 = (torch.randn(heads, d, mlp_width, generator=generator, dtype=torch.float32) / math.sqrt(d)).requires_grad_()
            b1 = torch.zeros(heads, mlp_width, requires_grad=True, dtype=torch.float32)
            w2 = (torch.randn(heads, mlp_width, 1, generator=generator, dtype=torch.float32) / math.sqrt(mlp_width)).requires_grad_()
            b2 = y.mean(0).unsqueeze(-1).clone().requires_grad_()
            optimiser = torch.optim.Adam([w1, b1, w2, b2], lr=1e-2)
            with torch.enable_grad():
                for _ in range(steps):
                    optimiser.zero_grad()
                    out = torch.nn.functional.gelu(torch.einsum("nd,hdk->hnk", z, w1) + b1.unsqueeze(1)) @ w2 + b2.unsqueeze(1)
                    loss = (out.squeeze(-1) - y.T).pow(2).mean()
                    loss.backward()
                    optimiser.step()
            w1, b1, w2, b2 = (t.detach() for t in (w1, b1, w2, b2))
        # fold the standardisation: (x - mean) / std @ w1 + b1 = x @ (w1 / std) + (b1 - (mean / std) @ w1)
        parts["first_bias"].append(b1 - torch.einsum("d,hdk->hk", mean / std, w1))
        parts["first_weight"].append(w1 / std[None, :, None])
        if kind == "mlp":
            parts["second_weight"].append(w2)
            parts["second_bias"].append(b2)
    stacked = {k: torch.stack(v) if v else None for k, v in parts.items()}
    surrogate = Surrogate(kind, layers, stacked["first_weight"], stacked["first_bias"], stacked["second_weight"],
                          stacked["second_bias"], model)
    return replace(surrogate, score_quantiles=score_quantiles(surrogate, hidden))


def score_quantiles(surrogate: Surrogate, hidden: dict[int, torch.Tensor], levels: int = SCORE_QUANTILES) -> torch.Tensor:
    """[L, levels] float32: per layer of `surrogate`, the quantiles at 0, 1/(levels-1), ..., 1 of its predicted scores of
    hidden {layer: [N, d_model]} (every KV head's and token's, pooled): `Surrogate.score_quantiles`."""
    grid = torch.linspace(0.0, 1.0, levels, dtype=torch.float32)
    rows = []
    for layer in surrogate.layers:
        x = hidden[layer].float()
        predicted = surrogate.predict(x[None, None].expand(1, surrogate.kv_heads, -1, -1), layer).flatten()
        rows.append(torch.quantile(predicted.double(), grid.double()).float())
    return torch.stack(rows)


def spearman(predicted: torch.Tensor, target: torch.Tensor) -> float:
    """Spearman's rank correlation of two [..., n] tensors along the last axis, averaged over the leading ones (ties:
    ranked in index order)."""
    def ranks(t):
        return t.float().argsort(-1).argsort(-1).float()

    a, b = ranks(predicted), ranks(target)
    a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
    return float(((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-12)).mean())
