"""Compactor vs SnapKV / Knorm / random, query-agnostic, plus the seed's Table 2 ablation, on the default model.

Offline needle tasks (`kvcompress.eval.tasks`); the context is compressed in prefill mode and the
question appended exactly afterwards (query-agnostic: no method sees the question). For every
(sample, variant, fraction kept) we record the task score of the greedy answer and the NLL ratio
NLL(answer | full) / NLL(answer | compressed) (1 = no loss). One shared prefill per sample serves
every variant (`eval.prefill_replay`). The same run measures sketched vs exact leverage of the
real pre-RoPE keys (Spearman, top-k overlap) per layer and head.

    python benchmarks/compactor_ablation.py --tokens 1024 --samples 3

The four main variants (Compactor, SnapKV, Knorm, random) are also scored on their greedy answer;
the Table-2 ablation variants get a greedy answer too only with --ablation-answers (otherwise
only their NLL ratio is measured: each answer costs a full decode). With --part NAME a run writes
compactor_ablation_part_NAME.csv (and the agreement rows) so several processes can split the
tasks; --report-only merges every part into benchmarks/results/compactor_ablation.{csv,md,png}
and compactor_ablation_leverage.csv. --name replaces the stem "compactor_ablation" (a separate run).
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch
from scipy.stats import spearmanr

import kvcompress as kvc
from kvcompress.integration.calibrate_model import answer_nll, encode_sample
from kvcompress.eval import tasks
from kvcompress.eval.prefill_replay import SharedPrefill
from kvcompress.methods.base import make_generator
from kvcompress.methods.compactor import exact_leverage, leverage_scores
from kvcompress.eval.tables import write_csv

RESULTS = Path(__file__).parent / "results"
MAIN = ("compactor", "snapkv", "knorm", "random")
VARIANTS = [
    ("compactor", "compactor", {}),
    ("snapkv", "snapkv", {}),
    ("knorm", "knorm", {}),
    ("random", "random", {}),
    ("compactor: no a", "compactor", {"attention": False}),
    ("compactor: exact leverage", "compactor", {"leverage": "exact"}),
    ("compactor: lambda=0.15", "compactor", {"leverage_weight": 0.15}),
    ("compactor: lambda=0.4", "compactor", {"leverage_weight": 0.4}),
]


def leverage_agreement(shared: SharedPrefill, sample_id: int) -> list[dict]:
    rows = []
    for layer in sorted(shared.captured):
        pre = shared.pre_rope_keys(layer)
        exact = exact_leverage(pre)[0]
        approx = leverage_scores(pre, "sketch", "gaussian", 64, make_generator(layer))[0]
        for h in range(pre.shape[1]):
            row = {"sample": sample_id, "layer": layer, "head": h, "spearman": spearmanr(exact[h], approx[h]).statistic}
            for frac in (0.25, 0.5):
                k = int(frac * pre.shape[2])
                common = set(exact[h].topk(k).indices.tolist()) & set(approx[h].topk(k).indices.tolist())
                row[f"top{int(frac * 100)}_overlap"] = len(common) / k
            rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512, help="context length target (tokens)")
    p.add_argument("--samples", type=int, default=3, help="samples per task")
    p.add_argument("--tasks", default="niah_single,niah_multikey,niah_multivalue")
    p.add_argument("--kept", default="0.5,0.25", help="fractions of the context kept")
    p.add_argument("--max-new-tokens", type=int, default=32, help="room for the model's full-sentence answers")
    p.add_argument("--ablation-answers", action="store_true", help="also decode (and score) the ablation variants")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--part", default=None, help="write a partial CSV under this name (merged by --report-only)")
    p.add_argument("--report-only", action="store_true", help="merge the part CSVs and write the summary")
    p.add_argument("--name", default="compactor_ablation", help="stem of the result files")
    args = p.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    kept = [float(x) for x in args.kept.split(",")]
    if args.report_only:
        rows, agreement = merge_parts(args.name)
        write_summary(rows, agreement, kept, args)
        return
    torch.set_num_threads(args.threads)
    model, tok = kvc.load_model()
    rows, agreement = [], []
    suffix = f"_part_{args.part}" if args.part else ""
    out_csv = RESULTS / f"{args.name}{suffix}.csv"
    samples = [(task, seed) for task in args.tasks.split(",") for seed in range(args.first_seed, args.first_seed + args.samples)]
    for sample_id, (task, seed) in enumerate(samples):
        sample = tasks.generate_sample(task, target_tokens=args.tokens, seed=seed, tokenizer=tok)
        context_ids, continuation_ids, answer_len = encode_sample(tok, sample.context, sample.question, ", ".join(sample.answers))
        question_ids = continuation_ids[:, : continuation_ids.shape[1] - answer_len]
        t0 = time.time()
        shared = SharedPrefill(model, context_ids)
        agreement += leverage_agreement(shared, sample_id)
        nll_full = answer_nll(model, shared.cache(None), continuation_ids, answer_len)
        full_text = tok.decode(shared.answer_ids(question_ids, None, max_new_tokens=args.max_new_tokens), skip_special_tokens=True)
        rows.append({"task": task, "seed": seed, "variant": "full", "kept": 1.0, "score": tasks.score(sample, full_text),
                     "nll_ratio": 1.0, "answer": full_text.strip()})
        for name, method, params in VARIANTS:
            for frac in kept:
                nll = answer_nll(model, shared.cache(method, 1.0 - frac, **params), continuation_ids, answer_len)
                text, score = None, None
                if name in MAIN or args.ablation_answers:
                    text = tok.decode(shared.answer_ids(question_ids, method, 1.0 - frac, args.max_new_tokens, **params), skip_special_tokens=True)
                    score = tasks.score(sample, text)
                rows.append({"task": task, "seed": seed, "variant": name, "kept": frac, "score": score,
                             "nll_ratio": nll_full / nll, "answer": text.strip() if text is not None else ""})
        print(f"{task} seed {seed}: {context_ids.shape[1]} tokens, {time.time() - t0:.0f}s, full: {full_text.strip()!r}", flush=True)
        write_csv(out_csv, rows)
        write_csv(RESULTS / f"{args.name}_leverage{suffix}.csv", agreement)
    if not args.part:
        write_summary(rows, agreement, kept, args)


def merge_parts(name: str) -> tuple[list[dict], list[dict]]:
    """Rows of every part CSV (numbers parsed; empty score = not decoded), also written as the merged CSVs."""
    merged = {}
    for stem in (name, f"{name}_leverage"):
        rows = []
        for path in sorted(RESULTS.glob(f"{stem}_part_*.csv")):
            with path.open(encoding="utf-8") as f:
                rows += list(csv.DictReader(f))
        write_csv(RESULTS / f"{stem}.csv", rows)
        merged[stem] = [{k: _number(v) for k, v in r.items()} for r in rows]
    return merged[name], merged[f"{name}_leverage"]


def _number(v: str):
    if v == "":
        return None
    try:
        return float(v)
    except ValueError:
        return v


def write_summary(rows, agreement, kept, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["full"] + [v[0] for v in VARIANTS]
    full_rows = [r for r in rows if r["variant"] == "full"]
    tasks_run = sorted({r["task"] for r in full_rows})
    lines = [
        f"# Compactor, query-agnostic, SmolLM2-135M-Instruct ({', '.join(tasks_run)}; ~{args.tokens} tokens; {len(full_rows)} samples)",
        "",
        "Score = task score of the greedy answer (mean over samples; '-' = not decoded, NLL only); "
        "NLL ratio = NLL(answer | full) / NLL(answer | compressed), mean over samples (1 = no loss).",
        "",
        "| variant | " + " | ".join(f"score @{int(k * 100)}% kept | NLL ratio @{int(k * 100)}%" for k in kept) + " |",
        "|---|" + "---|---|" * len(kept),
    ]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in names:
        cells, ys = [], []
        for k in kept:
            sel = [r for r in rows if r["variant"] == name and (name == "full" or r["kept"] == k)]
            scored = [r["score"] for r in sel if r["score"] is not None]
            ratio = sum(r["nll_ratio"] for r in sel) / len(sel)
            cells.append(f"{sum(scored) / len(scored):.2f} | {ratio:.3f}" if scored else f"- | {ratio:.3f}")
            ys.append(ratio)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        ax.plot([int(k * 100) for k in kept], ys, marker="o", label=name, linestyle="--" if name.startswith("compactor:") else "-")
    rho = torch.tensor([a["spearman"] for a in agreement])
    ov25 = torch.tensor([a["top25_overlap"] for a in agreement])
    ov50 = torch.tensor([a["top50_overlap"] for a in agreement])
    lines += [
        "",
        f"Sketched (Gaussian, k=64) vs exact leverage of the real pre-RoPE keys, over {len(agreement)} (sample, layer, head):",
        f"Spearman median {rho.median():.3f}, min {rho.min():.3f}; top-25% overlap mean {ov25.mean():.3f}; top-50% overlap mean {ov50.mean():.3f}.",
        f"Heads with Spearman < 0.8: {int((rho < 0.8).sum())} of {len(agreement)}, in layers {sorted({int(a['layer']) for a in agreement if a['spearman'] < 0.8})}; "
        f"without layer 0: min {min((a['spearman'] for a in agreement if a['layer'] != 0), default=float('nan')):.3f}.",
    ]
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    ax.set_xlabel("% of context kept")
    ax.set_ylabel("mean NLL ratio (1 = no loss)")
    ax.set_title("query-agnostic needle tasks, SmolLM2-135M")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.name}.png", dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
