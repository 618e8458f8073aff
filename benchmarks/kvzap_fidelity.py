"""KVzap's fidelity on held-out text: Spearman correlation per layer between the shipped surrogate's predicted scores and
the project's exact KVzip scores, on contexts of standard-library docstrings no training, tuning or choice used
(`eval.capture.HELDOUT_MODULES`, minus any paragraph the training or tuning text also has).

Writes one row per layer (mean over KV heads, and the lowest head) to OUT as CSV, with the contexts, machine and date:

    .venv/bin/python benchmarks/kvzap_fidelity.py --contexts 2 --tokens 2048 --threads 2 --out benchmarks/results/kvzap_fidelity.csv
"""

from __future__ import annotations

import argparse
import csv
import platform
import time
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.eval.capture import DOCSTRING_MODULES, HELDOUT_MODULES, SCORER_TRAINING_MODULES, docstring_paragraphs
from kvcompress.integration.scorer_training import fidelity, scoring_pairs, text_contexts
from kvcompress.methods.kvzap import load_surrogate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--scorer", default="default")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvc.load_model()
    used = set(docstring_paragraphs(DOCSTRING_MODULES)) | set(docstring_paragraphs(SCORER_TRAINING_MODULES))
    text = [p for p in docstring_paragraphs(HELDOUT_MODULES) if p not in used]
    contexts = text_contexts(tokenizer, text, args.tokens, args.contexts, seed=0)
    pairs = scoring_pairs(model, tokenizer, contexts)
    surrogate = load_surrogate(args.scorer)
    rows = []
    for layer, per_head in fidelity(surrogate, pairs).items():
        rows.append({"layer": layer, "spearman_mean": round(sum(per_head) / len(per_head), 4), "spearman_min_head": round(min(per_head), 4),
                     "tokens": int(pairs.hidden[layer].shape[0]), "contexts": len(contexts), "scorer": args.scorer, "kind": surrogate.kind,
                     "threads": args.threads, "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                     "date": time.strftime("%Y-%m-%d")})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    means = [r["spearman_mean"] for r in rows]
    print(f"{len(rows)} layers, {rows[0]['tokens']} held-out tokens: Spearman mean {sum(means) / len(means):.3f}, lowest layer {min(means):.3f}")


if __name__ == "__main__":
    main()
