"""BalanceKV stream: two settings of the stream compared on real layers, paired by seed (`--compare`).

`--compare cascade_rounds` (default): `cascade_rounds=1` halves, at each reduction, every level
that is full at that moment once; a level that round fills waits for the next reduction.
`cascade_rounds=None` repeats rounds until no level holds t slots, as seed Alg. 4 does (both with
slack 0, the stream of that comparison). `--compare slack`: the default slack 0.5 (new slots wait in
the room the slack leaves within the pool's budget, a third of it, then all waiting halvings run
together) against slack 0 (one slot of room: a reduction at every token once a head's pool is
full). Both variants run on the same real layers of the default model (post-RoPE q/k/v captured on
prose), with the the BalanceKV paper's App. B.1 protocol (first `--sink` and last `--window` tokens
exact, the middle streamed in blocks of `--block` tokens within a budget of a share 1 − ratio, then
compacted), over the same seeds.

Reports, per (layer, ratio) and pooled: the relative attention error ‖z − Attn‖_F / ‖Attn‖_F of
the last `--window` queries for each variant (mean with a 95% t-interval over seeds), the mean
paired difference (first variant − second, same seed) with its 95% t-interval, and each variant's
streaming time, measured in the same process (min over seeds). Writes
benchmarks/results/balancekv_<compare>.{csv,md}.

    PYTHONPATH=. nice -n 10 python benchmarks/tuning/balancekv_cascade_rounds.py [--compare slack]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from scipy import stats

import kvcompress as kvc
from kvcompress.eval.capture import capture_qkv, prose_text
from kvcompress.eval.tables import write_csv

RESULTS = Path(__file__).parents[1] / "results"
# --compare: (title, {variant label: stream parameters}); the first variant is the one the paired difference starts from
COMPARISONS = {
    "cascade_rounds": ("cascade rounds per batch", {"one round per batch (default)": {"cascade_rounds": 1, "slack": 0.0},
                                                    "drain (seed Alg. 4)": {"cascade_rounds": None, "slack": 0.0}}),
    "slack": ("halvings waiting by a slack", {"slack 0.5 (default)": {"slack": 0.5}, "slack 0 (after every batch)": {"slack": 0.0}}),
}


def streamed_error(q, k, v, params, ratio, sink, window, block, seed) -> tuple[float, float]:
    """(relative error of the last `window` queries, seconds spent streaming and compacting) for one seed; params: stream parameters."""
    n = k.shape[2]
    targets = q[:, :, n - window :]
    exact = kvc.exact_attention(targets, k, v, causal_offset=n - window)
    budget = round((n - sink - window) * (1.0 - ratio))
    start_time = time.perf_counter()
    st = kvc.stream("balancekv", budget=budget, sink=sink, window=window, seed=seed, **params)
    for start in range(0, n, block):
        st.update(k[:, :, start : start + block], v[:, :, start : start + block])
    st.compact()
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
    names = list(errors)
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
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="cascade_rounds", help="which two streams (default cascade_rounds)")
    args = parser.parse_args()
    title, variants = COMPARISONS[args.compare]
    torch.set_num_threads(args.threads)
    model, tokenizer = kvc.load_model()
    captured = capture_qkv(model, tokenizer, prose_text(8 * args.tokens, seed=0), layers=args.layers, max_tokens=args.tokens)
    rows, pooled_errors, pooled_seconds = [], {name: [] for name in variants}, {name: [] for name in variants}
    for layer in args.layers:
        q, k, v = (t.float() for t in captured[layer])
        for ratio in args.ratios:
            errors, seconds = {name: [] for name in variants}, {name: [] for name in variants}
            for seed in range(args.seeds):
                for name, params in variants.items():
                    error, spent = streamed_error(q, k, v, params, ratio, args.sink, args.window, args.block, seed)
                    errors[name].append(error)
                    seconds[name].append(spent)
            for name in variants:
                pooled_errors[name] += errors[name]
                pooled_seconds[name] += seconds[name]
            rows.append(summarise(f"layer {layer}, {1 - ratio:.0%} kept", errors, seconds))
            print(rows[-1], flush=True)
    rows.append(summarise("pooled", pooled_errors, pooled_seconds))
    RESULTS.mkdir(exist_ok=True)
    write_csv(RESULTS / f"balancekv_{args.compare}.csv", rows)
    names = list(variants)
    lines = [
        f"# BalanceKV stream, {title} (SmolLM2-135M, 1 prose prompt × {args.tokens} tokens, sink {args.sink} + "
        f"last {args.window} exact, blocks of {args.block}, {args.seeds} seeds per cell, {args.threads} thread(s), "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}; shared 2-core machine, times are min over seeds in one process)",
        "",
        f"Command: `PYTHONPATH=. python benchmarks/tuning/balancekv_cascade_rounds.py {' '.join(sys.argv[1:])}`.",
        "",
        f"| cell | n | {names[0]}: error ± 95% CI | {names[1]}: error ± 95% CI | paired difference ± 95% CI | time ratio first/second |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['cell']} | {r['samples']} | {r[names[0] + ' error']:.4f} ± {r[names[0] + ' error ci95']:.4f} | "
            f"{r[names[1] + ' error']:.4f} ± {r[names[1] + ' error ci95']:.4f} | {r['paired difference']:+.4f} ± {r['paired difference ci95']:.4f} | "
            f"{r[names[0] + ' min seconds'] / r[names[1] + ' min seconds']:.2f} |"
        )
    (RESULTS / f"balancekv_{args.compare}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
