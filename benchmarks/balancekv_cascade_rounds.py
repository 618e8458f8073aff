"""BalanceKV stream: one cascade round per batch (the default) against draining every level (seed Alg. 4).

`cascade_rounds=1` halves, after each batch of t tokens, every level that is full at that moment
once; a level that round fills waits for the next batch. `cascade_rounds=None` repeats rounds
until no level holds t slots, as seed Alg. 4 does. Both run on the same real layers of the
default model (post-RoPE q/k/v captured on prose), with the seed 000 App. B.1 protocol (first
`--sink` and last `--window` tokens exact, the middle streamed in blocks of `--block` tokens and
compressed to a share 1 − ratio), over the same seeds.

Reports, per (layer, ratio) and pooled: the relative attention error ‖z − Attn‖_F / ‖Attn‖_F of
the last `--window` queries for each variant (mean with a 95% t-interval over seeds), the mean
paired difference (one rounds − drain, same seed) with its 95% t-interval, and each variant's
streaming time, measured in the same process (min over seeds). Writes
benchmarks/results/balancekv_cascade_rounds.{csv,md}.

    PYTHONPATH=. nice -n 10 python benchmarks/balancekv_cascade_rounds.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from scipy import stats

import kvcompress as kvc
from kvcompress.eval.capture import capture_qkv, prose_text
from kvcompress.eval.tables import write_csv

RESULTS = Path(__file__).parent / "results"
VARIANTS = {"one round per batch (default)": 1, "drain (seed Alg. 4)": None}


def streamed_error(q, k, v, rounds, ratio, sink, window, block, seed) -> tuple[float, float]:
    """(relative error of the last `window` queries, seconds spent streaming) for one seed."""
    n = k.shape[2]
    targets = q[:, :, n - window :]
    exact = kvc.exact_attention(targets, k, v, causal_offset=n - window)
    budget = round((n - sink - window) * (1.0 - ratio))
    start_time = time.perf_counter()
    st = kvc.stream("balancekv", budget=budget, sink=sink, window=window, seed=seed, cascade_rounds=rounds)
    for start in range(0, n, block):
        st.update(k[:, :, start : start + block], v[:, :, start : start + block])
    summary = st.summary()
    seconds = time.perf_counter() - start_time
    approx = kvc.weighted_attention(targets, summary, query_positions=torch.arange(n - window, n))
    return kvc.relative_error(approx, exact), seconds


def mean_interval(xs: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% t-interval)."""
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return mean, float("nan")
    return mean, float(stats.t.ppf(0.975, len(xs) - 1)) * statistics.stdev(xs) / len(xs) ** 0.5


def summarise(label: str, errors: dict[str, list[float]], seconds: dict[str, list[float]]) -> dict:
    names = list(VARIANTS)
    row = {"cell": label, "samples": len(errors[names[0]])}
    for name in names:
        row[f"{name} error"], row[f"{name} error ci95"] = mean_interval(errors[name])
        row[f"{name} min seconds"] = min(seconds[name])
    diff = [a - b for a, b in zip(errors[names[0]], errors[names[1]])]
    row["paired difference"], row["paired difference ci95"] = mean_interval(diff)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in {"tokens": 2048, "seeds": 8, "sink": 256, "window": 256, "block": 128, "threads": 1}.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 5, 15], help="layers captured (default 1 2 5 15)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75], help="fractions of the middle removed (default 0.5 0.75)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvc.load_model()
    captured = capture_qkv(model, tokenizer, prose_text(8 * args.tokens, seed=0), layers=args.layers, max_tokens=args.tokens)
    rows, pooled_errors, pooled_seconds = [], {name: [] for name in VARIANTS}, {name: [] for name in VARIANTS}
    for layer in args.layers:
        q, k, v = (t.float() for t in captured[layer])
        for ratio in args.ratios:
            errors, seconds = {name: [] for name in VARIANTS}, {name: [] for name in VARIANTS}
            for seed in range(args.seeds):
                for name, rounds in VARIANTS.items():
                    error, spent = streamed_error(q, k, v, rounds, ratio, args.sink, args.window, args.block, seed)
                    errors[name].append(error)
                    seconds[name].append(spent)
            for name in VARIANTS:
                pooled_errors[name] += errors[name]
                pooled_seconds[name] += seconds[name]
            rows.append(summarise(f"layer {layer}, {1 - ratio:.0%} kept", errors, seconds))
            print(rows[-1], flush=True)
    rows.append(summarise("pooled", pooled_errors, pooled_seconds))
    RESULTS.mkdir(exist_ok=True)
    write_csv(RESULTS / "balancekv_cascade_rounds.csv", rows)
    names = list(VARIANTS)
    lines = [
        f"# BalanceKV stream, cascade rounds per batch (SmolLM2-135M, 1 prose prompt × {args.tokens} tokens, sink {args.sink} + "
        f"last {args.window} exact, blocks of {args.block}, {args.seeds} seeds per cell, {args.threads} thread(s), "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}; shared 2-core machine, times are min over seeds in one process)",
        "",
        f"| cell | n | {names[0]}: error ± 95% CI | {names[1]}: error ± 95% CI | paired difference ± 95% CI | time ratio one/drain |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['cell']} | {r['samples']} | {r[names[0] + ' error']:.4f} ± {r[names[0] + ' error ci95']:.4f} | "
            f"{r[names[1] + ' error']:.4f} ± {r[names[1] + ' error ci95']:.4f} | {r['paired difference']:+.4f} ± {r['paired difference ci95']:.4f} | "
            f"{r[names[0] + ' min seconds'] / r[names[1] + ' min seconds']:.2f} |"
        )
    (RESULTS / "balancekv_cascade_rounds.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
