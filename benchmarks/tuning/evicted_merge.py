"""Does the prefill default keep more answers at ratio 0.9 if its evicted tokens are merged into the kept slots they
resemble, rather than dropped? A refit without queries to fit, on tuning needles.

The refits tried before (`own_query_refit.py`, `reconstruction_query_share.py`) fit the kept slots by least squares to
a set of queries, and keep fewer answers than no refit unless the queries are KVzip's whole reconstruction (a second
forward). Merging asks for no fit: each evicted token of a KV head is assigned to the kept slot of that head whose key
is most like its own (cosine similarity of the post-RoPE keys), and the slot takes on its attention mass and its value
(as token-merging caches do, e.g. Wan et al., "D2O: Dynamic Discriminative Operations for Efficient Long-Context
Inference of Large Language Models", arXiv:2406.13035): a slot j with evicted tokens t merged into it, each with mass
w_t relative to j's own, gets log-weight log(1 + Σ w_t) and value (v_j + Σ w_t v_t) / (1 + Σ w_t); its key stays the
kept token's. If the keys are alike, every query sees about the mass and output the tokens had. Variants, each the
prefill default's allocation (AdaKV over KVzap, one budget over every layer's heads) with:
- `full`: nothing, the full cache (ratio 0); `default`: no merge, the default itself;
- `merge_count`: every evicted token weighs as its slot (w_t = 1): log-weights and values merged;
- `merge_count_log_weights`: the same masses, the kept slots' values left as they are;
- `merge_window`: w_t is the evicted token's attention mass over the slot's, for the exact window's queries (the
  prompt's last 64, which a prefill computes anyway): exp(lse_q s<q, k_t> - lse_q s<q, k_j>), the log-sum-exp over the
  window queries of the KV head's query group; log-weights and values merged;
- `merge_window_log_weights`: those masses, the values left as they are.

The methods these variants use are registered by `main` only, so importing this module leaves the library's methods as
they are. Each variant answers the tuning needles of `kvzap_default.py` (`tuning_needle`, 24 answer tokens) in the
library's prompt layout, one JSON line per (variant, seed, length, ratio) to OUT in `kvzap_default.py`'s format (a rerun
skips what is there):

    .venv/bin/python benchmarks/tuning/evicted_merge.py --out benchmarks/results/tuning/evicted_merge.jsonl \\
        --lengths 2048 --seeds 1000-1029 --ratio 0.9 --threads 1
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import kvcompress as kvc
from kvcompress.methods.adakv import AdaKV, kept_summary
from kvcompress.methods.registry import register
from kvcompress.summary import KVSummary
from kvzap_default import answer_prefill_variants, answered_variants_run
from own_query_refit import WINDOW_QUERIES, KVzapWithQueries, queried_default_settings


def merged_summary(tokens, kept: torch.Tensor, window_mass: bool, merge_values: bool) -> KVSummary:
    """The kept tokens of `tokens` (`kept` [B, H_kv, n] bool), each slot with the evicted tokens of its head whose keys
    are nearest its own (cosine) merged into it: masses 1 each (`window_mass` False) or their attention mass over the
    slot's for the last `WINDOW_QUERIES` queries; log-weight log(1 + Σ mass); values averaged by mass (`merge_values`)."""
    summary = kept_summary(tokens, kept)
    real = summary.log_weights > -math.inf  # [B, H_kv, m]: the slots that hold a kept token, not padding
    keys = tokens.keys.float()
    similarity = torch.nn.functional.normalize(keys, dim=-1) @ torch.nn.functional.normalize(summary.keys.float(), dim=-1).transpose(-1, -2)
    nearest = similarity.masked_fill(~real.unsqueeze(2), -math.inf).argmax(-1)  # [B, H_kv, n]: a kept slot's index
    evicted = (~kept).float()
    if window_mass:
        b, h = keys.shape[:2]
        queries = tokens.queries[:, :, -WINDOW_QUERIES:].float().reshape(b, h, -1, keys.shape[-1]) * tokens.scale
        log_mass = (queries @ keys.transpose(-1, -2)).logsumexp(2)  # [B, H_kv, n]: each token's, over the window queries
        slot_log_mass = torch.where(real, (queries @ summary.keys.float().transpose(-1, -2)).logsumexp(2), 0.0)
        mass = evicted * (log_mass - slot_log_mass.gather(-1, nearest)).exp()
    else:
        mass = evicted
    merged = torch.zeros(real.shape, device=keys.device).scatter_add_(-1, nearest, mass)  # [B, H_kv, m]
    log_weights = torch.where(real, merged.log1p(), -math.inf)
    values = summary.values
    if merge_values:
        sums = torch.zeros(summary.values.shape, device=keys.device).scatter_add_(
            2, nearest.unsqueeze(-1).expand_as(tokens.values), mass.unsqueeze(-1) * tokens.values.float())
        values = ((summary.values.float() + sums) / (1 + merged).unsqueeze(-1)).to(summary.values.dtype)
    return KVSummary(summary.keys, values, log_weights, summary.positions)


@dataclass
class MergedAdaKV(AdaKV):
    """AdaKV whose evicted tokens are merged into the nearest kept slots (`merged_summary`)."""

    name = "adakv_merged"
    window_mass: bool = False
    merge_values: bool = True

    def summary(self, tokens, kept, middle_lse=None) -> KVSummary:
        return merged_summary(tokens, kept, self.window_mass, self.merge_values)


# variant -> MergedAdaKV's settings; "full" is the full cache, "default" the prefill default
MERGE_VARIANTS = {
    "merge_count": {"window_mass": False, "merge_values": True},
    "merge_count_log_weights": {"window_mass": False, "merge_values": False},
    "merge_window": {"window_mass": True, "merge_values": True},
    "merge_window_log_weights": {"window_mass": True, "merge_values": False},
}
VARIANTS = ("full", "default", *MERGE_VARIANTS)


def variant_settings(name: str, ratio: float) -> dict:
    """kvc.generate's method settings for `name`."""
    return queried_default_settings(name, ratio, MergedAdaKV.name, **MERGE_VARIANTS.get(name, {}))


def main() -> None:
    args, seeds, names = answered_variants_run(__doc__, VARIANTS)
    for method in (KVzapWithQueries, MergedAdaKV):
        register(method)
    model, tokenizer = kvc.load_model()
    answer_prefill_variants(model, tokenizer, args, seeds, names, variant_settings)


if __name__ == "__main__":
    main()
