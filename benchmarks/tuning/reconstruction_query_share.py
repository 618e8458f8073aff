"""How few of KVzip's reconstruction queries does `kvzip_refit`'s refit need? Tuning needles at ratio 0.9.

`kvzip_refit` (`options.NAMED_SETTINGS`) keeps the most of the full cache's answers at 0.9 because it refits the kept
slots to the whole middle's attention for KVzip's reconstruction queries; the prompt's own queries do not stand in for
them (`own_query_refit.py`). A reconstruction costs a forward over the repeated context, so a refit that a cheap default
could afford would reconstruct only a share of the context. This measures, before building that, whether the refit
holds up on a share of the queries: the same scores and kept slots as `kvzip_refit`, the refit fitted to
- `kvzip_refit`: every reconstruction query (the named setting itself);
- `strided_20`: every 20th reconstruction query (5 %, spread evenly over the context);
- `blocks_20`: every 20th block of 128 consecutive reconstruction queries (5 %, the copies of contiguous spans of the
  context: what reconstructing one chunk in 20 would give);
and `full`, the full cache (ratio 0). The query subsets are taken by `QueryShareAdaKV`, registered by `main` only, so
importing this module leaves the library's methods as they are. Each variant answers the tuning needles of
`kvzap_default.py` in the library's prompt layout, one JSON line per (variant, seed, length, ratio) to OUT in
`kvzap_default.py`'s format (a rerun skips what is there):

    .venv/bin/python benchmarks/tuning/reconstruction_query_share.py \\
        --out benchmarks/results/tuning/reconstruction_query_share.jsonl --lengths 2048 --seeds 1000-1029 --ratio 0.9 --threads 1
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

import kvcompress as kvc
from kvcompress.methods.adakv import AdaKV
from kvcompress.methods.registry import register
from kvcompress.options import NAMED_SETTINGS
from kvcompress.summary import KVSummary
from kvzap_default import answer_prefill_variants, answered_variants_run

SHARE = 20  # one query (or block of queries) in SHARE is fitted to
BLOCK = 128  # queries per block of `blocks_20`
VARIANTS = ("full", "kvzip_refit", "strided_20", "blocks_20")


@dataclass
class QueryShareAdaKV(AdaKV):
    """AdaKV whose refit fits the kept slots to one block of `query_block` consecutive queries in every `query_share`
    (the queries' normalisers over the middle then formed by the fit itself)."""

    name = "adakv_query_share"
    query_share: int = 1
    query_block: int = 1

    def summary(self, tokens, kept, middle_lse=None) -> KVSummary:
        count = tokens.queries.shape[2]
        index = torch.arange(count, device=tokens.queries.device)
        chosen = index[(index // self.query_block) % self.query_share == 0]
        return super().summary(replace(tokens, queries=tokens.queries[:, :, chosen]), kept, None)


def variant_settings(name: str, ratio: float) -> dict:
    """kvc.generate's method settings for `name`."""
    if name == "full":
        return {"method": None}
    method, params, exact = NAMED_SETTINGS["kvzip_refit"]["prefill"]
    if name == "kvzip_refit":
        return dict(method=method, method_params=params, compression_ratio=ratio, **exact)
    share = {"query_share": SHARE, "query_block": 1 if name == "strided_20" else BLOCK}
    return dict(method=QueryShareAdaKV.name, method_params={**params, **share}, compression_ratio=ratio, **exact)


def main() -> None:
    args, seeds, names = answered_variants_run(__doc__, VARIANTS)
    register(QueryShareAdaKV)
    model, tokenizer = kvc.load_model()
    answer_prefill_variants(model, tokenizer, args, seeds, names, variant_settings)


if __name__ == "__main__":
    main()
