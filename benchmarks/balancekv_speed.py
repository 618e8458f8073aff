"""Batched BalanceKV speed: compressing a whole 4k-token cache of the default model vs one exact prefill.

Runs one exact prefill of `--tokens` tokens of real prose on SmolLM2-135M-Instruct (30 layers,
3 KV heads, head_dim 64; SDPA attention, KV cache on), capturing the post-RoPE keys/values of every
layer. The 30 layers are then stacked on the batch axis ([30, 3, n, 64]) and compressed by
BalanceKV at T = 2 (budget n/4, no sink/window, b = 256) as one batched tensor program. Reports the
minimum wall time over `--repeats` runs of each and their ratio, both with `--threads` torch
threads (default 1: on the shared 2-core machine a 2-thread pool stalls under load).

Writes benchmarks/results/balancekv_speed.{csv,md}.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.eval.capture import capture_qkv, prose_text

RESULTS = Path(__file__).parent / "results"


def best_time(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both the prefill and BalanceKV")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    threads = args.threads

    model, tokenizer = kvc.load_model()
    ids = tokenizer(prose_text(8 * args.tokens, seed=0), add_special_tokens=False, return_tensors="pt")["input_ids"][:, : args.tokens]
    n = ids.shape[1]
    with torch.no_grad():
        prefill = best_time(lambda: model(input_ids=ids, use_cache=True), args.repeats)
    captured = capture_qkv(model, ids)
    keys = torch.cat([k for _, k, _ in captured.values()])
    values = torch.cat([v for _, _, v in captured.values()])
    budget = n // 4
    summary = None

    def run():
        nonlocal summary
        summary = kvc.compress("balancekv", keys, values, budget=budget, sink=0, window=0, seed=0, block_size=args.block_size)

    compress = best_time(run, args.repeats)
    assert summary.num_slots == budget
    row = {"tokens": n, "layers": keys.shape[0], "kv_heads": keys.shape[1], "head_dim": keys.shape[-1], "T": 2,
           "block_size": args.block_size, "threads": threads, "prefill_s": prefill, "balancekv_s": compress,
           "ratio": compress / prefill}
    print(row)
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "balancekv_speed.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        writer.writeheader()
        writer.writerow(row)
    (RESULTS / "balancekv_speed.md").write_text(
        f"# BalanceKV batched compression vs one exact prefill (SmolLM2-135M, CPU, {threads} threads, min of {args.repeats})\n\n"
        "| tokens | cache [layers, heads, n, d] | T | b | exact prefill (s) | BalanceKV all layers (s) | ratio |\n"
        "|---|---|---|---|---|---|---|\n"
        f"| {n} | [{keys.shape[0]}, {keys.shape[1]}, {n}, {keys.shape[-1]}] | 2 | {args.block_size} | {prefill:.2f} | {compress:.2f} | {compress / prefill:.3f} |\n"
    )


if __name__ == "__main__":
    main()
