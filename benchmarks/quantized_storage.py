"""Quantized storage of the compressed context (kv_bits): bytes stored, decode speed and language-modelling quality.

On the default model (SmolLM2-135M-Instruct on the CPU, float32, or bfloat16 with `--dtype`), `--documents` prose documents
(`eval.perplexity.prose_document`, seed 0) of `--context` + `--scored` + 1 tokens. The first
`--context` tokens are the context; it is prefilled once (`capture_qkv`) and compressed from that
prefill by each method at each compression ratio (prefill mode, `CompressedCache.from_prefill`, the
method's own sink and window), then stored at full precision (kv_bits None: 32 bits in float32, 16 in
bfloat16), 8, 4 and 2 bits (group size 32).
The next `--scored` tokens are fed in blocks of 64 through each cache, and each is scored by the
negative log-likelihood (float32) of the token after it, teacher-forced. Ratio 0 is the full
context, at each number of bits (its full-precision cell is the full cache, the reference).

Per cell (method, ratio, bits), over documents: the perplexity exp(mean NLL) with the exp of the
95% Student-t interval of the mean per-document log-perplexity, and the ratio to the full cache
exp(mean paired difference of log-perplexities) with its 95% t-interval (`eval.stats.t_interval`);
stored bytes after compression — KV bytes (codes, scales, zero points, full-precision window)
plus positions and log-weights — as a fraction of the full cache's keys and values for the same
context. Decode speed: on the first document, `--steps` single-token forwards after the
compressed context, the median seconds per step (tokens per second), at each cell.

Writes benchmarks/results/quantized_storage.{csv,md}.

With `--task needle`: `--samples` needle samples of the sweep's task `--needle-task` (default
niah_single, a 7-digit needle in filler; niah_prose: a name in real prose) at `--context` tokens,
sample i built as `kvcompress eval` builds it (seed i, depth `sample_depth(i)`, the default prompt
layout). The context is prefilled once per sample and each cell answers from it greedily
(`generate_ids(..., prefill=captured)`, the question and answer exact). Per cell: accuracy with its
95% Wilson interval, and the paired difference to the same method and ratio at full precision
(Newcombe's interval, `eval.stats.paired_difference_interval`); stored bytes of the compressed
context as above. Writes benchmarks/results/quantized_storage_needle.{csv,md}.

With `--mode decode` (perplexity task): every token, context and continuation, goes through each
cell's decode-mode stream (`CompressedCache(..., mode="decode", stream_length=...)`, the context fed
in blocks of the options' chunk size), which keeps compressing as it goes; with kv_bits the stream
stores its slots quantized, each slot once, keys and values grouped per slot
(`quantization.QuantizedSlots`). Stored bytes are read after the context (the stream's state with
its room for the next blocks, sink and window, positions and log-weights). Writes
benchmarks/results/quantized_storage_decode.{csv,md} by default.

`--plot` draws both result tables as quality against stored bytes (benchmarks/results/quantized_storage.png).

    python benchmarks/quantized_storage.py [--documents 30] [--context 768] [--scored 128] [--methods snapkv,keydiff,balancekv]
        [--ratios 0.5,0.75,0.9] [--bits 32,8,4,2] [--steps 32] [--threads 2]
    python benchmarks/quantized_storage.py --mode decode --documents 30 --context 2048 --scored 64 --methods keydiff
    python benchmarks/quantized_storage.py --task needle --samples 30 --context 4096 --methods keydiff,snapkv [--needle-task niah_single]
    python benchmarks/quantized_storage.py --plot
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import statistics
import time
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.cache import CompressedCache
from kvcompress.eval.capture import capture_qkv
from kvcompress.eval.perplexity import prose_document
from kvcompress.eval.runner import SampleSpec, SweepConfig, sample_depth
from kvcompress.eval.stats import paired_difference_interval, t_interval, wilson
from kvcompress.eval.stopping import stop_token_ids
from kvcompress.eval.tables import read_csv, write_csv
from kvcompress.eval.tasks import score
from kvcompress.integration import build_prompt, generate_ids, use_compressed_attention
from kvcompress.integration.generation import full_kv_bytes
from kvcompress.methods.stream import Stream
from kvcompress.options import CompressionOptions

RESULTS = Path(__file__).parent / "results"
FULL_BITS = {"float32": 32, "bfloat16": 16}  # the bits of a stored element at full precision, by model dtype
BLOCK = 64


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="perplexity", choices=["perplexity", "needle"])
    p.add_argument("--documents", type=int, default=30, help="perplexity: prose documents")
    p.add_argument("--samples", type=int, default=30, help="needle: samples")
    p.add_argument("--mode", default="prefill", choices=["prefill", "decode"],
                   help="perplexity: compress the context once (prefill) or stream every token (decode)")
    p.add_argument("--needle-task", default="niah_single", choices=["niah_single", "niah_prose"])
    p.add_argument("--context", type=int, default=768, help="context tokens compressed")
    p.add_argument("--scored", type=int, default=128, help="continuation tokens scored after the context")
    p.add_argument("--methods", default="snapkv,keydiff,balancekv")
    p.add_argument("--ratios", default="0.5,0.75,0.9")
    p.add_argument("--dtype", default="float32", choices=sorted(FULL_BITS), help="the model's dtype (default float32)")
    p.add_argument("--bits", default=None,
                   help="bits per stored element, the dtype's own (32 or 16) meaning full precision, kv_bits None (default: 32,8,4,2 "
                        "in float32, 16,8,4,2 in bfloat16)")
    p.add_argument("--steps", type=int, default=32, help="single-token decode steps timed per cell on the first document")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="results path; .csv and .md are written beside it, any suffix replaced (default: benchmarks/results/quantized_storage[_needle|_decode])")
    p.add_argument("--plot", action="store_true", help="only draw benchmarks/results/quantized_storage.png from the two result tables")
    args = p.parse_args()
    if args.out is None:
        name = {"needle": "quantized_storage_needle"}.get(args.task, "quantized_storage" if args.mode == "prefill" else "quantized_storage_decode")
        args.out = str(RESULTS / name)
    if args.mode != "prefill" and args.task != "perplexity":
        p.error(f"--mode {args.mode} applies to the perplexity task, got --task {args.task}")
    full = FULL_BITS[args.dtype]
    args.bits = args.bits or f"{full},8,4,2"
    wrong = [b for b in args.bits.split(",") if int(b) not in (full, 8, 4, 2)]
    if wrong:
        p.error(f"--bits in {args.dtype} takes {full} (full precision), 8, 4 and 2, got {','.join(wrong)}")
    return args


def cells(methods: list[str], ratios: list[float], bits: list[int]) -> list[tuple[str, float, int]]:
    """(method, ratio, bits): the full context at every number of bits (once, under the first method), then every method × ratio × bits."""
    return [(methods[0], 0.0, b) for b in bits] + [(m, r, b) for m in methods for r in ratios for b in bits]


def options_of(method: str, ratio: float, bits: int, mode: str = "prefill") -> CompressionOptions:
    return CompressionOptions(method=method, compression_ratio=ratio, kv_bits=None if bits in FULL_BITS.values() else bits, mode=mode)


def stored_bytes(cache: CompressedCache) -> int:
    """KV bytes plus the positions and log-weights held, every layer (a live stream's: those of its summary)."""
    total = cache.nbytes()
    for layer in cache.layers:
        for part in (layer.front, layer.tail):
            if isinstance(part, Stream):
                total += part.summary().index_nbytes()
            elif part is not None:
                total += part.index_nbytes()
    return total


@torch.inference_mode()
def compressed_context(model, cell: tuple, ids: torch.Tensor, n_context: int, mode: str, captured) -> CompressedCache:
    """The cache of `cell` holding ids[:n_context]: compressed from the recorded prefill (prefill mode), or the context fed
    in chunks through a decode-mode stream that will take every token of ids but the last."""
    options = options_of(*cell, mode)
    if mode == "prefill":
        return CompressedCache.from_prefill(model, options, captured)
    cache = CompressedCache(model, options, stream_length=ids.shape[1] - 1)
    for block in ids[:, :n_context].split(options.chunk_size, dim=1):
        model(block, past_key_values=cache, use_cache=True)
    return cache


@torch.inference_mode()
def continuation_nll(model, cache: CompressedCache, ids: torch.Tensor, n_context: int) -> torch.Tensor:
    """NLL [m] of ids[n_context + 1:], the cache holding ids[:n_context]: ids[n_context:-1] fed in blocks."""
    nll = []
    for start in range(n_context, ids.shape[1] - 1, BLOCK):
        block = ids[:, start : min(start + BLOCK, ids.shape[1] - 1)]
        logits = model(block, past_key_values=cache, use_cache=True).logits[0].float()
        targets = ids[0, start + 1 : start + 1 + block.shape[1]]
        nll.append(torch.nn.functional.cross_entropy(logits, targets, reduction="none"))
    return torch.cat(nll)


@torch.inference_mode()
def decode_seconds(model, cache: CompressedCache, ids: torch.Tensor, n_context: int, steps: int) -> float:
    """Median seconds of one single-token forward after the compressed context of ids[:n_context]."""
    times = []
    for token in ids[0, n_context : n_context + steps]:
        start = time.perf_counter()
        model(token.view(1, 1), past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    args = parse_args()
    if args.plot:
        print(plot(RESULTS / "quantized_storage.csv", RESULTS / "quantized_storage_needle.csv", RESULTS / "quantized_storage.png"))
        return
    torch.set_num_threads(args.threads)
    if args.task == "needle":
        needle(args)
        return
    methods = args.methods.split(",")
    ratios = [float(r) for r in args.ratios.split(",")]
    bits = [int(b) for b in args.bits.split(",")]
    grid = cells(methods, ratios, bits)
    model, tokenizer = kvc.load_model(device="cpu", dtype=args.dtype)
    log_ppl: dict[tuple, list[float]] = {c: [] for c in grid}
    fraction: dict[tuple, list[float]] = {c: [] for c in grid}
    speed: dict[tuple, float] = {}
    started = time.perf_counter()
    for index in range(args.documents):
        ids = torch.tensor([prose_document(index, args.context + max(args.scored, args.steps) + 1, tokenizer).ids])
        n_context = args.context
        captured = capture_qkv(model, ids[:, :n_context]) if args.mode == "prefill" else None
        full = full_kv_bytes(model, n_context, model.dtype)
        with use_compressed_attention(model):
            for cell in grid:
                cache = compressed_context(model, cell, ids, n_context, args.mode, captured)
                fraction[cell].append(stored_bytes(cache) / full)
                if index == 0:
                    speed[cell] = decode_seconds(model, compressed_context(model, cell, ids, n_context, args.mode, captured), ids,
                                                 n_context, args.steps)
                log_ppl[cell].append(float(continuation_nll(model, cache, ids[:, : n_context + args.scored + 1], n_context).mean()))
        write_results(args, summarize(grid, log_ppl, fraction, speed), f"{index + 1} of {args.documents} prose documents",
                      time.perf_counter() - started)
        print(f"document {index + 1}/{args.documents} done, {time.perf_counter() - started:.0f}s", flush=True)
    print(Path(args.out).with_suffix(".md").read_text(encoding="utf-8"))


def summarize(grid, log_ppl: dict, fraction: dict, speed: dict) -> list[dict]:
    """One row per cell over the documents done so far (the reference: the full context at 32 bits, the first cell)."""
    reference = log_ppl[grid[0]]
    rows = []
    for cell in grid:
        method, ratio, b = cell
        mean, low, high = t_interval(log_ppl[cell])
        diff, dlow, dhigh = t_interval([a - r for a, r in zip(log_ppl[cell], reference)])
        rows.append({
            "method": "full context" if ratio == 0 else method, "ratio": ratio, "bits": b, "documents": len(log_ppl[cell]),
            "stored_fraction": round(statistics.mean(fraction[cell]), 4),
            "perplexity": round(math.exp(mean), 3), "ppl_low": round(math.exp(low), 3), "ppl_high": round(math.exp(high), 3),
            "vs_full": round(math.exp(diff), 4), "vs_full_low": round(math.exp(dlow), 4), "vs_full_high": round(math.exp(dhigh), 4),
            "decode_tokens_per_s": round(1.0 / speed[cell], 1),
        })
    return rows


def header(args, title: str, done: str, details: str, seconds: float) -> str:
    """The result file's title, machine, what was run (`done`, `details`) and the command that reproduces it."""
    unused = ("documents", "scored", "steps") if args.task == "needle" else ("samples", "needle_task")
    command = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "plot", *unused))
    return (f"# {title}\n\n{datetime.date.today()}, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
            f"{args.threads} threads; SmolLM2-135M-Instruct {args.dtype}; {done} ({details}); {args.mode} mode, group size 32, each method's "
            f"own sink and window. Wall time {seconds:.0f}s.\n\n`python benchmarks/quantized_storage.py {command}`\n\n")


