"""TOVA on the filler needle task: 2k tokens, 11 depths, ratio 0.75, with the question kept out of or put into compression.

RULER-style single needle (`eval.tasks.niah_single`, filler haystack, 7-digit number) at depths
0, 0.1, ..., 1.0 of a 2048-token context, one sample per depth (seed = depth index), greedy
answers of up to 32 tokens scored with the task's own score; 95% Wilson intervals.

Cells (TOVA with its defaults: layer-averaged, no sink/window, as the paper):
- question kept out (the eval's and kvpress's default): the context is prefilled once
  (`capture_qkv`) and compressed, so TOVA scores with the last *context* token's query; the
  question is then read exactly. The full cache (ratio 0) answers from the same prefill.
- question compressed (`compress_question=True`, TOVA's own protocol, where the policy runs on
  the whole prompt): the prompt's last token, after the question, scores; the ratio applies to
  the whole prompt.
Rows are written after every depth; --resume continues from the CSV, skipping the rows it holds;
--depth-indices / --csv split the depths between processes (concatenate the CSVs, then --summary-only).
Writes benchmarks/results/tova_needles.{csv,md}.

    PYTHONPATH=. python benchmarks/tova_needles.py [--resume] [--summary-only] [--depth-indices 6,7] [--csv PATH]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.eval.bench import machine_description
from kvcompress.eval.capture import capture_qkv
from kvcompress.eval.stats import wilson
from kvcompress.eval.tables import write_csv
from kvcompress.eval.tasks import niah_single, score
from kvcompress.integration import build_prompt, generate_ids

RESULTS = Path(__file__).parent / "results"
DEPTHS = [i / 10 for i in range(11)]
RATIO = 0.75
MAX_NEW_TOKENS = 32
# (label, question compressed, method parameters, compression ratio)
CELLS = (
    ("full", False, {}, 0.0),
    ("tova", False, {}, RATIO),
    ("tova", True, {}, RATIO),
)


def question_label(compress_question: bool) -> str:
    return "compressed" if compress_question else "kept out"


def read_rows(path: Path) -> list[dict]:
    """Rows of an earlier run's CSV, the fields the summary reads parsed."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row["depth"], row["hit"] = float(row["depth"]), float(row["hit"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--resume", action="store_true", help="continue from benchmarks/results/tova_needles.csv, skipping its rows")
    p.add_argument("--summary-only", action="store_true", help="only write the Markdown summary of the CSV's rows")
    p.add_argument("--depth-indices", type=str, default=None, help="comma-separated indices into the 11 depths to run (default all)")
    p.add_argument("--csv", type=Path, default=RESULTS / "tova_needles.csv", help="where rows go (default benchmarks/results/tova_needles.csv)")
    args = p.parse_args()
    torch.set_num_threads(1)
    machine = machine_description(1)
    path = args.csv
    chosen = range(len(DEPTHS)) if args.depth_indices is None else [int(i) for i in args.depth_indices.split(",")]
    rows = read_rows(path) if args.resume or args.summary_only else []
    done = {(r["question"], r["cell"], r["depth"]) for r in rows}
    model, tok = kvc.load_model() if not args.summary_only else (None, None)
    for index in chosen if not args.summary_only else []:
        depth = DEPTHS[index]
        todo = [c for c in CELLS if (question_label(c[1]), c[0], depth) not in done]
        if not todo:
            continue
        sample = niah_single(target_tokens=2048, depth=depth, seed=index, tokenizer=tok, haystack="filler")
        context_ids, question_ids = build_prompt(tok, sample.context, sample.question, sample.answer_prefix)
        captured = capture_qkv(model, context_ids) if any(not c[1] for c in todo) else None
        for label, compress_question, params, ratio in todo:
            prefill = None if compress_question else captured
            res = generate_ids(model, context_ids, question_ids, method="tova", compression_ratio=ratio, max_new_tokens=MAX_NEW_TOKENS,
                               prefill=prefill, compress_question=compress_question, **params)
            text = tok.decode(res.token_ids, skip_special_tokens=True)
            rows.append({"question": question_label(compress_question), "cell": label, "depth": depth,
                         "context_tokens": context_ids.shape[1], "prompt_tokens": res.prompt_tokens, "hit": score(sample, text),
                         "answer": sample.answers[0], "prediction": text.strip().replace("\n", " ")})
            print(rows[-1], flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_csv(path, rows)
    lines = [
        f"# TOVA on the filler needle task: 2048 tokens, {len(DEPTHS)} depths, compression ratio {RATIO}",
        "",
        ("Summary of the CSV's rows (--summary-only), written on: " if args.summary_only else "Machine: ")
        + f"{machine}; default model, greedy ({MAX_NEW_TOKENS} new tokens), one sample per depth. 95% Wilson intervals. "
        "Command: `PYTHONPATH=. python benchmarks/tova_needles.py`.",
        "",
        "| question | cell | hits | rate | 95% interval | depths missed |",
        "|---|---|---|---|---|---|",
    ]
    for label, compress_question, _, _ in CELLS:
        question = question_label(compress_question)
        sel = sorted((r for r in rows if r["cell"] == label and r["question"] == question), key=lambda r: r["depth"])
        hits = int(sum(r["hit"] for r in sel))
        low, high = wilson(hits, len(sel))
        missed = ", ".join(f"{r['depth']:g}" for r in sel if r["hit"] < 1) or "-"
        lines.append(f"| {question} | {label} | {hits}/{len(sel)} | {hits / len(sel):.2f} | [{low:.2f}, {high:.2f}] | {missed} |")
    (RESULTS / "tova_needles.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
