"""Quality of the output-changing cost changes of issue 17, on real layers of the default model.

Relative attention error ‖z − Attn‖_F / ‖Attn‖_F of the last `--window` queries (the BalanceKV paper, App. B.1
protocol: first `--sink` and last `--window` tokens exact, the middle compressed to a share
1 − ratio) for each pair "before" / "after":

- ClusterGen one-shot: the seed's global k-center (`block_size=None`) vs block-local k-center (B = 256).
- BalanceKV stream (blocks of `--block` tokens through `kvc.stream`): walk blocks of 256 with
  t = 256 (the former defaults) vs walk blocks of 64 with t = 1024 and with t = 256 (the new defaults).
- BalanceKV one-shot: the plain variant (augment 0) vs the augmented default.

Uniform sampling (`random`, weighted) is the reference. Mean ± std over `--seeds` seeds, one
prose prompt of `--tokens` tokens. Writes benchmarks/results/coreset_quality.{csv,md}.

    PYTHONPATH=. nice -n 10 python benchmarks/tuning/coreset_quality.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.eval.capture import capture_qkv, prose_text
from kvcompress.eval.tables import write_csv

RESULTS = Path(__file__).parents[1] / "results"
# (label, method, parameters, streamed)
CONFIGS = [
    ("clustergen, global k-center (before)", "clustergen", {"block_size": None}, False),
    ("clustergen, block-local B=256 (after)", "clustergen", {}, False),
    ("balancekv stream, b=256 t=256 (before)", "balancekv", {"stream_block": 256, "batch": 256}, True),
    ("balancekv stream, b=64 t=1024", "balancekv", {"batch": 1024}, True),
    ("balancekv stream, b=64 t=256 (after: default)", "balancekv", {}, True),
    ("balancekv one-shot, plain", "balancekv", {"augment": 0.0}, False),
    ("balancekv one-shot, augmented (default)", "balancekv", {}, False),
    ("uniform (random, weighted)", "random", {"weighted": True}, False),
]


def error(q, k, v, method, params, streamed, ratio, sink, window, block, seed) -> float:
    n = k.shape[2]
    targets = q[:, :, n - window :]
    exact = kvc.exact_attention(targets, k, v, causal_offset=n - window)
    budget = round((n - sink - window) * (1.0 - ratio))
    if streamed:
        st = kvc.stream(method, budget=budget, sink=sink, window=window, seed=seed, **params)
        for start in range(0, n, block):
            st.update(k[:, :, start : start + block], v[:, :, start : start + block])
        summary = st.summary()
    else:
        summary = kvc.compress(method, k, v, budget=budget, sink=sink, window=window, seed=seed, **params)
    approx = kvc.weighted_attention(targets, summary, query_positions=torch.arange(n - window, n))
    return float(kvc.relative_error(approx, exact))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--sink", type=int, default=256)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 5, 15])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvc.load_model()
    captured = capture_qkv(model, tokenizer, prose_text(8 * args.tokens, seed=0), layers=args.layers, max_tokens=args.tokens)
    rows = []
    for layer in args.layers:
        q, k, v = (t.float() for t in captured[layer])
        for ratio in args.ratios:
            for label, method, params, streamed in CONFIGS:
                errs = [error(q, k, v, method, params, streamed, ratio, args.sink, args.window, args.block, s) for s in range(args.seeds)]
                rows.append({"layer": layer, "ratio": ratio, "config": label, "seeds": args.seeds,
                             "error_mean": statistics.fmean(errs), "error_std": statistics.stdev(errs) if len(errs) > 1 else 0.0})
                print(rows[-1], flush=True)
    RESULTS.mkdir(exist_ok=True)
    write_csv(RESULTS / "coreset_quality.csv", rows)
    columns = [(layer, ratio) for layer in args.layers for ratio in args.ratios]
    lines = [
        f"# Relative attention error before/after the cost changes (SmolLM2-135M, 1 prose prompt × {args.tokens} tokens, "
        f"sink {args.sink} + last {args.window} exact, mean ± std over {args.seeds} seeds, {args.threads} thread(s), "
        f"{time.strftime('%Y-%m-%d', time.gmtime())})",
        "",
        "| configuration | " + " | ".join(f"layer {lay}, {1 - r:.0%} kept" for lay, r in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for label, *_ in CONFIGS:
        cells = {(r["layer"], r["ratio"]): r for r in rows if r["config"] == label}
        lines.append(f"| {label} | " + " | ".join(f"{cells[c]['error_mean']:.4f} ± {cells[c]['error_std']:.4f}" for c in columns) + " |")
    (RESULTS / "coreset_quality.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