def write_results(args, rows: list[dict], done: str, seconds: float) -> None:
    """OUT.csv and OUT.md of the rows (rewritten after every document, so an interrupted run keeps what it measured)."""
    out = Path(args.out)
    write_csv(out.with_suffix(".csv"), rows)
    details = (f"context {args.context} tokens, {args.scored} scored; decode speed on document 0, median of {args.steps} "
               "single-token steps; intervals: 95% Student-t over documents")
    out.with_suffix(".md").write_text(header(args, "Quantized storage of the compressed context", done, details, seconds)
                                      + perplexity_table(rows) + "\n", encoding="utf-8")


def perplexity_table(rows: list[dict]) -> str:
    """The Markdown table of `summarize`'s rows (as written to OUT.csv)."""
    lines = ["| method | ratio | bits | stored / full | perplexity [95% CI] | vs full cache [95% CI] | decode tok/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['ratio']} | {r['bits']} | {r['stored_fraction']:.3f} | {r['perplexity']:.2f} "
                     f"[{r['ppl_low']:.2f}, {r['ppl_high']:.2f}] | {r['vs_full']:.3f} [{r['vs_full_low']:.3f}, {r['vs_full_high']:.3f}] | "
                     f"{r['decode_tokens_per_s']} |")
    return "\n".join(lines)


