"""LongEval-style line retrieval (seed 001, Sec. 3.2, Table 1) on the default model, offline.

Each sample (`kvcompress.eval.tasks.line_retrieval`) is a list of numbered lines
"line {topic}: REGISTER_CONTENT is <n>" and asks for the number of one topic; a prediction is
correct when its first number matches (LongEval's scoring). The context is compressed once after
prefill (the seed applies its k-center once to the whole cache) with the same share of the cache
kept for every method (compression_ratio = 1 − kept), the question is appended exactly, greedy
decoding. Rows are appended to benchmarks/results/line_retrieval.csv as they finish (a rerun
skips rows already there); the accuracy table goes to line_retrieval.md and .png.

    python benchmarks/line_retrieval.py [--lengths 2048 4096] [--kept 0.5 0.35] [--samples 4]
"""

from __future__ import annotations

import argparse
import csv
import time
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import kvcompress as kvc  # noqa: E402
from kvcompress.eval.tasks import line_retrieval, score  # noqa: E402

RESULTS = Path(__file__).parent / "results"
CSV = RESULTS / "line_retrieval.csv"
FIELDS = ["length", "tokens", "kept", "method", "sample", "depth", "answer", "prediction", "correct",
          "kv_fraction", "prefill_s", "compress_s"]


def done_rows() -> list[dict]:
    if not CSV.exists():
        return []
    with open(CSV) as f:
        return list(csv.DictReader(f))


def run(args) -> None:
    torch.set_num_threads(args.threads)
    model, tokenizer = kvc.load_model()
    RESULTS.mkdir(exist_ok=True)
    seen = {(r["length"], r["kept"], r["method"], r["sample"]) for r in done_rows()}
    new_file = not CSV.exists()
    with open(CSV, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new_file:
            writer.writeheader()
        for i in range(args.samples):
            for length in args.lengths:
                depth = (i + 0.5) / args.samples
                sample = line_retrieval(target_tokens=length, depth=depth, seed=i, tokenizer=tokenizer)
                for kept in args.kept:
                    for method in args.methods:
                        key = (str(length), str(kept), method, str(i))
                        if key in seen:
                            continue
                        res = kvc.generate(
                            model, tokenizer, sample.context, sample.question, method=method,
                            compression_ratio=round(1.0 - kept, 6), max_new_tokens=args.max_new_tokens, progress=False,
                        )
                        row = {
                            "length": length, "tokens": res.context_tokens, "kept": kept, "method": method, "sample": i,
                            "depth": round(sample.depth, 3), "answer": sample.answers[0], "prediction": res.text.replace("\n", " "),
                            "correct": score(sample, res.text), "kv_fraction": round(res.kv_bytes / res.kv_bytes_full, 4),
                            "prefill_s": round(res.prefill_seconds, 2), "compress_s": round(res.compress_seconds, 2),
                        }
                        writer.writerow(row)
                        f.flush()
                        print(f"[{time.strftime('%H:%M:%S')}] {row}", flush=True)


def summarize() -> None:
    rows = done_rows()
    acc: dict[tuple, list[float]] = defaultdict(list)
    frac: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        key = (int(r["length"]), float(r["kept"]), r["method"])
        acc[key].append(float(r["correct"]))
        frac[key].append(float(r["kv_fraction"]))
    methods = sorted({k[2] for k in acc})
    settings = sorted({k[:2] for k in acc}, key=lambda k: (k[0], -k[1]))
    tokens = defaultdict(list)
    for r in rows:
        tokens[int(r["length"])].append(int(r["tokens"]))
    lines = [
        "# Line retrieval (LongEval-style), SmolLM2-135M-Instruct, prefill compression, greedy decoding",
        "",
        "accuracy (correct / samples); kv = stored KV bytes / full cache at the end of decoding",
        "",
        "| context (tokens) | cache kept | " + " | ".join(methods) + " |",
        "|---|---|" + "---|" * len(methods),
    ]
    for length, kept in settings:
        mean_tokens = sum(tokens[length]) / len(tokens[length])
        cells = []
        for m in methods:
            a = acc.get((length, kept, m))
            cells.append(f"{sum(a) / len(a):.2f} ({int(sum(a))}/{len(a)}, kv {sum(frac[(length, kept, m)]) / len(a):.2f})" if a else "-")
        lines.append(f"| {length} (~{mean_tokens:.0f}) | {kept:.0%} | " + " | ".join(cells) + " |")
    (RESULTS / "line_retrieval.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        vals = [sum(acc[(l, k, m)]) / len(acc[(l, k, m)]) if acc.get((l, k, m)) else 0.0 for l, k in settings]
        ax.bar([i + j * width for i in range(len(settings))], vals, width, label=m)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(settings))], [f"{l} tok, {k:.0%} kept" for l, k in settings])
    ax.set(ylabel="accuracy", ylim=(0, 1), title="line retrieval, SmolLM2-135M")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "line_retrieval.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096], help="target context tokens")
    parser.add_argument("--kept", type=float, nargs="+", default=[0.5, 0.35], help="share of the cache kept")
    parser.add_argument("--methods", nargs="+", default=["clustergen", "subgen", "streamingllm", "h2o"])
    parser.add_argument("--samples", type=int, default=4, help="questions per length (depths spread evenly)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--summarize-only", action="store_true", help="only rebuild the .md/.png from the CSV")
    args = parser.parse_args()
    if not args.summarize_only:
        run(args)
    summarize()


if __name__ == "__main__":
    main()
