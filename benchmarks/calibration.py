"""Context-calibrated compression on the default model: fit on offline tasks, check r* on held-out contexts.

Fit: (retention, NLL(c), NLL ratio of the known answer) triples from training samples of the
offline tasks (`kvcompress.integration.calibrate.make_triples`, query-agnostic prefill compression), fitted
with the asymmetric loss. Held-out: samples with other seeds; for each, NLL(c) gives r* for the
quality budget gamma, the context is compressed at r*, and the measured NLL ratio is compared
with gamma.

    python benchmarks/calibration.py --method compactor --tokens 384 --train 2 --heldout 2

Writes benchmarks/results/calibration_<method>[_<tag>].{csv,md,png,json} (json: the fitted
calibration; csv: training triples and held-out rows). --triples-from reuses the training triples
of an earlier run's CSV (e.g. to refit with another --asymmetry) instead of measuring them again.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress import calibration as cal
from kvcompress.eval.calibration_samples import offline_samples
from kvcompress.integration.calibrate import encode_sample, make_triples

RESULTS = Path(__file__).parent / "results"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="compactor")
    p.add_argument("--tasks", default="niah_single,niah_multikey,variable_tracking,common_words")
    p.add_argument("--tokens", type=int, default=384)
    p.add_argument("--train", type=int, default=2, help="training samples per task")
    p.add_argument("--heldout", type=int, default=2, help="held-out samples per task (other seeds)")
    p.add_argument("--retentions", default="0.1,0.25,0.5,0.75,0.9")
    p.add_argument("--quality", type=float, default=0.95)
    p.add_argument("--asymmetry", type=float, default=4.0)
    p.add_argument("--triples-from", type=Path, default=None, help="reuse the training triples of this calibration CSV")
    p.add_argument("--tag", default=None, help="suffix of the output files")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / (f"calibration_{args.method}_{args.tag}" if args.tag else f"calibration_{args.method}")
    model, tok = kvc.load_model()
    task_names = args.tasks.split(",")
    retentions = [float(x) for x in args.retentions.split(",")]
    log = lambda t: print(f"  {t['task']} #{t['sample']} r={t['retention']:.2f} NLL(c)={t['nll_context']:.3f} ratio={t['nll_ratio']:.3f}", flush=True)

    if args.triples_from is not None:
        triples = read_triples(args.triples_from)
    else:
        train = offline_samples(tok, task_names, args.train, args.tokens, first_seed=0)
        triples = make_triples(model, tok, train, args.method, retentions, progress=log)
    calibration = cal.fit(triples, args.method, args.asymmetry, model="SmolLM2-135M-Instruct")
    calibration.save(stem.with_suffix(".json"))
    print(f"fit: alpha={calibration.alpha:.4f} beta={calibration.beta:.4f} loss={calibration.loss:.4g}", flush=True)

    heldout = offline_samples(tok, task_names, args.heldout, args.tokens, first_seed=1000)
    rows = []
    for i, sample in enumerate(heldout):
        context_ids, _, _ = encode_sample(tok, sample["context"], sample["question"], sample["answer"])
        r_star = calibration.retention(cal.context_nll(model, context_ids), args.quality)
        measured = make_triples(model, tok, [sample], args.method, [r_star])[0]
        rows.append({**measured, "sample": i, "task": sample["task"], "r_star": r_star, "meets": measured["nll_ratio"] >= args.quality})
        print(f"held-out {sample['task']} #{i}: r*={r_star:.3f} measured ratio={measured['nll_ratio']:.3f}", flush=True)

    with stem.with_suffix(".csv").open("w", newline="") as f:
        fields = ["split", "task", "sample", "retention", "nll_context", "nll_full", "nll_compressed", "nll_ratio", "r_star", "meets"]
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows([{**t, "split": "train"} for t in triples] + [{**r, "split": "heldout"} for r in rows])
    write_report(stem, calibration, triples, rows, args)


def read_triples(path: Path) -> list[dict]:
    """The training rows of an earlier run's CSV, numbers parsed."""
    with path.open() as f:
        rows = [r for r in csv.DictReader(f) if r["split"] == "train"]
    numeric = ("retention", "nll_context", "nll_full", "nll_compressed", "nll_ratio")
    return [{**r, **{k: float(r[k]) for k in numeric}, "sample": int(r["sample"])} for r in rows]


def write_report(stem, calibration, triples, rows, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    met = sum(r["meets"] for r in rows)
    lines = [
        f"# Context-calibrated compression: {args.method} on SmolLM2-135M-Instruct (~{args.tokens}-token contexts)",
        "",
        f"Fit on {len(triples)} training triples ({args.tasks}, {args.train} samples/task, retentions {args.retentions}), "
        f"asymmetry {args.asymmetry}" + (f" (triples reused from {args.triples_from.name})" if args.triples_from else "") + f": alpha = {calibration.alpha:.4f}, beta = {calibration.beta:.4f}, loss {calibration.loss:.4g}.",
        "",
        f"Held-out contexts (other seeds), quality budget gamma = {args.quality}: measured NLL ratio >= gamma on **{met} of {len(rows)}**.",
        "",
        "| task | NLL(c) | kappa | r* (kept) | measured NLL ratio at r* | meets gamma |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['nll_context']:.3f} | {calibration.kappa(r['nll_context']):.2f} | {r['r_star']:.3f} | "
            f"{r['nll_ratio']:.3f} | {'yes' if r['meets'] else 'no'} |"
        )
    mean_r = sum(r["r_star"] for r in rows) / len(rows)
    lines += ["", f"Mean r* on held-out contexts: {mean_r:.3f} (KV kept); mean compression {1 - mean_r:.1%}."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    nlls = torch.tensor([t["nll_context"] for t in triples])
    sc = ax.scatter([t["retention"] for t in triples], [t["nll_ratio"] for t in triples], c=nlls, cmap="viridis", s=18, label="training triples")
    grid = torch.linspace(0, 1, 101)
    cmap = plt.get_cmap("viridis")
    lo, hi = float(nlls.min()), float(nlls.max())
    for q in (0.0, 0.5, 1.0):
        nll = lo + q * (hi - lo)
        ax.plot(grid, calibration.predict(grid, nll), color=cmap(q), label=f"fit, NLL(c)={nll:.2f}")
    ax.scatter([r["r_star"] for r in rows], [r["nll_ratio"] for r in rows], marker="x", color="red", label="held-out at r*")
    ax.axhline(args.quality, color="gray", linestyle=":", label=f"gamma={args.quality}")
    ax.set_xlabel("retention r (fraction of context kept)")
    ax.set_ylabel("NLL(answer | full) / NLL(answer | compressed)")
    ax.set_title(f"context calibration: {args.method}")
    fig.colorbar(sc, label="NLL(c)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
