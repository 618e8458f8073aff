"""BalanceKV vs uniform sampling: relative attention error on real layers (the BalanceKV paper, Fig. 1, App. B.1).

Captures post-RoPE q/k/v of layers 1, 2 and 5 of the default model on real prose
(`kvcompress.eval.capture`), keeps the first `--sink` tokens and the last `--window` tokens exact
(the window holds the queries: query j sees window tokens <= j), compresses the middle by 2^-T
and reports ‖z − Attn‖_F / ‖Attn‖_F over the last `--window` queries, all heads, as in the seed.
"balancekv" is the plain variant of the seed's single-layer protocol (augment 0); "balancekv
(augmented)" is the library default (Sec. 4.3's augmented variant). Uniform sampling is the
foundation's `random` with weighted=True (each kept slot weighs middle/budget: the seed's
independent uniform sampling of a 2^-T fraction). Every method runs with
`--seeds` seeds; a seed's error is the mean over the prompts; the table gives mean ± std over seeds.

Writes benchmarks/results/balancekv_attention_error.{csv,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.eval.capture import capture_qkv, prose_text
from kvcompress.eval.tables import write_csv

RESULTS = Path(__file__).parent / "results"
METHODS = {
    "balancekv": ("balancekv", {"augment": 0.0}),
    "balancekv (augmented)": ("balancekv", {}),
    "balancekv (unweighted)": ("balancekv", {"weighted": False, "augment": 0.0}),
    "uniform": ("random", {"weighted": True}),
}


def errors(captured, layer, ratio, seeds, sink, window):
    """{method label: [error per seed]} for one layer and compression ratio (fraction of the middle removed)."""
    out = {label: [] for label in METHODS}
    for seed in range(seeds):
        per_prompt = {label: [] for label in METHODS}
        for layers in captured:
            q, k, v = (t.float() for t in layers[layer])
            n = k.shape[2]
            targets = q[:, :, n - window :]
            exact = kvc.exact_attention(targets, k, v, causal_offset=n - window)
            budget = round((n - sink - window) * (1.0 - ratio))
            for label, (method, params) in METHODS.items():
                summary = kvc.compress(method, k, v, budget=budget, sink=sink, window=window, seed=seed, **params)
                approx = kvc.weighted_attention(targets, summary, query_positions=torch.arange(n - window, n))
                per_prompt[label].append(kvc.relative_error(approx, exact))
        for label, errs in per_prompt.items():
            out[label].append(statistics.fmean(errs))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--sink", type=int, default=256)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 5])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75, 0.875])
    args = parser.parse_args()
    torch.set_num_threads(1)

    model, tokenizer = kvc.load_model()
    captured = [
        capture_qkv(model, tokenizer, prose_text(8 * args.tokens, seed=p), layers=args.layers, max_tokens=args.tokens)
        for p in range(args.prompts)
    ]
    rows = []
    for layer in args.layers:
        for ratio in args.ratios:
            for label, errs in errors(captured, layer, ratio, args.seeds, args.sink, args.window).items():
                rows.append({"layer": layer, "rate": 1.0 - ratio, "method": label, "seeds": args.seeds,
                             "prompts": args.prompts, "tokens": args.tokens,
                             "error_mean": statistics.fmean(errs), "error_std": statistics.stdev(errs)})
                print(rows[-1], flush=True)

    RESULTS.mkdir(exist_ok=True)
    write_csv(RESULTS / "balancekv_attention_error.csv", rows)
    lines = [
        f"# BalanceKV vs uniform: relative attention error (SmolLM2-135M, {args.prompts} prose prompts × {args.tokens} tokens, "
        f"sink {args.sink} + last {args.window} exact, mean ± std over {args.seeds} seeds)",
        "",
        "| layer | rate | " + " | ".join(METHODS) + " | BalanceKV < uniform |",
        "|---|---|" + "---|" * len(METHODS) + "---|",
    ]
    for layer in args.layers:
        for ratio in args.ratios:
            cell = {r["method"]: r for r in rows if r["layer"] == layer and r["rate"] == 1.0 - ratio}
            text = " | ".join(f"{cell[m]['error_mean']:.4f} ± {cell[m]['error_std']:.4f}" for m in METHODS)
            better = cell["balancekv"]["error_mean"] < cell["uniform"]["error_mean"]
            lines.append(f"| {layer} | 1/{round(1 / (1.0 - ratio))} | {text} | {'yes' if better else 'no'} |")
    (RESULTS / "balancekv_attention_error.md").write_text("\n".join(lines) + "\n", encoding="utf-8")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.layers), figsize=(4 * len(args.layers), 3.2), squeeze=False)
    for ax, layer in zip(axes[0], args.layers):
        for label in METHODS:
            pts = [r for r in rows if r["layer"] == layer and r["method"] == label]
            ax.errorbar([f"1/{round(1 / r['rate'])}" for r in pts], [r["error_mean"] for r in pts],
                        yerr=[r["error_std"] for r in pts], marker="o", capsize=3, label=label)
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("compression rate 2^-T")
        ax.set_ylabel("relative error")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "balancekv_attention_error.png", dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
