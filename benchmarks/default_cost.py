"""What one answer costs: `kvc.generate` with a method against a plain transformers `model.generate` of the same prompt
tokens, on the default model, in one process at one thread count (the ratio is what is reported).

For each context length (real prose, `eval.capture.prose_text`, cut to the length in tokens) the prompt is built once
(`build_prompt`, the layout `kvc.generate` uses), then, `--repeats` times in turn, a plain greedy `model.generate` of
those ids and every (method, mode) answer `--new-tokens` tokens (no stop at the end of text, so every call writes as
many), after `--warmup` untimed rounds of the same calls (a cell's first call pays one-off costs: first allocations
of its shapes). The median seconds per call and its ratio to the plain generate's median are written to OUT as CSV, with the
KV bytes the answer's cache stored ÷ the full cache's for the same tokens (`GenerationResult.kv_bytes`, the peak), the
machine, threads and date; each `--ratios` value is one more round of every cell:

    .venv/bin/python benchmarks/default_cost.py --lengths 2048,4096,8192 --methods default,kvzap --threads 1 \\
        --out benchmarks/results/default_cost.csv
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.eval.bench.common import machine_description
from kvcompress.eval.capture import prose_text
from kvcompress.integration import build_prompt

QUESTION = "What is the main subject of the text above? Answer in one sentence."
# name -> (method, method_params, exact sink/window and chunk_size settings)
VARIANTS = {
    "default": ("default", {}, {}),
    "default_chunk_128": ("default", {}, {"chunk_size": 128}),  # the streams' prompt in blocks of 128 tokens (the library's 256)
    "kvzip_refit": ("kvzip_refit", {}, {}),
    "kvzap": ("kvzap", {}, {}),
    "adakv_kvzap": ("adakv", {"scorer": "kvzap", "alpha_safeguard": 0.05}, {}),
    "adakv_kvzap_model": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05}, {}),  # the default at slack 0.5
    "snapkv": ("snapkv", {}, {}),
}


def context_of(tokenizer, tokens: int) -> str:
    ids = tokenizer(prose_text(n_chars=6 * tokens), add_special_tokens=False)["input_ids"][:tokens]
    return tokenizer.decode(ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--methods", default="default", help=f"comma-separated, among {','.join(VARIANTS)}")
    p.add_argument("--modes", default="prefill,chunked,decode")
    p.add_argument("--ratios", default="0.75", help="comma-separated compression ratios (each a round of every cell)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds of every call before the timed ones (default 1)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvc.load_model()
    rows = []
    for length in map(int, args.lengths.split(",")):
        context = context_of(tokenizer, length)
        context_ids, question_ids = build_prompt(tokenizer, context, QUESTION)
        prompt = torch.cat([context_ids, question_ids], 1)
        cells = [(m, mode, float(r)) for r in args.ratios.split(",") for m in args.methods.split(",") for mode in args.modes.split(",")]
        times: dict[tuple, list[float]] = {cell: [] for cell in [("plain", "generate", 0.0), *cells]}
        stored: dict[tuple, float] = {}
        for round_index in range(args.warmup + args.repeats):
            timed = round_index >= args.warmup
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                               do_sample=False, pad_token_id=tokenizer.eos_token_id)
            if timed:
                times[("plain", "generate", 0.0)].append(time.perf_counter() - start)
            for name, mode, ratio in list(cells):
                method, params, exact = VARIANTS[name]
                start = time.perf_counter()
                try:
                    res = kvc.generate(model, tokenizer, context, QUESTION, method=method, method_params=params, compression_ratio=ratio,
                                       mode=mode, max_new_tokens=args.new_tokens, stop_at_eos=False, progress=False, **exact)
                except ValueError as error:  # a variant that does not run in this mode (e.g. kvzip_refit streams not)
                    print(f"{name} {mode}: {error}")
                    times.pop((name, mode, ratio), None)
                    cells.remove((name, mode, ratio))
                    continue
                if timed:
                    times[(name, mode, ratio)].append(time.perf_counter() - start)
                stored[(name, mode, ratio)] = res.kv_bytes / res.kv_bytes_full
        plain = statistics.median(times[("plain", "generate", 0.0)])
        for (name, mode, ratio), seconds in times.items():
            row = {"tokens": prompt.shape[1], "context_tokens": length, "method": name, "mode": mode, "ratio": ratio,
                   "median_s": round(statistics.median(seconds), 3), "over_plain": round(statistics.median(seconds) / plain, 3),
                   "kv_over_full": round(stored.get((name, mode, ratio), 1.0), 4),
                   "repeats": args.repeats, "new_tokens": args.new_tokens, "threads": args.threads,
                   "machine": machine_description(torch.get_num_threads()),
                   "date": time.strftime("%Y-%m-%d")}
            rows.append(row)
            print(row, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
