"""Can the prefill default be refitted without KVzip's second forward? Attention matching against the prompt's own
queries, on tuning needles at ratio 0.9.

`kvzip_refit` keeps the most of the full cache's answers at ratio 0.9 because, after its top-k, it refits the kept
slots' log-weights and values to the whole middle's attention for KVzip's reconstruction queries
(`methods.attention_matching`); those queries cost a second forward over the context. The prefill default (AdaKV over
KVzap's scores, one budget over every layer's heads) has no such queries, but a prefill computes the context's own
queries anyway. This asks whether they can stand in. Variants, each the prefill default's allocation with:
- `full`: nothing, the full cache (ratio 0); `default`: no refit, the default itself;
- `own_log_weights`: the kept slots' log-weights fitted for every query of the context (as many as
  `attention_matching.REFERENCE_QUERIES` per KV head, evenly spaced), each taken over the whole middle as a
  reconstruction query is;
- `own_log_weights_values`: the same queries, log-weights and values fitted;
- `window_log_weights_values`: log-weights and values fitted for the exact window's queries alone (the last 64 of the
  prompt, the only ones that follow every middle token);
- `window_scalar`: one log-weight per KV head, shared by its kept slots: the mean over the window's queries of the log
  of the whole middle's attention mass over the kept slots' (the least a refit can fit: the middle's share of the
  softmax put back, nothing else);
- `shifted_log_weights`, `shifted_log_weights_values`: every query of the context rotated on by the prompt's length
  (RoPE composes, so query i then sits at position i + n, as its token's copy does when KVzip's reconstruction repeats
  the context after it: it follows every middle token at the distances the reconstruction's queries see), then fitted
  as `own_*` are.

The scorer and methods these variants use (`KVzapWithQueries`, `WindowRefitAdaKV`, `WindowScalarAdaKV`,
`ShiftedRefitAdaKV`) are
registered by `main` only, so importing this module leaves the library's methods as they are. Each variant answers the
tuning needles of `kvzap_default.py` (`tuning_needle`, 24 answer tokens) in the library's prompt layout, one JSON line
per (variant, seed, length, ratio) to OUT in `kvzap_default.py`'s format (a rerun skips what is there):

    .venv/bin/python benchmarks/tuning/own_query_refit.py --out benchmarks/results/tuning/own_query_refit.jsonl \\
        --lengths 2048 --seeds 1000-1029 --ratio 0.9 --threads 1
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers.models.llama.modeling_llama import rotate_half

import kvcompress as kvc
from kvcompress.methods.adakv import AdaKV
from kvcompress.methods.kvzap import KVzap
from kvcompress.methods.registry import register
from kvcompress.methods.requirements import Requirements
from kvcompress.options import DEFAULT_METHODS, without_storage
from kvcompress.summary import KVSummary
from kvzap_default import answer_prefill_variants, answered_variants_run

WINDOW_QUERIES = 64  # the exact window's queries: the prompt's last 64, the default's window


@dataclass
class KVzapWithQueries(KVzap):
    """KVzap's scores, the method also handed the context's queries, which a refit fits to."""

    name = "kvzap_with_queries"

    @property
    def requirements(self) -> Requirements:
        return Requirements(inputs={"hidden_states", "queries"})


@dataclass
class WindowRefitAdaKV(AdaKV):
    """AdaKV whose refit fits the kept slots to the last `WINDOW_QUERIES` queries alone."""

    name = "adakv_window_refit"

    def summary(self, tokens, kept, middle_lse=None) -> KVSummary:
        return super().summary(replace(tokens, queries=tokens.queries[:, :, -WINDOW_QUERIES:]), kept, None)


@dataclass
class WindowScalarAdaKV(AdaKV):
    """AdaKV whose kept slots of each KV head share one log-weight, the mean over the last `WINDOW_QUERIES` queries of
    log(the whole middle's attention mass / the kept slots' mass); the values stay the tokens' own."""

    name = "adakv_window_scalar"

    def summary(self, tokens, kept, middle_lse=None) -> KVSummary:
        summary = super().summary(tokens, kept)
        b, _, _, d = tokens.queries.shape
        hkv = tokens.keys.shape[1]
        queries = tokens.queries[:, :, -WINDOW_QUERIES:].float().reshape(b, hkv, -1, d) * tokens.scale
        middle = (queries @ tokens.keys.float().transpose(-1, -2)).logsumexp(-1)
        real = summary.log_weights > float("-inf")
        kept_logits = (queries @ summary.keys.float().transpose(-1, -2)).masked_fill(~real.unsqueeze(2), float("-inf"))
        shared = (middle - kept_logits.logsumexp(-1)).mean(-1, keepdim=True)
        log_weights = torch.where(real, shared.expand(real.shape), summary.log_weights)
        return KVSummary(summary.keys, summary.values, log_weights, summary.positions)


