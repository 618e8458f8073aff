"""Choosing the default prompt layout: full-cache accuracy of the default model per layout on the prose needle.

Each layout (`integration.model.PROMPT_LAYOUTS`: the separator between context and question, and
whether the task's answer prefix starts the answer) answers the same `niah_prose` samples with the
full cache. The context tokens do not depend on the layout, so each sample's context is prefilled
once (`capture_qkv`) and every layout's question is answered from that record, as the sweep runner
answers its full-cache cells (greedy, the sample's answer limit and stop strings).

Seeds: `--split tuning` runs task seeds TUNING_SEEDS.start + i (1000..), on which the default was
chosen; `--split reported` runs task seeds i (0..), which the choice never saw. Sample i sits at the
runner's depth `sample_depth(i)`. `--prose` picks the body of prose: the language reference (`reported`, the
default, the pools of the reported samples) or the standard library's docstrings (`tuning`, niah_prose's tuning pools),
so the layout is chosen across two texts:

    PYTHONPATH=. .venv/bin/python benchmarks/tuning/prompt_layout.py --split tuning --prose tuning --length 2048 --samples 30

    PYTHONPATH=. .venv/bin/python benchmarks/tuning/prompt_layout.py --split tuning --length 2048 --samples 30
    PYTHONPATH=. .venv/bin/python benchmarks/tuning/prompt_layout.py --split reported --length 2048 --samples 30

A run appends one record per (sample, layout) to OUT/<split>_<length>_<answer kind>[_tuning_prose]/records.jsonl
(a rerun skips the samples already there, so a run can be split into several) and rewrites
OUT/summary.md from every records file under OUT: accuracy per layout with 95% Wilson intervals,
every pair of layouts on the same samples (exact sign test), and the machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.eval.capture import capture_qkv
from kvcompress.eval.prefill_replay import full_as_ratio_zero
from kvcompress.eval.runner import sample_depth
from kvcompress.eval.stats import sign_test, wilson
from kvcompress.eval.stopping import stop_token_ids
from kvcompress.eval.tables import markdown_table
from kvcompress.eval.tasks import PROSE_ANSWER_KINDS, TUNING_SEEDS, niah_prose, score
from kvcompress.integration.generation import generate_ids
from kvcompress.integration.model import (
    DEFAULT_PROMPT_LAYOUT,
    PROMPT_LAYOUTS,
    build_prompt,
)

OUT = Path(__file__).parents[2] / "results" / "prompt_layout"
RECORDS = "records.jsonl"
# niah_prose's split -> the body of prose its haystack comes from (a record without "prose" predates the choice: reported)
PROSE_BODIES = {"reported": "the Python language reference", "tuning": "the standard library's docstrings"}


def task_seed(split: str, index: int) -> int:
    """The task seed of sample `index`: tuning seeds from TUNING_SEEDS, reported seeds below them."""
    return TUNING_SEEDS.start + index if split == "tuning" else index


def run(args) -> Path:
    """Answer every sample not yet in this run's records with every layout; return the records file."""
    torch.set_num_threads(args.threads)
    model, tokenizer = kvc.load_model()
    folder = args.out / (f"{args.split}_{args.length}_{args.answer_kind}" + ("" if args.prose == "reported" else f"_{args.prose}_prose"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RECORDS
    done = {r["seed"] for r in read_records(path)}
    machine = {"host": platform.node(), "threads": torch.get_num_threads(), "torch": torch.__version__,
               "python": platform.python_version(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "command": " ".join(["benchmarks/tuning/prompt_layout.py", *sys.argv[1:]])}
    with (folder / "machine.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps(machine) + "\n")
    method, ratio = full_as_ratio_zero(None, 0.0)
    for i in range(args.samples):
        seed = task_seed(args.split, i)
        if seed in done:
            continue
        sample = niah_prose(args.length, sample_depth(i), seed, tokenizer, answer_kind=args.answer_kind, split=args.prose)
        prompts = {name: build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix, name) for name in args.layouts}
        context_ids = next(iter(prompts.values()))[0]
        if any(not torch.equal(c, context_ids) for c, _ in prompts.values()):
            raise RuntimeError("the context tokens differ between layouts: one prefill cannot serve them all")
        start = time.perf_counter()
        captured = capture_qkv(model, context_ids)
        capture_s = time.perf_counter() - start
        stops = stop_token_ids(tokenizer, sample.stop)
        rows = []
        for name, (_, question_ids) in prompts.items():
            res = generate_ids(model, context_ids, question_ids, method=method, compression_ratio=ratio, prefill=captured,
                               max_new_tokens=sample.max_new_tokens, stop_token_ids=stops)
            prediction = tokenizer.decode(res.token_ids, skip_special_tokens=True).strip()
            layout = PROMPT_LAYOUTS[name]
            rows.append({"split": args.split, "prose": args.prose, "length": args.length, "answer_kind": args.answer_kind, "seed": seed,
                         "depth": sample_depth(i), "measured_depth": sample.depth, "context_tokens": int(context_ids.shape[1]),
                         "layout": name, "separator": layout.separator, "primed": layout.primed, "question": sample.question,
                         "answer_prefix": sample.answer_prefix if layout.primed else "", "answers": sample.answers,
                         "prediction": prediction, "score": score(sample, prediction), "capture_s": capture_s,
                         "decode_s": res.decode_seconds})
        with path.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        print(f"seed {seed}: {sample.answers[0]!r} " + " | ".join(f"{r['layout']}={r['score']:.0f} {r['prediction']!r}" for r in rows),
              flush=True)
    return path


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()] if path.is_file() else []


def summary(out: Path) -> str:
    """For every run under `out`: accuracy per layout (%, 95% Wilson interval), and every pair of layouts on the same
    samples (exact sign test)."""
    parts = ["# Prompt layout: full-cache accuracy of the default model on the prose needle (`niah_prose`)", "",
             "Written by `benchmarks/tuning/prompt_layout.py`; see docs/prompt_layout.md.", ""]
    for folder in sorted(p.parent for p in out.glob(f"*/{RECORDS}")):
        records = read_records(folder / RECORDS)
        by_layout: dict[str, dict[int, float]] = defaultdict(dict)
        for r in records:
            by_layout[r["layout"]][r["seed"]] = r["score"]
        names = [name for name in PROMPT_LAYOUTS if name in by_layout]
        seeds = sorted(set.intersection(*(set(by_layout[name]) for name in names)))
        rows, pairs = [], []
        for name in names:
            scores = [by_layout[name][s] for s in seeds]
            low, high = wilson(sum(scores), len(scores))
            layout = PROMPT_LAYOUTS[name]
            rows.append({"layout": name + (" (default)" if name == DEFAULT_PROMPT_LAYOUT else ""),
                         "separator": repr(layout.separator), "answer prefix": "yes" if layout.primed else "no",
                         "correct": f"{sum(scores):.0f}/{len(scores)}",
                         "accuracy % (95% CI)": f"{100 * sum(scores) / len(scores):.0f} ({100 * low:.0f}–{100 * high:.0f})"})
        for a, b in itertools.combinations(names, 2):
            wins = sum(by_layout[a][s] > by_layout[b][s] for s in seeds)
            losses = sum(by_layout[a][s] < by_layout[b][s] for s in seeds)
            pairs.append({"layout A": a, "layout B": b, "A right, B wrong": wins, "B right, A wrong": losses,
                          "p (sign test)": f"{sign_test(wins, losses):.3g}"})
        machines = read_records(folder / "machine.jsonl")
        first = records[0]
        parts += [f"## {first['split']} seeds {seeds[0]}–{seeds[-1]}, {first['length']} tokens, {first['answer_kind']}, "
                  f"{PROSE_BODIES[first.get('prose', 'reported')]}", "",
                  markdown_table(rows), "", markdown_table(pairs), "",
                  (f"Machine: {machines[-1]['host']}, {machines[-1]['threads']} thread(s), torch {machines[-1]['torch']}; "
                   f"runs {', '.join(m['date'] for m in machines)}; command `{machines[-1]['command']}`."), ""]
    return "\n".join(parts)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--split", choices=("tuning", "reported"), required=True, help="tuning seeds (1000..) or reported seeds (0..)")
    p.add_argument("--prose", choices=("reported", "tuning"), default="reported",
                   help="niah_prose's pools (its split): the language reference (reported, default) or the standard library's "
                        "docstrings (tuning; tuning seeds only)")
    p.add_argument("--length", type=int, default=2048, help="context tokens (default 2048)")
    p.add_argument("--samples", type=int, default=30, help="samples (default 30)")
    p.add_argument("--answer-kind", choices=PROSE_ANSWER_KINDS, default="names", help="niah_prose answer kind (default names)")
    p.add_argument("--layouts", type=lambda s: s.split(","), default=list(PROMPT_LAYOUTS),
                   help=f"comma-separated layouts (default all: {','.join(PROMPT_LAYOUTS)})")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--summary-only", action="store_true", help="only rewrite OUT/summary.md from the records there")
    args = p.parse_args(argv)
    bad = [name for name in args.layouts if name not in PROMPT_LAYOUTS]
    if bad:
        p.error(f"--layouts must be among {','.join(PROMPT_LAYOUTS)}, got {','.join(bad)}")
    if not args.summary_only:
        run(args)
    (args.out / "summary.md").write_text(summary(args.out), encoding="utf-8")
    print((args.out / "summary.md").read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