def needle(args) -> None:
    """The needle task at `--context` tokens: every cell answers each sample from one prefill of its context."""
    methods = args.methods.split(",")
    grid = cells(methods, [float(r) for r in args.ratios.split(",")], [int(b) for b in args.bits.split(",")])
    model, tokenizer = kvc.load_model(device="cpu", dtype=args.dtype)
    config = SweepConfig(methods=methods, tasks=[args.needle_task], lengths=[args.context], samples=args.samples)
    scores: dict[tuple, list[float]] = {c: [] for c in grid}
    fraction: dict[tuple, list[float]] = {c: [] for c in grid}
    answers: dict[tuple, list[str]] = {c: [] for c in grid}
    expected: list[str] = []
    started = time.perf_counter()
    for index in range(args.samples):
        sample = SampleSpec(args.needle_task, args.context, index, sample_depth(index)).build(config, tokenizer)
        context_ids, question_ids = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix, config.prompt_layout)
        captured = capture_qkv(model, context_ids)
        full = full_kv_bytes(model, context_ids.shape[1], model.dtype)
        expected.append(", ".join(sample.answers))
        for cell in grid:
            options = options_of(*cell)
            with use_compressed_attention(model):
                fraction[cell].append(stored_bytes(CompressedCache.from_prefill(model, options, captured)) / full)
            result = generate_ids(model, context_ids, question_ids, options, max_new_tokens=sample.max_new_tokens,
                                  stop_token_ids=stop_token_ids(tokenizer, sample.stop), prefill=captured)
            prediction = tokenizer.decode(result.token_ids, skip_special_tokens=True).strip()
            scores[cell].append(score(sample, prediction))
            answers[cell].append(prediction)
        write_needle_results(args, needle_rows(grid, scores, fraction, FULL_BITS[args.dtype]), answers, expected,
                             time.perf_counter() - started)
        print(f"sample {index + 1}/{args.samples} done, {time.perf_counter() - started:.0f}s", flush=True)
    print(Path(args.out).with_suffix(".md").read_text(encoding="utf-8"))


