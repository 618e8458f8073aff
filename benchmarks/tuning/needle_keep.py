"""Which of a needle's tokens a prefill-mode variant keeps: the diagnosis behind its misses, on tuning needles.

For each tuning needle (`niah_prose(split="tuning")`, the depths and prompt layout of `kvzap_default.py`), the context is
compressed once (`compress_context_ids`, no answer written) and every layer's stored slots are read back: for each
context token, the share of the model's (layer, KV head) pairs that keep it. One JSON line per (variant, seed, length,
ratio) goes to OUT (a rerun skips what is there) with that share for the answer's tokens (the least kept one and their
mean), for the fact's words before the answer (the needle sentence up to the answer), and for every context token
(the budget's own share), and whether the answer lies in the exact window. `summary_rows` joins them with the hits the
same variant scored on the same needles in a `kvzap_default.py` record:

    .venv/bin/python benchmarks/tuning/needle_keep.py --out benchmarks/results/tuning/needle_keep.jsonl \\
        --lengths 2048 --seeds 1000-1029 --ratio 0.9 --variants adakv_kvzap_model,adakv_kvzip_model --threads 1
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.integration import build_prompt
from kvcompress.integration.generation import compress_context_ids
from kvcompress.names import DEFAULT_PROMPT_LAYOUT
from kvzap_default import VARIANTS, append_row, needle_run_parser, recorded, tuning_needle, tuning_seeds


def kept_share(cache, n: int) -> torch.Tensor:
    """[n]: for each of the n context tokens, the share of (layer, KV head) pairs of `cache` (batch row 0) that store it
    in a slot with a finite log-weight."""
    kept = []
    for layer in cache.layers:
        stored = layer.stored()
        positions, real = stored.positions[0], torch.isfinite(stored.log_weights[0]) & (stored.positions[0] >= 0)
        slots = positions.masked_fill(~real, n)  # an empty slot lands in a spare column n, dropped below
        kept.append(torch.zeros(positions.shape[0], n + 1, dtype=torch.bool).scatter_(1, slots, True)[:, :n])
    return torch.stack(kept).float().mean((0, 1))


def needle_spans(tokenizer, ids: list[int], answer: str) -> tuple[range, range]:
    """(the answer's token positions in ids, the positions of the fact's words before it: back to the token after the
    last one holding a full stop)."""
    answer_ids = tokenizer(" " + answer, add_special_tokens=False)["input_ids"]
    start = next((i for i in range(len(ids) - len(answer_ids) + 1) if ids[i : i + len(answer_ids)] == answer_ids), None)
    if start is None:
        raise ValueError(f"the answer {answer!r} is not among the context's tokens")
    first = start
    while first > 0 and "." not in tokenizer.decode([ids[first - 1]]):
        first -= 1
    return range(start, start + len(answer_ids)), range(first, start)


def tuning_context(length: int, seed: int, tokenizer, layout: str):
    """(the tuning needle of `seed` at `length` tokens, its context ids [1, n] in `layout`, the answer's token positions,
    the fact's words' positions: `needle_spans`)."""
    sample = tuning_needle(length, seed, tokenizer)
    context_ids, _ = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix, layout=layout)
    return sample, context_ids, *needle_spans(tokenizer, context_ids[0].tolist(), sample.answers[0])


def main() -> None:
    p = needle_run_parser(__doc__, "adakv_kvzap_model,adakv_kvzip_model")  # prefill-mode variants of kvzap_default.py
    p.add_argument("--prompt-layout", default=DEFAULT_PROMPT_LAYOUT)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    seeds = tuning_seeds(args.seeds)
    names = args.variants.split(",")
    for name in names:
        if name not in VARIANTS or VARIANTS[name][0] is None or "prefill" not in VARIANTS[name][3]:
            raise SystemExit(f"--variants takes prefill-mode variants with a method, among "
                             f"{[v for v, spec in VARIANTS.items() if spec[0] is not None and 'prefill' in spec[3]]}; got {name!r}")
    model, tokenizer = kvc.load_model()
    done = recorded(args.out, ("variant", "seed", "length", "ratio"))
    for length in map(int, args.lengths.split(",")):
        for seed in seeds:
            sample, context_ids, answer, fact = tuning_context(length, seed, tokenizer, args.prompt_layout)
            ids = context_ids[0].tolist()
            for name in names:
                if (name, seed, length, args.ratio) in done:
                    continue
                method, params, exact, _ = VARIANTS[name]
                cache = compress_context_ids(model, context_ids, method=method, method_params=params, compression_ratio=args.ratio, **exact)
                share = kept_share(cache, len(ids))
                window = cache.options.window
                row = {"variant": name, "seed": seed, "length": length, "ratio": args.ratio, "answer": sample.answers[0],
                       "answer_tokens": len(answer), "in_window": answer.start >= len(ids) - window,
                       "answer_share_min": round(float(share[answer.start : answer.stop].min()), 4),
                       "answer_share_mean": round(float(share[answer.start : answer.stop].mean()), 4),
                       "fact_share_mean": round(float(share[fact.start : fact.stop].mean()), 4) if len(fact) else None,
                       "context_share_mean": round(float(share.mean()), 4), "threads": args.threads,
                       "prompt_layout": args.prompt_layout, "date": time.strftime("%Y-%m-%d")}
                append_row(args.out, row)
                print(json.dumps(row), flush=True)


def summary_rows(path: Path, hits_path: Path) -> list[dict]:
    """Per (variant, ratio), over the needles the full cache finds in `hits_path` (a `kvzap_default.py` record of the same
    variants, seeds and ratios), split by whether the variant found them there: how many (and how many lie in the exact
    window), and the median over the needles outside the window of the share of (layer, KV head) pairs keeping the least
    kept answer token, the answer's tokens, the fact's words before it and any context token."""
    hits = {(r["variant"], r["seed"], r["length"], r["ratio"]): r["hit"] for r in map(json.loads, hits_path.read_text(encoding="utf-8").splitlines())}
    groups: dict[tuple, list[dict]] = {}
    for r in map(json.loads, path.read_text(encoding="utf-8").splitlines()):
        if hits.get(("full", r["seed"], r["length"], 0.0)) != 1.0 or (r["variant"], r["seed"], r["length"], r["ratio"]) not in hits:
            continue
        found = hits[(r["variant"], r["seed"], r["length"], r["ratio"])] == 1.0
        groups.setdefault((r["variant"], r["ratio"], "found" if found else "missed"), []).append(r)
    def median(rows: list[dict], key: str) -> float | str:
        outside = [r[key] for r in rows if not r["in_window"]]
        return round(statistics.median(outside), 3) if outside else "–"

    return [{"variant": variant, "ratio": ratio, "needle": outcome, "needles": len(rows),
             "in the window": sum(r["in_window"] for r in rows),
             "least kept answer token": median(rows, "answer_share_min"), "answer tokens": median(rows, "answer_share_mean"),
             "fact's words before it": median(rows, "fact_share_mean"), "any context token": median(rows, "context_share_mean")}
            for (variant, ratio, outcome), rows in sorted(groups.items())]


if __name__ == "__main__":
    main()
