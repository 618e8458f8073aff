"""Streaming throughput of every streaming method against KeyDiff's block prompt processing (issue 17).

One process, one torch thread count, synthetic tensors of the Llama-8B-like shape (H_kv = 8, H_q = 32,
d = 128; `kvcompress.eval.bench.synthetic_layer`): `--tokens` tokens fed to a fresh `kvc.stream`
in blocks of `--block` (each block with its own queries and pre-RoPE keys), half of them kept
(budget n/2, no sink or window), then compacted to the budget (block-wise streams re-compress with
the default slack, `kvcompress.eval.bench.streamed`). Tokens absorbed per second is n over the
min of `--repeats` such runs. `--methods`: every registered method by default (native and
block-wise streams). Methods take turns within each repeat, so load changes of the shared
machine hit all of them. Target: every streaming method >= 1/4 of KeyDiff's tokens/s.

Writes stream_throughput.{csv,md} into `--out`.

    PYTHONPATH=. nice -n 10 python benchmarks/stream_throughput.py --out benchmarks/results/bench/cost2
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from kvcompress.eval.bench import SHAPES, kept_budget, machine_description, natively_streaming, streamed, synthetic_layer, time_calls, write_table
from kvcompress.methods.base import method_names

RESULTS = Path(__file__).parent / "results" / "bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    parser.add_argument("--methods", default=None, help="comma-separated methods (default: every registered method)")
    parser.add_argument("--out", type=Path, default=RESULTS / "throughput")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_description(args.threads)
    chosen = args.methods.split(",") if args.methods else method_names()
    methods = ["keydiff", *[m for m in chosen if m != "keydiff"]]
    layer = synthetic_layer(SHAPES[args.shape], args.tokens, torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(args.repeats):
        for method in methods:
            times[method] += time_calls(streamed(method, layer, 0.5, args.block, 0), 1)
            print(f"{method} {args.tokens / times[method][-1]:.0f} tokens/s", flush=True)
    reference = args.tokens / min(times["keydiff"])
    rows = [{"method": m, "stream": "native" if natively_streaming(m) else "block-wise", "tokens": args.tokens, "budget": kept_budget(args.tokens, 0.5), "block": args.block, "runs": len(t),
             "min_s": min(t), "median_s": statistics.median(t), "tokens_per_s": args.tokens / min(t),
             "over_keydiff": args.tokens / min(t) / reference} for m, t in times.items()]
    shape = SHAPES[args.shape]
    heading = (f"# Streaming throughput vs KeyDiff\n\nMachine: {machine}.\n\n{shape.name} shape (H_kv = {shape.kv_heads}, "
               f"H_q = {shape.query_heads}, d = {shape.head_dim}), {args.tokens} tokens in blocks of {args.block}, half kept, "
               f"no sink or window; tokens/s from the min of {args.repeats} runs.")
    print(write_table(rows, args.out, "stream_throughput", heading, ["method", "stream", "runs", "min_s", "median_s", "tokens_per_s", "over_keydiff"]))


if __name__ == "__main__":
    main()