def needle_rows(grid, scores: dict, fraction: dict, full_bits: int) -> list[dict]:
    """One row per cell: accuracy (Wilson interval) and its paired difference to the same method and ratio at full precision
    (`full_bits`, the run's dtype's)."""
    rows = []
    for cell in grid:
        method, ratio, b = cell
        hits, n = sum(scores[cell]), len(scores[cell])
        low, high = wilson(hits, n)
        diff, dlow, dhigh = paired_difference_interval(scores[cell], scores[(method, ratio, full_bits)])
        rows.append({
            "method": "full context" if ratio == 0 else method, "ratio": ratio, "bits": b, "samples": n,
            "stored_fraction": round(statistics.mean(fraction[cell]), 4), "accuracy": round(hits / n, 4),
            "accuracy_low": round(low, 4), "accuracy_high": round(high, 4),
            "vs_full_precision": round(diff, 4), "vs_full_precision_low": round(dlow, 4), "vs_full_precision_high": round(dhigh, 4),
        })
    return rows


def write_needle_results(args, rows: list[dict], answers: dict, expected: list[str], seconds: float) -> None:
    """OUT.csv and OUT.md (the table, then every cell's answers beside the expected ones), rewritten after every sample."""
    out = Path(args.out)
    write_csv(out.with_suffix(".csv"), rows)
    details = (f"task {args.needle_task}, context {args.context} tokens, greedy answers; accuracy with its 95% Wilson interval, "
               "the difference to the same method and ratio at full precision with Newcombe's paired 95% interval")
    lines = [needle_table(rows)]
    lines += ["", "## Answers", "", "| sample | expected | " + " | ".join(f"{m} {r} {b}" for m, r, b in answers) + " |",
              "|---|---|" + "---|" * len(answers)]
    for i, want in enumerate(expected):
        lines.append(f"| {i} | {want} | " + " | ".join(a[i].replace("|", "/").replace("\n", " ")[:40] for a in answers.values()) + " |")
    out.with_suffix(".md").write_text(header(args, "Quantized storage: needle retrieval", f"{len(expected)} of {args.samples} samples",
                                             details, seconds) + "\n".join(lines) + "\n", encoding="utf-8")