@dataclass
class ShiftedRefitAdaKV(AdaKV):
    """AdaKV whose refit fits the kept slots to the context's queries rotated on by the prompt's length (`rotary`: the
    model's rotary embedding, set by `main`)."""

    name = "adakv_shifted_refit"
    rotary = None

    def summary(self, tokens, kept, middle_lse=None) -> KVSummary:
        queries = tokens.queries
        shift = torch.full((1, 1), queries.shape[2], dtype=torch.long, device=queries.device)
        cos, sin = (t.to(queries.dtype) for t in ShiftedRefitAdaKV.rotary(queries, shift))
        return super().summary(replace(tokens, queries=queries * cos + rotate_half(queries) * sin), kept, None)


# variant -> (the method it runs, registered name, with the default's parameters; its refit); "full" is the full cache,
# "default" the prefill default
REFIT_VARIANTS = {
    "own_log_weights": (DEFAULT_METHODS["prefill"][0], "log_weights"),
    "own_log_weights_values": (DEFAULT_METHODS["prefill"][0], "log_weights_values"),
    "window_log_weights_values": (WindowRefitAdaKV.name, "log_weights_values"),
    "window_scalar": (WindowScalarAdaKV.name, "none"),
    "shifted_log_weights": (ShiftedRefitAdaKV.name, "log_weights"),
    "shifted_log_weights_values": (ShiftedRefitAdaKV.name, "log_weights_values"),
}
VARIANTS = ("full", "default", *REFIT_VARIANTS)


def queried_default_settings(name: str, ratio: float, method: str | None = None, **params) -> dict:
    """kvc.generate's method settings for variant `name`: "full" the full cache, "default" the prefill default at full
    precision (`options.without_storage`), any other the registered `method` with the prefill default's parameters, its
    scorer handed the queries (`KVzapWithQueries`), and `params` over them."""
    if name == "full":
        return {"method": None}
    default, defaults, exact = DEFAULT_METHODS["prefill"]
    exact = without_storage(exact)  # at full precision, as these variants were measured
    if name == "default":
        return dict(method=default, method_params=defaults, compression_ratio=ratio, **exact)
    return dict(method=method, method_params={**defaults, "scorer": KVzapWithQueries.name, **params}, compression_ratio=ratio,
                **exact)


def variant_settings(name: str, ratio: float) -> dict:
    """kvc.generate's method settings for `name`."""
    if name in REFIT_VARIANTS:
        method, refit = REFIT_VARIANTS[name]
        return queried_default_settings(name, ratio, method, refit=refit)
    return queried_default_settings(name, ratio)


def main() -> None:
    args, seeds, names = answered_variants_run(__doc__, VARIANTS)
    for method in (KVzapWithQueries, WindowRefitAdaKV, WindowScalarAdaKV, ShiftedRefitAdaKV):
        register(method)
    model, tokenizer = kvc.load_model()
    ShiftedRefitAdaKV.rotary = model.model.rotary_emb
    answer_prefill_variants(model, tokenizer, args, seeds, names, variant_settings)


if __name__ == "__main__":
    main()
