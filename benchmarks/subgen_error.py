"""SubGen estimate error against s (‖v‖² samples) and the budget on clusterable keys.

Synthetic layer: keys drawn around `clusters` centres (the seed's (m, δ)-clusterable setting),
Gaussian values, random queries. For every (s, budget) the SubGen summary of the whole stream (no
sink, no window; the uniform normalizer samples take budget − s − max_clusters slots) is built
for several seeds and compared with exact attention:
- rel_err      ‖z − Attn‖_F / ‖Attn‖_F (the project's attention-approximation metric),
- seed_err     max over queries of ‖z − Attn‖₂ / (‖softmax‖₂ ‖V‖_op) (the seed's Eq. 3 scale),
- den_err      mean |τ / Σ exp(s<q,k>) − 1| (the partition-function estimate of the summary's slots).
Writes benchmarks/results/subgen_error.{csv,md,png}.

    python benchmarks/subgen_error.py [--n 4096] [--seeds 5]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import kvcompress as kvc  # noqa: E402
from kvcompress.eval.tables import write_csv

RESULTS = Path(__file__).parent / "results"


def clusterable_layer(n: int, d: int, heads: int, clusters: int, spread: float, queries: int, seed: int):
    """keys/values [1, heads, n, d] with keys around `clusters` centres, queries [1, heads, queries, d]."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(heads, clusters, d, generator=g)
    labels = torch.randint(0, clusters, (heads, n), generator=g)
    keys = centres.gather(1, labels[..., None].expand(-1, -1, d)) + spread * torch.randn(heads, n, d, generator=g) / math.sqrt(d)
    values = torch.randn(1, heads, n, d, generator=g)
    q = 2.0 * torch.randn(1, heads, queries, d, generator=g)
    return keys[None], values, q


def errors(keys, values, q, summary) -> tuple[float, float, float]:
    scale = 1.0 / math.sqrt(keys.shape[-1])
    exact = kvc.exact_attention(q, keys, values)
    approx = kvc.weighted_attention(q, summary)
    rel = kvc.relative_error(approx, exact)
    logits = torch.einsum("bhqd,bhnd->bhqn", q.double(), keys.double()) * scale
    softmax_norm = logits.softmax(-1).norm(dim=-1)
    v_op = torch.linalg.matrix_norm(values.double(), ord=2)[..., None]
    seed_err = float(((approx.double() - exact.double()).norm(dim=-1) / (softmax_norm * v_op)).max())
    den = summary.denominator()
    est = (torch.einsum("bhqd,bhnd->bhqn", q.double(), den.keys.double()) * scale + den.log_weights.double()[:, :, None]).logsumexp(-1)
    den_err = float((est - logits.logsumexp(-1)).exp().sub(1).abs().mean())
    return rel, seed_err, den_err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096, help="stream length")
    parser.add_argument("--d", type=int, default=64, help="head dim")
    parser.add_argument("--clusters", type=int, default=16, help="true key clusters m")
    parser.add_argument("--spread", type=float, default=0.5, help="within-cluster noise (relative to centre scale)")
    parser.add_argument("--delta", type=float, default=3.0, help="SubGen clustering radius δ")
    parser.add_argument("--max-clusters", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--s", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--budget", type=int, nargs="+", default=[128, 256, 512, 1024])
    args = parser.parse_args()
    torch.set_num_threads(1)
    keys, values, q = clusterable_layer(args.n, args.d, 2, args.clusters, args.spread, 32, seed=0)
    rows = []
    for budget in args.budget:
        for s in args.s:
            runs, clusters = [], []
            for seed in range(args.seeds):
                st = kvc.stream("subgen", budget=budget, sink=0, window=0, seed=seed,
                                s=s, delta=args.delta, max_clusters=args.max_clusters)
                for start in range(0, args.n, 256):
                    st.update(keys[:, :, start : start + 256], values[:, :, start : start + 256])
                runs.append(errors(keys, values, q, st.summary()))
                clusters.append(int(st.state.num_clusters.max()))
            stats = torch.tensor(runs, dtype=torch.float64)
            mean, std = stats.mean(0), stats.std(0)
            rows.append({
                "s": s, "budget": budget, "clusters": max(clusters),
                "rel_err": mean[0].item(), "rel_err_std": std[0].item(),
                "seed_err": mean[1].item(), "seed_err_std": std[1].item(),
                "den_err": mean[2].item(), "den_err_std": std[2].item(),
            })
            print(f"budget={budget:5d} s={s:5d} m={max(clusters):3d} rel_err={mean[0]:.3f}±{std[0]:.3f} "
                  f"seed_err={mean[1]:.4f}±{std[1]:.4f} den_err={mean[2]:.4f}±{std[2]:.4f}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    write_csv(RESULTS / "subgen_error.csv", rows)
    write_markdown(rows, args)
    plot(rows, args)


def write_markdown(rows, args) -> None:
    lines = [
        f"# SubGen error vs (budget, s): n={args.n}, d={args.d}, {args.clusters} true clusters, δ={args.delta}, "
        f"max_clusters={args.max_clusters}, mean ± std over {args.seeds} seeds",
        "",
        "| budget \\ s | " + " | ".join(str(s) for s in args.s) + " |",
        "|---|" + "---|" * len(args.s),
    ]
    for metric, label in (("rel_err", "‖z−Attn‖/‖Attn‖"), ("seed_err", "seed Eq. 3 ε"), ("den_err", "mean abs(τ/Z − 1)")):
        lines.append(f"| **{label}** |" + " |" * len(args.s))
        for budget in args.budget:
            cells = [f"{r[metric]:.3g} ± {r[metric + '_std']:.2g}" for s in args.s for r in rows if r["s"] == s and r["budget"] == budget]
            lines.append(f"| budget={budget} | " + " | ".join(cells) + " |")
    (RESULTS / "subgen_error.md").write_text("\n".join(lines) + "\n")


def plot(rows, args) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for s in args.s:
        sel = [r for r in rows if r["s"] == s]
        axes[0].errorbar([r["budget"] for r in sel], [r["rel_err"] for r in sel], [r["rel_err_std"] for r in sel], label=f"s={s}", marker="o")
        axes[1].errorbar([r["budget"] for r in sel], [r["den_err"] for r in sel], [r["den_err_std"] for r in sel], label=f"s={s}", marker="o")
    axes[0].set(xscale="log", yscale="log", xlabel="budget (slots per head)", ylabel="‖z − Attn‖ / ‖Attn‖", title="attention estimate")
    axes[1].set(xscale="log", yscale="log", xlabel="budget (slots per head)", ylabel="|τ / Z − 1|", title="softmax normalizer")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "subgen_error.png", dpi=120)


if __name__ == "__main__":
    main()
