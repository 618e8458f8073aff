"""What `kvzip_refit`'s refit costs, with KVzip's normalisers handed on and with the fit forming its own.

`kvzip_refit` (`options.NAMED_SETTINGS["kvzip_refit"]`, the prefill default before KVzap: `adakv` over KVzip's scores, `scope="model"`,
`alpha_safeguard=0.05`, no exact window, a refit) scores every layer's middle with the context's reconstruction
queries, shares the budget over every layer's heads, then refits each layer's kept slots for the same queries
(`kvcompress.methods.attention_matching`): `--refit log_weights` fits their log-weights to the middle's attention
mass, `--refit log_weights_values` their values too, to the middle's output; by default `kvzip_refit`'s refit.
The mass fit needs each query's log-sum-exp over the whole middle; KVzip forms it while scoring and AdaKV hands it
on (`ScoreMethod.score_and_middle_lse`), so the fit forms only the kept keys' logits. This bench times, in one
process and on the same tensors:

- scoring: `AdaKV.head_scores` of every layer (KVzip's reconstruction scores) and the joint top-k;
- refit, handed: each layer's `AdaKV.summary` with the normalisers the scorer formed;
- refit, formed: the same summary without them (the fit forms the log-sum-exp over every middle key itself);

and checks that both ways give the same log-weights and values. The tensors are random, with the default model's
shapes (SmolLM2-135M: 3 KV heads of 64 dimensions, 3 query heads each) and one reconstruction query per context token
per query head; keys drawn near a few centres per head, as real keys cluster. Only shapes and kept counts set the cost,
so the model's weights are not needed; on real scores the heads keep more unevenly than here, which makes the
Gram products (the same in both ways) a larger share. Writes --out, by default benchmarks/results/refit_cost_<refit>.csv,
and the table beside it (.md).

    python benchmarks/refit_cost.py [--refit log_weights] [--length 4096] [--layers 4] [--ratios 0.5 0.75 0.9]
        [--repeats 3] [--threads 1] [--out benchmarks/results/refit_cost_<refit>.csv]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from kvcompress.commands.common import csv_path, ratio
from kvcompress.eval.tables import markdown_table, write_csv
from kvcompress.methods.adakv import REFITS, AdaKV
from kvcompress.methods.tokens import Tokens
from kvcompress.options import NAMED_SETTINGS

RESULTS = Path(__file__).parent / "results"
KVZIP_REFIT = NAMED_SETTINGS["kvzip_refit"]["prefill"][1]


def layer_tokens(length: int, kv_heads: int, group: int, dim: int, seed: int) -> Tokens:
    """One layer's middle [1, kv_heads, length, dim] with `length` reconstruction queries per query head."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(1, kv_heads, 16, dim, generator=g) * 2
    keys = centres.gather(2, torch.randint(16, (1, kv_heads, length, 1), generator=g).expand(-1, -1, -1, dim))
    keys = keys + 0.5 * torch.randn(1, kv_heads, length, dim, generator=g)
    values = torch.randn(1, kv_heads, length, dim, generator=g)
    queries = torch.randn(1, kv_heads * group, length, dim, generator=g) * 2
    return Tokens(keys, values, torch.arange(length).expand(1, kv_heads, length), queries=queries, scale=dim ** -0.5,
                  extra_lse=torch.randn(1, kv_heads * group, length, generator=g))


def measure(layers: list[Tokens], ratio: float, repeat: int, refit: str) -> dict:
    method = AdaKV.from_params(KVZIP_REFIT | {"refit": refit})
    budget = round((1 - ratio) * layers[0].length)
    start = time.perf_counter()
    kept, middle_lse = method.allocate_layers(layers, budget, [torch.Generator() for _ in layers])
    scoring = time.perf_counter() - start
    seconds, fits = {}, {}
    for way in (("handed", "formed") if repeat % 2 == 0 else ("formed", "handed")):
        start = time.perf_counter()
        fits[way] = [method.summary(tokens, layer_kept, lse if way == "handed" else None)
                     for tokens, layer_kept, lse in zip(layers, kept, middle_lse)]
        seconds[way] = time.perf_counter() - start
    difference = max(float((getattr(a, field) - getattr(b, field)).nan_to_num(0).abs().max())
                     for a, b in zip(fits["handed"], fits["formed"]) for field in ("log_weights", "values"))
    counts = torch.cat([layer_kept.sum(-1) for layer_kept in kept]).flatten().float()
    return dict(ratio=ratio, repeat=repeat, layers=len(layers), kept_per_head_mean=round(float(counts.mean()), 1),
                kept_per_head_max=int(counts.max()), scoring_s=round(scoring, 2), refit_handed_s=round(seconds["handed"], 2),
                refit_formed_s=round(seconds["formed"], 2), max_difference=f"{difference:.1e}")


def medians(rows: list[dict]) -> list[dict]:
    """Per ratio (in the rows' order): the median of each time over the repeats, and the two ways' ratios."""
    summary = []
    for ratio in dict.fromkeys(row["ratio"] for row in rows):
        mine = [row for row in rows if row["ratio"] == ratio]
        median = {key: sorted(row[key] for row in mine)[len(mine) // 2] for key in ("scoring_s", "refit_handed_s", "refit_formed_s")}
        summary.append(dict(ratio=ratio, kept_per_head_mean=mine[0]["kept_per_head_mean"], **median,
                            refit_formed_over_handed=round(median["refit_formed_s"] / median["refit_handed_s"], 2),
                            compression_formed_over_handed=round((median["scoring_s"] + median["refit_formed_s"])
                                                                 / (median["scoring_s"] + median["refit_handed_s"]), 2)))
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, --ratios each checked to be a compression ratio in [0, 1), --out defaulting to
    benchmarks/results/refit_cost_<refit>.csv."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refit", choices=[r for r in REFITS if r != "none"], default=KVZIP_REFIT["refit"],
                        help="the refit timed (default: kvzip_refit's)")
    parser.add_argument("--length", type=int, default=4096, help="middle tokens per layer (and reconstruction queries)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ratios", type=ratio, nargs="+", default=[0.5, 0.75, 0.9])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--out", type=csv_path, default=None,
                        help="the CSV of every repeat; the table of medians is written beside it as .md (default "
                             "benchmarks/results/refit_cost_<refit>.csv)")
    args = parser.parse_args(argv)
    args.out = args.out or RESULTS / f"refit_cost_{args.refit}.csv"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    layers = [layer_tokens(args.length, args.kv_heads, args.group, args.head_dim, seed) for seed in range(args.layers)]
    rows = []
    for repeat in range(args.repeats):
        for ratio in args.ratios:
            rows.append(measure(layers, ratio, repeat, args.refit))
            print(rows[-1], flush=True)
    summary = medians(rows)
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} thread(s), torch "
               f"{torch.__version__}, {datetime.now(timezone.utc):%Y-%m-%d}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(args.out, rows)
    text = (f"# refit={args.refit}: normalisers handed on by KVzip or formed by the fit\n\n{machine}; {args.layers} layers of "
            f"{args.length} middle tokens, {args.kv_heads} KV heads x {args.group} query heads, head dim {args.head_dim}; "
            f"medians of {args.repeats} repeats (seconds for all the layers)\n\n" + markdown_table(summary) + "\n")
    args.out.with_suffix(".md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
