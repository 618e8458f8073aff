"""LongEval-style line retrieval (the SubGen paper, Sec. 3.2, Table 1) on the default model, offline.

Each sample (`kvcompress.eval.tasks.line_retrieval`) holds lines "line {topic}: REGISTER_CONTENT
is <n>" and asks for the number of one topic; the answer starts with "line {topic}:
REGISTER_CONTENT is <" (RULER's answer-prefix convention) and is correct when its first number
matches (LongEval's scoring). `--lines dense` is LongEval's form (the context is nothing but
lines); `--lines k` puts k lines in a real-prose haystack (the asked one at the sample's depth).
The default model (135M parameters) cannot tell lines apart: its full cache answers the dense
form and k >= 2 near chance (run `--lines dense 2 4 --methods full` to see it), so the
compression comparison uses k = 1, the one form where its full cache succeeds. The context is compressed once after
prefill (the seed applies its k-center once to the whole cache) with the same share of the cache
kept for every method (compression_ratio = 1 − kept), the question is appended exactly, greedy
decoding. The context of each sample is prefilled once and that record is compressed by every
method (`generate_ids(prefill=...)`, equal to a fresh prefill-mode `generate`); prefill_s is that
shared prefill. Method "full" is the uncompressed cache (kept = 1), run once per sample to show
whether the model can do the task at all. Rows are appended to benchmarks/results/line_retrieval.csv as they finish (a rerun
skips rows already there); the accuracy table goes to line_retrieval.md and .png.

    python benchmarks/line_retrieval.py [--lengths 2048 4096] [--kept 0.5 0.35] [--samples 8] [--lines 1]
"""

from __future__ import annotations

import argparse
import csv
import itertools
import time
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import kvcompress as kvc  # noqa: E402
from kvcompress.eval.capture import capture_qkv  # noqa: E402
from kvcompress.eval.tasks import line_retrieval, score  # noqa: E402
from kvcompress.integration.generation import generate_ids  # noqa: E402
from kvcompress.integration.model import build_prompt  # noqa: E402

RESULTS = Path(__file__).parent / "results"
CSV = RESULTS / "line_retrieval.csv"
FIELDS = ["lines", "length", "tokens", "kept", "method", "sample", "depth", "answer", "prediction", "correct",
          "kv_fraction", "prefill_s", "compress_s"]


def done_rows() -> list[dict]:
    """Rows of line_retrieval.csv and of every part file (line_retrieval_part_*.csv)."""
    rows = []
    for path in [CSV, *sorted(RESULTS.glob("line_retrieval_part_*.csv"))]:
        if path.exists():
            with open(path, encoding="utf-8") as f:
                rows += list(csv.DictReader(f))
    return rows


