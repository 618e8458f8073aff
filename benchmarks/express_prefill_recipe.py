"""Seed 003's KV-compression recipe on the default model: Express prefill, then SnapKV / PyramidKV / StreamingLLM.

For each sample of the needle task (`niah_single`, filler haystack) and the line task
(`line_retrieval`, one line in a prose haystack) the context is prefilled twice:
- exact: one forward with SDPA (`capture_qkv`);
- express: `kvcompress.integration.prefill_approx.approximate_prefill` — chunks of 128 tokens,
  each attending to a Thinformer Express cache (sink 32, window 32, 512 middle slots per head)
  plus the chunk exactly.
Each record is compressed by every method (`generate_ids(prefill=record)`, the question appended
exactly, greedy decoding); "full" is the record kept whole (a ratio-0 compression), which shows
what the prefill itself costs in quality.

Times are process CPU seconds (1 torch thread, so on a quiet machine they are the wall time; on
this shared machine wall time is several times larger and erratic), per sample, over the 30 layers:
- prefill_attention_s: time inside the attention functions of the prefill forward: exact — SDPA
  (causal, every token); express — weighted attention over the Express summary plus the chunk,
  and the Express updates;
- compress_s: the method's compression of the record (`CompressedCache.from_prefill`);
- decode_attention_s: time inside the attention function while the question and the answer are
  processed over the compressed cache;
- total_attention_s: their sum (the seed's "total attention runtime", Fig. 2 / App. I.2);
- prefill_s: the whole prefill forward (every module, not only attention).
Accuracy carries a 95% Wilson interval over the samples.

    python benchmarks/express_prefill_recipe.py [--tokens 2048] [--samples 30] [--ratio 0.5] [--resume] [--from-csv CSV]
Sample i (seed first + i) has its needle / line at depth 0.05 + 0.9·i/(samples − 1). Samples run in
van der Corput order of depth (0.05, 0.95, about 0.5, 0.27, 0.73, ...), each for every task, so an
interrupted run still covers both tasks and the whole depth range; --resume continues a run from
its CSV (skipping the samples it holds), --from-csv summarises the rows written so far.
Writes benchmarks/results/express_prefill_recipe.{csv,md}.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations import sdpa_attention

import kvcompress as kvc
from kvcompress.cache import CompressedCache
from kvcompress.eval.capture import capture_qkv
from kvcompress.eval.stats import sign_test, wilson
from kvcompress.eval.tables import write_csv
from kvcompress.eval.tasks import generate_sample, score
from kvcompress.integration.attention import ATTENTION_NAME, kvcompress_attention
from kvcompress.integration.generation import generate_ids
from kvcompress.integration.model import build_prompt
from kvcompress.integration.prefill_approx import approximate_prefill

RESULTS = Path(__file__).parent / "results"
METHODS = ("full", "snapkv", "pyramidkv", "streamingllm")
TASKS = {"needle": ("niah_single", {"haystack": "filler"}), "line": ("line_retrieval", {"haystack": "prose", "n_lines": 1})}


class CpuTimer:
    """A function wrapped so that the process CPU seconds spent inside it add up (1 thread: the quiet-machine wall time)."""

    def __init__(self, function):
        self.function, self.seconds = function, 0.0

    def __call__(self, *args, **kwargs):
        start = time.process_time()
        out = self.function(*args, **kwargs)
        self.seconds += time.process_time() - start
        return out

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def run_sample(model, tokenizer, timers, task, sample, ratio, max_new_tokens) -> list[dict]:
    exact_timer, timer, compress_timer = timers
    context_ids, question_ids = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    exact_timer.take()
    start = time.process_time()
    exact = capture_qkv(model, context_ids)
    exact_cpu = time.process_time() - start
    timer.take()
    start = time.process_time()
    approx = approximate_prefill(model, context_ids)
    approx_cpu = time.process_time() - start
    prefills = {"exact": (exact, exact_cpu, exact_timer.take()), "express": (approx, approx_cpu, timer.take())}
    rows = []
    for prefill, (record, prefill_cpu, attention) in prefills.items():
        for method in METHODS:
            name, kept_ratio = ("streamingllm", 0.0) if method == "full" else (method, ratio)
            compress_timer.take()
            res = generate_ids(model, context_ids, question_ids, method=name, compression_ratio=kept_ratio,
                               max_new_tokens=max_new_tokens, prefill=record)
            decode, compress = timer.take(), compress_timer.take()
            text = tokenizer.decode(res.token_ids, skip_special_tokens=True)
            rows.append({
                "task": task, "tokens": context_ids.shape[1], "depth": sample.depth, "method": method, "prefill": prefill,
                "ratio": kept_ratio, "score": score(sample, text), "prefill_attention_s": attention,
                "compress_s": compress, "decode_attention_s": decode,
                "total_attention_s": attention + compress + decode, "prefill_s": prefill_cpu, "answer": text.strip()[:40],
            })
    return rows


def spread_order(n: int) -> list[int]:
    """0..n-1 ordered so that every prefix spreads over the range (van der Corput sequence in base 2, ends first)."""
    order, k = ([0, n - 1] if n > 1 else [0]), 1
    while len(order) < n:
        fraction, bit, j = 0.0, 0.5, k
        while j:
            fraction, bit, j = fraction + bit * (j & 1), bit / 2, j >> 1
        index = round(fraction * (n - 1))
        if index not in order:
            order.append(index)
        k += 1
    return order


def read_rows(path: Path) -> list[dict]:
    """Rows of an earlier run's CSV, numbers parsed."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key in ("score", "prefill_attention_s", "compress_s", "decode_attention_s", "total_attention_s", "prefill_s"):
            row[key] = float(row[key])
        row["sample"] = int(row["sample"])
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """One row per (task, method, prefill): accuracy with its Wilson interval, median times; on the express rows
    the paired comparison with exact prefill on the same samples (samples only exact / only express answered,
    exact sign-test p) and the median over samples of the express / exact total attention time."""
    out = []
    for task in TASKS:
        for method in METHODS:
            cells = {prefill: {r["sample"]: r for r in rows if r["task"] == task and r["method"] == method and r["prefill"] == prefill}
                     for prefill in ("exact", "express")}
            for prefill, cell in cells.items():
                if not cell:
                    continue
                hits = sum(r["score"] for r in cell.values())
                low, high = wilson(hits, len(cell))
                paired = [(cells["exact"][i], r) for i, r in cell.items() if prefill == "express" and i in cells["exact"]]
                only_exact = sum(e["score"] > x["score"] for e, x in paired)
                only_express = sum(x["score"] > e["score"] for e, x in paired)
                out.append({
                    "task": task, "method": method, "prefill": prefill, "samples": len(cell), "accuracy": hits / len(cell),
                    "wilson95": f"[{low:.2f}, {high:.2f}]",
                    "only_exact/only_express": f"{only_exact}/{only_express}" if paired else "",
                    "sign_p": sign_test(only_express, only_exact) if paired else "",
                    "prefill_attention_s": statistics.median(r["prefill_attention_s"] for r in cell.values()),
                    "compress_s": statistics.median(r["compress_s"] for r in cell.values()),
                    "decode_attention_s": statistics.median(r["decode_attention_s"] for r in cell.values()),
                    "total_attention_s": statistics.median(r["total_attention_s"] for r in cell.values()),
                    "total_attention_vs_exact": statistics.median(x["total_attention_s"] / e["total_attention_s"] for e, x in paired) if paired else "",
                    "prefill_s": statistics.median(r["prefill_s"] for r in cell.values()),
                })
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="context length of each sample (default 2048)")
    p.add_argument("--samples", type=int, default=30, help="samples per task, depths spread over [0.05, 0.95] (default 30)")
    p.add_argument("--ratio", type=float, default=0.5, help="compression ratio of the methods (default 0.5)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the eval runner's per-task limit")
    p.add_argument("--seed", type=int, default=1000, help="first sample seed (default 1000)")
    p.add_argument("--out", type=Path, default=RESULTS / "express_prefill_recipe")
    p.add_argument("--resume", action="store_true", help="continue the run whose CSV is at --out: skip the samples it holds")
    p.add_argument("--from-csv", type=Path, default=None, help="only summarise the rows of an earlier (possibly interrupted) run")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("KVCOMPRESS_THREADS", "1")))
    model, tokenizer = kvc.load_model() if args.from_csv is None else (None, None)
    timer = CpuTimer(kvcompress_attention)
    AttentionInterface.register(ATTENTION_NAME, timer)
    exact_timer = CpuTimer(sdpa_attention.sdpa_attention_forward)
    sdpa_attention.sdpa_attention_forward = exact_timer  # what capture_qkv's exact forward calls
    compress_timer = CpuTimer(CompressedCache.from_prefill)
    CompressedCache.from_prefill = compress_timer  # what generate_ids(prefill=...) calls to compress a record
    csv_path = args.out.with_suffix(".csv")
    rows = read_rows(args.from_csv) if args.from_csv is not None else read_rows(csv_path) if args.resume else []
    done = {(r["task"], r["sample"]) for r in rows}
    for i in spread_order(args.samples) if args.from_csv is None else []:
        depth = 0.05 + 0.9 * i / max(1, args.samples - 1)
        for task, (generator, extra) in TASKS.items():
            if (task, i) in done:
                continue
            sample = generate_sample(generator, target_tokens=args.tokens, depth=depth, seed=args.seed + i, tokenizer=tokenizer, **extra)
            max_new = args.max_new_tokens or sample.max_new_tokens
            rows += [{"sample": i, **r} for r in run_sample(model, tokenizer, (exact_timer, timer, compress_timer), task, sample, args.ratio, max_new)]
            print(task, i, [(r["method"], r["prefill"], r["score"]) for r in rows[-2 * len(METHODS):]], flush=True)
            write_csv(csv_path, rows)
    table = summarise(rows)
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores shared with other jobs (noisy), "
               f"torch threads {torch.get_num_threads()}, {datetime.date.today()}, torch {torch.__version__}")
    columns = list(table[0])
    lines = [
        "# Express prefill recipe (the Express paper): quality and attention time against exact prefill", "",
        f"Default model, {args.tokens}-token contexts, methods at compression ratio {args.ratio}, greedy, "
        f"new tokens: {args.max_new_tokens or 'the eval runner limit per task'}. Machine: {machine}. Times are medians over samples, seconds per sample "
        "process CPU seconds over all layers (see the script's docstring).", "",
        "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
    ]
    for row in table:
        lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
