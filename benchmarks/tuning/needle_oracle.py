"""Would keeping a needle's own tokens find it? The default's prefill compression with the needle forced into every
(layer, KV head), on tuning needles: an oracle no query-agnostic ranking can beat at choosing the needle's tokens.

The default in prefill mode (AdaKV over KVzap's scores, one budget over every layer's heads, per-head floor 5 %) with
the scores of chosen context tokens raised above every other token's (`ForcedKVzap`), so every KV head of every layer
keeps them, within the same budget, whatever the surrogate predicts. Variants:
- `full`: the full cache (ratio 0);
- `forced_none`: nothing forced, which is the default itself;
- `forced_answer`: the answer's tokens;
- `forced_answer_fact`: the answer's tokens and the fact's words before it (`needle_keep.needle_spans`).

Each answers the tuning needles of `kvzap_default.py` (`tuning_needle`, 24 answer tokens) in the library's prompt
layout, and one JSON line per (variant, seed, length, ratio) goes to OUT in `kvzap_default.py`'s format (a rerun skips
what is there), so its `summary_rows` reads it:

    .venv/bin/python benchmarks/tuning/needle_oracle.py --out benchmarks/results/tuning/needle_oracle.jsonl \\
        --lengths 2048 --seeds 1000-1029 --ratio 0.9 --threads 1
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kvcompress as kvc
from kvcompress.methods.kvzap import KVzap
from kvcompress.methods.registry import register
from kvcompress.names import DEFAULT_PROMPT_LAYOUT
from kvcompress.options import DEFAULT_METHODS, without_storage
from kvzap_default import answer_prefill_needle, answered_variants_run, recorded, summarise
from needle_keep import tuning_context

FORCED_SCORE = 1e4  # above every log-score the surrogate predicts, and finite, so sums over scores stay finite
VARIANTS = ("full", "forced_none", "forced_answer", "forced_answer_fact")


@dataclass
class ForcedKVzap(KVzap):
    """KVzap's scores with the tokens at positions `forced` raised to FORCED_SCORE, above every other token's in every
    head of every layer. Registered by `main` only, so that importing this module leaves the library's methods as
    they are."""

    name = "kvzap_forced"
    forced: tuple[int, ...] = ()

    def score(self, tokens, generator):
        scores = super().score(tokens, generator)
        forced = torch.as_tensor(self.forced, dtype=torch.long, device=scores.device)
        return scores.masked_fill(torch.isin(tokens.positions, forced), FORCED_SCORE)


def forced_positions(variant: str, answer: range, fact: range) -> tuple[int, ...]:
    """The context positions `variant` forces into every head."""
    chosen = {"forced_none": [], "forced_answer": [*answer], "forced_answer_fact": [*fact, *answer]}
    if variant not in chosen:
        raise ValueError(f"variant must be one of {sorted(chosen)}, got {variant!r}")
    return tuple(chosen[variant])


def main() -> None:
    args, seeds, names = answered_variants_run(__doc__, VARIANTS)
    register(ForcedKVzap)
    model, tokenizer = kvc.load_model()
    done = recorded(args.out, ("variant", "seed", "length", "ratio"))
    method, params, exact = DEFAULT_METHODS["prefill"]  # the prefill default at full precision, its scorer swapped for the forced one
    exact = without_storage(exact)
    for length in map(int, args.lengths.split(",")):
        for seed in seeds:
            sample, _, answer, fact = tuning_context(length, seed, tokenizer, DEFAULT_PROMPT_LAYOUT)
            for name in names:
                ratio = 0.0 if name == "full" else args.ratio
                if (name, seed, length, ratio) in done:
                    continue
                forced = () if name == "full" else forced_positions(name, answer, fact)
                settings = {"method": None} if name == "full" else dict(
                    method=method, compression_ratio=ratio, **exact,
                    method_params={**params, "scorer": ForcedKVzap.name, "scorer_params": {"forced": forced}})
                answer_prefill_needle(model, tokenizer, sample, args, name, seed, length, ratio, settings, forced_tokens=len(forced))
    summarise(args.out)


if __name__ == "__main__":
    main()