def needle_table(rows: list[dict]) -> str:
    """The Markdown table of `needle_rows` (as written to OUT.csv)."""
    lines = ["| method | ratio | bits | stored / full | accuracy % [95% CI] | vs full precision, points [95% CI] |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['ratio']} | {r['bits']} | {r['stored_fraction']:.3f} | {100 * r['accuracy']:.0f} "
                     f"[{100 * r['accuracy_low']:.0f}, {100 * r['accuracy_high']:.0f}] | {100 * r['vs_full_precision']:+.0f} "
                     f"[{100 * r['vs_full_precision_low']:+.0f}, {100 * r['vs_full_precision_high']:+.0f}] |")
    return "\n".join(lines)


def plot(perplexity_csv: Path, needle_csv: Path, path: Path) -> Path:
    """Quality against stored bytes: perplexity relative to the full cache (left) and needle accuracy (right), one line
    per method and ratio through its numbers of bits (full precision and 8/4/2), with the 95% intervals as error bars."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.8))
    panels = [(perplexity_csv, "vs_full", "perplexity / full cache (lower is better)"),
              (needle_csv, "accuracy", "needle accuracy (higher is better)")]
    for axis, (csv_path, column, label) in zip(fig.subplots(1, 2), panels):
        rows = read_csv(csv_path)
        for key in dict.fromkeys((r["method"], r["ratio"]) for r in rows):
            line = sorted((r for r in rows if (r["method"], r["ratio"]) == key), key=lambda r: float(r["stored_fraction"]))
            x = [float(r["stored_fraction"]) for r in line]
            y = [float(r[column]) for r in line]
            low = [float(r[column]) - float(r[f"{column}_low"]) for r in line]
            high = [float(r[f"{column}_high"]) - float(r[column]) for r in line]
            name = key[0] if float(key[1]) == 0 else f"{key[0]} @ {float(key[1]):g}"
            axis.errorbar(x, y, yerr=[low, high], marker="o", capsize=2, label=name)
            for r, xi, yi in zip(line, x, y):
                axis.annotate(str(r["bits"]), (xi, yi), textcoords="offset points", xytext=(3, 3), fontsize=7)
        axis.set_xscale("log")
        axis.set_xlabel("stored bytes / full cache (log; labels: bits)")
        axis.set_ylabel(label)
        axis.set_title(f"{csv_path.stem}.md", fontsize=9)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


if __name__ == "__main__":
    main()