def run(args) -> None:
    torch.set_num_threads(args.threads)
    model, tokenizer = kvc.load_model()
    RESULTS.mkdir(exist_ok=True)
    seen = {(r["lines"], r["length"], r["kept"], r["method"], r["sample"]) for r in done_rows()}
    out = RESULTS / f"line_retrieval_part_{args.part}.csv" if args.part else CSV
    new_file = not out.exists()
    with open(out, "a", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new_file:
            writer.writeheader()
        for i, lines, length in itertools.product(range(args.first_sample, args.first_sample + args.samples), args.lines, args.lengths):
            depth = (i % 4 + 0.5) / 4
            n_lines = None if lines == "dense" else int(lines)
            sample = line_retrieval(target_tokens=length, depth=depth, seed=i, tokenizer=tokenizer, n_lines=n_lines, haystack="prose")
            runs = [(k, m) for k in args.kept for m in args.methods if m != "full"]
            if "full" in args.methods:
                runs.insert(0, (1.0, "full"))
            runs = [(k, m) for k, m in runs if (lines, str(length), str(k), m, str(i)) not in seen]
            if not runs:
                continue
            context_ids, question_ids = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
            start = time.perf_counter()
            record = capture_qkv(model, context_ids) if any(m != "full" for _, m in runs) else None
            prefill_s = time.perf_counter() - start
            for kept, method in runs:
                if method == "full":
                    res = generate_ids(model, context_ids, question_ids, method=None, max_new_tokens=args.max_new_tokens)
                else:
                    res = generate_ids(
                        model, context_ids, question_ids, method=method, compression_ratio=round(1.0 - kept, 6),
                        max_new_tokens=args.max_new_tokens, prefill=record,
                    )
                text = tokenizer.decode(res.token_ids, skip_special_tokens=True)
                row = {
                    "lines": lines, "length": length, "tokens": res.context_tokens, "kept": kept, "method": method, "sample": i,
                    "depth": round(sample.depth, 3), "answer": sample.answers[0], "prediction": text.replace("\n", " "),
                    "correct": score(sample, text), "kv_fraction": round(res.kv_bytes / res.kv_bytes_full, 4),
                    "prefill_s": round(prefill_s, 2), "compress_s": round(res.compress_seconds, 2),
                }
                writer.writerow(row)
                f.flush()
                print(f"[{time.strftime('%H:%M:%S')}] {row}", flush=True)


def summarize() -> None:
    rows = done_rows()
    acc: dict[tuple, list[float]] = defaultdict(list)
    frac: dict[tuple, list[float]] = defaultdict(list)
    tokens: dict[int, list[int]] = defaultdict(list)
    for r in rows:
        key = (r["lines"], int(r["length"]), float(r["kept"]), r["method"])
        acc[key].append(float(r["correct"]))
        frac[key].append(float(r["kv_fraction"]))
        tokens[int(r["length"])].append(int(r["tokens"]))
    methods = sorted({k[3] for k in acc}, key=lambda m: (m != "full", m))
    settings = sorted({k[:3] for k in acc}, key=lambda k: (k[0] != "1", k[0], k[1], -k[2]))
    table = [
        "# Line retrieval (LongEval-style), SmolLM2-135M-Instruct, prefill compression, greedy decoding",
        "",
        "lines: lines in the context (dense = nothing but lines; k = k lines in real prose). Accuracy",
        "(correct / samples); kv = stored KV bytes / full cache at the end of decoding.",
        "",
        "| lines | context (tokens) | cache kept | " + " | ".join(methods) + " |",
        "|---|---|---|" + "---|" * len(methods),
    ]
    for lines, length, kept in settings:
        cells = []
        for m in methods:
            a = acc.get((lines, length, kept, m))
            cells.append(f"{sum(a) / len(a):.2f} ({int(sum(a))}/{len(a)}, kv {sum(frac[(lines, length, kept, m)]) / len(a):.2f})" if a else "-")
        mean_tokens = sum(tokens[length]) / len(tokens[length])
        table.append(f"| {lines} | {length} (~{mean_tokens:.0f}) | {kept:.0%} | " + " | ".join(cells) + " |")
    (RESULTS / "line_retrieval.md").write_text("\n".join(table) + "\n", encoding="utf-8")
    print("\n".join(table))
    compared = [k for k in settings if k[0] == "1"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        vals = [sum(acc[(*k, m)]) / len(acc[(*k, m)]) if acc.get((*k, m)) else 0.0 for k in compared]
        ax.bar([i + j * width for i in range(len(compared))], vals, width, label=m)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(compared))], [f"{n} tok, {k:.0%} kept" for _, n, k in compared])
    ax.set(ylabel="accuracy", ylim=(0, 1), title="line retrieval (1 line in prose), SmolLM2-135M")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "line_retrieval.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096], help="target context tokens")
    parser.add_argument("--kept", type=float, nargs="+", default=[0.5, 0.35], help="share of the cache kept")
    parser.add_argument("--methods", nargs="+", default=["full", "clustergen", "subgen", "streamingllm", "h2o"],
                        help='"full" = the uncompressed cache')
    parser.add_argument("--lines", nargs="+", default=["1"], help='lines per context: "dense" or a count k >= 1')
    parser.add_argument("--samples", type=int, default=8, help="questions per length (depths cycle through 1/8, 3/8, 5/8, 7/8)")
    parser.add_argument("--part", default=None, help="append to line_retrieval_part_PART.csv (parallel runs; all parts are summarized)")
    parser.add_argument("--first-sample", type=int, default=0, help="first sample index (split a run over processes)")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--summarize-only", action="store_true", help="only rebuild the .md/.png from the CSV")
    args = parser.parse_args()
    if not args.summarize_only:
        run(args)
    summarize()


if __name__ == "__main__":
    main()
