"""Quantized storage of the compressed context (kv_bits): bytes stored, decode speed and language-modelling quality.

On the default model (SmolLM2-135M-Instruct, float32 on the CPU), `--documents` prose documents
(`eval.perplexity.prose_document`, seed 0) of `--context` + `--scored` + 1 tokens. The first
`--context` tokens are the context; it is prefilled once (`capture_qkv`) and compressed from that
prefill by each method at each compression ratio (prefill mode, `CompressedCache.from_prefill`, the
method's own sink and window), then stored at 32 (kv_bits None), 8, 4 and 2 bits (group size 32).
The next `--scored` tokens are fed in blocks of 64 through each cache, and each is scored by the
negative log-likelihood (float32) of the token after it, teacher-forced. Ratio 0 is the full
context, at each number of bits (its 32-bit cell is the full cache, the reference).

Per cell (method, ratio, bits), over documents: the perplexity exp(mean NLL) with the exp of the
95% Student-t interval of the mean per-document log-perplexity, and the ratio to the full cache
exp(mean paired difference of log-perplexities) with its 95% t-interval (`eval.stats.t_interval`);
stored bytes after compression — KV bytes (codes, scales, zero points, full-precision window)
plus positions and log-weights — as a fraction of the full cache's keys and values for the same
context. Decode speed: on the first document, `--steps` single-token forwards after the
compressed context, the median seconds per step (tokens per second), at each cell.

Writes benchmarks/results/quantized_storage.{csv,md}.

    python benchmarks/quantized_storage.py [--documents 30] [--context 768] [--scored 128] [--methods snapkv,keydiff,balancekv]
        [--ratios 0.5,0.75,0.9] [--bits 32,8,4,2] [--steps 32] [--threads 2]
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
from kvcompress.eval.stats import t_interval
from kvcompress.eval.tables import write_csv
from kvcompress.integration import use_compressed_attention
from kvcompress.integration.generation import full_kv_bytes
from kvcompress.options import CompressionOptions

RESULTS = Path(__file__).parent / "results"
BLOCK = 64


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--documents", type=int, default=30)
    p.add_argument("--context", type=int, default=768, help="context tokens compressed")
    p.add_argument("--scored", type=int, default=128, help="continuation tokens scored after the context")
    p.add_argument("--methods", default="snapkv,keydiff,balancekv")
    p.add_argument("--ratios", default="0.5,0.75,0.9")
    p.add_argument("--bits", default="32,8,4,2", help="bits per stored element; 32 is full precision (kv_bits None)")
    p.add_argument("--steps", type=int, default=32, help="single-token decode steps timed per cell on the first document")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "quantized_storage"))
    return p.parse_args()


def cells(methods: list[str], ratios: list[float], bits: list[int]) -> list[tuple[str, float, int]]:
    """(method, ratio, bits): the full context at every number of bits (once, under the first method), then every method × ratio × bits."""
    return [(methods[0], 0.0, b) for b in bits] + [(m, r, b) for m in methods for r in ratios for b in bits]


def options_of(method: str, ratio: float, bits: int) -> CompressionOptions:
    return CompressionOptions(method=method, compression_ratio=ratio, kv_bits=None if bits == 32 else bits)


def stored_bytes(cache: CompressedCache) -> int:
    """KV bytes plus the positions and log-weights held, every layer."""
    total = cache.nbytes()
    for layer in cache.layers:
        for part in (layer.front, layer.tail):
            if part is not None:
                total += part.index_nbytes()
    return total


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
    torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    ratios = [float(r) for r in args.ratios.split(",")]
    bits = [int(b) for b in args.bits.split(",")]
    grid = cells(methods, ratios, bits)
    model, tokenizer = kvc.load_model(device="cpu", dtype="float32")
    log_ppl: dict[tuple, list[float]] = {c: [] for c in grid}
    fraction: dict[tuple, list[float]] = {c: [] for c in grid}
    speed: dict[tuple, float] = {}
    started = time.perf_counter()
    for index in range(args.documents):
        ids = torch.tensor([prose_document(index, args.context + max(args.scored, args.steps) + 1, tokenizer).ids])
        n_context = args.context
        captured = capture_qkv(model, ids[:, :n_context])
        full = full_kv_bytes(model, n_context, torch.float32)
        with use_compressed_attention(model):
            for cell in grid:
                cache = CompressedCache.from_prefill(model, options_of(*cell), captured)
                fraction[cell].append(stored_bytes(cache) / full)
                if index == 0:
                    speed[cell] = decode_seconds(model, CompressedCache.from_prefill(model, options_of(*cell), captured), ids, n_context,
                                                 args.steps)
                log_ppl[cell].append(float(continuation_nll(model, cache, ids[:, : n_context + args.scored + 1], n_context).mean()))
        write_results(args, summarize(grid, log_ppl, fraction, speed), index + 1, time.perf_counter() - started)
        print(f"document {index + 1}/{args.documents} done, {time.perf_counter() - started:.0f}s", flush=True)
    print(Path(args.out).with_suffix(".md").read_text())


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


def write_results(args, rows: list[dict], documents: int, seconds: float) -> None:
    """OUT.csv and OUT.md of the rows (rewritten after every document, so an interrupted run keeps what it measured)."""
    out = Path(args.out)
    write_csv(out.with_suffix(".csv"), rows)
    header = (f"# Quantized storage of the compressed context\n\n{datetime.date.today()}, {platform.processor() or platform.machine()}, "
              f"torch {torch.__version__}, {args.threads} threads; SmolLM2-135M-Instruct float32; {documents} of {args.documents} prose "
              f"documents (context {args.context} tokens, {args.scored} scored); prefill mode, group size 32, each method's own sink and "
              f"window; decode speed on document 0, median of {args.steps} single-token steps. Intervals: 95% Student-t over documents. "
              f"Wall time {seconds:.0f}s.\n\n"
              "`python benchmarks/quantized_storage.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k != "out") + "`\n\n")
    lines = ["| method | ratio | bits | stored / full | perplexity [95% CI] | vs full cache [95% CI] | decode tok/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['ratio']} | {r['bits']} | {r['stored_fraction']:.3f} | {r['perplexity']:.2f} "
                     f"[{r['ppl_low']:.2f}, {r['ppl_high']:.2f}] | {r['vs_full']:.3f} [{r['vs_full_low']:.3f}, {r['vs_full_high']:.3f}] | "
                     f"{r['decode_tokens_per_s']} |")
    out.with_suffix(".md").write_text(header + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
