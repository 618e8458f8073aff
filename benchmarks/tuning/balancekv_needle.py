"""Choosing BalanceKV's end-to-end defaults on the needle task, on tuning seeds only.

The reported needle comparison (`kvcompress eval`, niah_single at 2k, task seeds 0..29) must not
see the samples its hyperparameters were chosen on, so this script runs on task seeds
`--seed`.. (default 1000..) with the runner's depths (`sample_depth`). Each sample's context is
prefilled once (`capture_qkv`) and that record is compressed by every configuration at
compression ratio `--ratio` (question kept out of compression, greedy answer, as the runner
does). Configurations: augmented fraction × (sink, window), plus the full cache and uniform
sampling (`random`, weighted) for reference.

Writes benchmarks/results/balancekv_needle_tuning.{csv,md}.

    PYTHONPATH=. python benchmarks/tuning/balancekv_needle.py tune --samples 10

`stream` runs BalanceKV in chunked mode (the context fed through its stream in blocks of 128, with
`--sink-window` tokens exact) with each `--slacks` value at each `--ratios` ratio, paired on task seeds `--seed`..,
against the full cache; writes benchmarks/results/balancekv_needle_slack.{csv,md}.

    PYTHONPATH=. python benchmarks/tuning/balancekv_needle.py stream --samples 12 --seed 0
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.eval.capture import capture_qkv
from kvcompress.eval.runner import sample_depth
from kvcompress.eval.stats import wilson
from kvcompress.eval.tables import write_csv
from kvcompress.eval.tasks import niah_single, score
from kvcompress.integration.generation import generate_ids
from kvcompress.integration.model import build_prompt

RESULTS = Path(__file__).parents[1] / "results"
def configurations(args) -> list[tuple[str, str | None, dict]]:
    """(label, method, parameters) of every run per sample."""
    runs = [("full", None, {}), ("random (weighted)", "random", {"weighted": True, "sink": 0, "window": 0, "compression_ratio": args.ratio})]
    for augment, (sink, window) in itertools.product(args.augments, args.sink_windows):
        runs.append((f"balancekv augment={augment} sink={sink} window={window}", "balancekv",
                     {"augment": augment, "sink": sink, "window": window, "compression_ratio": args.ratio}))
    return runs


def stream_configurations(args) -> list[tuple[str, str | None, dict]]:
    """(label, method, parameters) of the `stream` runs per sample: full cache, then BalanceKV chunked per ratio and slack."""
    sink, window = args.sink_window
    return [("full", None, {})] + [(f"balancekv chunked ratio={ratio} slack={slack}", "balancekv",
                                    {"mode": "chunked", "compression_ratio": ratio, "slack": slack, "sink": sink, "window": window})
                                   for ratio, slack in itertools.product(args.ratios, args.slacks)]


def tune(args, runs: list[tuple[str, str | None, dict]]) -> list[dict]:
    """Rows {config, task_seed, depth, ratio, score, prediction, wall_s} of every run on every sample, printed as they finish.

    A run's parameters hold its compression_ratio (none for the full cache) and may set mode (default
    prefill: the context's recorded prefill is compressed)."""
    torch.set_num_threads(args.threads)
    model, tokenizer = kvc.load_model()
    rows = []
    for i in range(args.samples):
        sample = niah_single(target_tokens=args.length, depth=sample_depth(i), seed=args.seed + i, tokenizer=tokenizer)
        context_ids, question_ids = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
        prefilled = any(method is not None and params.get("mode", "prefill") == "prefill" for _, method, params in runs)
        captured = capture_qkv(model, context_ids) if prefilled else None
        for label, method, params in runs:
            start = time.perf_counter()
            recorded = captured if method is not None and params.get("mode", "prefill") == "prefill" else None
            seeded = {} if method is None else {"seed": args.seed + i}  # the full cache takes no seed (it is refused)
            res = generate_ids(model, context_ids, question_ids, method=method, max_new_tokens=sample.max_new_tokens,
                               prefill=recorded, **seeded, **params)
            prediction = tokenizer.decode(res.token_ids, skip_special_tokens=True).strip()
            rows.append({"config": label, "task_seed": args.seed + i, "depth": sample_depth(i), "ratio": params.get("compression_ratio"),
                         "score": score(sample, prediction), "prediction": prediction, "wall_s": time.perf_counter() - start})
            print(rows[-1], flush=True)
    return rows


def hits_table(groups: dict[str, list[float]]) -> list[str]:
    """Markdown rows: label | hits/n | 95% Wilson interval."""
    lines = ["| configuration | hits | 95% Wilson interval |", "|---|---|---|"]
    for label, scores in groups.items():
        hits = int(sum(s == 1.0 for s in scores))
        low, high = wilson(hits, len(scores))
        lines.append(f"| {label} | {hits}/{len(scores)} | [{low:.2f}, {high:.2f}] |")
    return lines


def write_tuning(rows: list[dict], note: str, name: str = "balancekv_needle_tuning", title: str | None = None) -> None:
    RESULTS.mkdir(exist_ok=True)
    write_csv(RESULTS / f"{name}.csv", rows)
    by = defaultdict(list)
    for r in rows:
        by[r["config"]].append(r["score"])
    seeds = sorted({r["task_seed"] for r in rows})
    if title is None:
        title = f"BalanceKV needle defaults: tuning on task seeds {seeds[0]}..{seeds[-1]} (niah_single, ratio {rows[-1]['ratio']})"
    lines = [f"# {title}", "", note, "", *hits_table(by)]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


def report(run_dir: Path) -> None:
    """Needle hits of every (method, ratio) of a `kvcompress eval` run against the full cache on the same samples."""
    records = [json.loads(line) for line in (run_dir / "results.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    full = {r["index"]: r["score"] for r in records if r["method"] == "full" and r["error"] is None}
    by = defaultdict(list)
    for r in records:
        if r["error"] is None and r["index"] in full:
            by["full cache" if r["method"] == "full" else f"{r['method']} @ {r['ratio']}"].append(r["score"])
    full_hits = sum(s == 1.0 for s in full.values())
    config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    lines = [
        f"# Augmented BalanceKV on the needle (niah_single, {config['config']['lengths']} tokens, prefill mode, question kept "
        f"out of compression), {len(full)} samples (task seeds {config['config']['seed']}..{config['config']['seed'] + len(full) - 1})",
        "",
        f"Run: `{run_dir}` ({config['threads']} thread(s), started {config['started']}, shared 2-core machine). Table: "
        "`PYTHONPATH=. python benchmarks/tuning/balancekv_needle.py report " + str(run_dir) + "`.",
        "",
        *hits_table(by),
        "",
        "| method @ ratio | hits / full-cache hits |",
        "|---|---|",
    ]
    for label, scores in by.items():
        if label != "full cache":
            lines.append(f"| {label} | {sum(s == 1.0 for s in scores)}/{full_hits} = {sum(s == 1.0 for s in scores) / max(full_hits, 1):.2f} |")
    (RESULTS / "balancekv_needle.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tune", help="run the tuning grid on tuning seeds")
    t.add_argument("--samples", type=int, default=10)
    t.add_argument("--seed", type=int, default=1000, help="first task seed (the reported run uses 0..29)")
    t.add_argument("--length", type=int, default=2048)
    t.add_argument("--ratio", type=float, default=0.5)
    t.add_argument("--augments", type=float, nargs="+", default=[0.1, 0.25, 0.5, 0.75])
    t.add_argument("--sink-windows", type=lambda s: tuple(int(x) for x in s.split(",")), nargs="+",
                   default=[(0, 0), (4, 16)], help="sink,window pairs")
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--from-log", type=Path, default=None, help="rebuild the tables from the rows a (stopped) tuning run printed")
    st = sub.add_parser("stream", help="the default BalanceKV in chunked mode, slack values paired on the same samples")
    st.add_argument("--samples", type=int, default=12)
    st.add_argument("--seed", type=int, default=0, help="first task seed")
    st.add_argument("--length", type=int, default=2048)
    st.add_argument("--ratios", type=float, nargs="+", default=[0.75, 0.9])
    st.add_argument("--slacks", type=float, nargs="+", default=[0.0, 0.5])
    st.add_argument("--sink-window", type=lambda s: tuple(int(x) for x in s.split(",")), default=(4, 64),
                    help="sink,window kept exact (default 4,64: BalanceKV's own 0,0 loses the attention sink in chunked mode)")
    st.add_argument("--threads", type=int, default=1)
    r = sub.add_parser("report", help="hits with Wilson intervals of a kvcompress eval run directory")
    r.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    if args.command == "report":
        report(args.run_dir)
        return
    if args.command == "stream":
        rows = tune(args, stream_configurations(args))
        seeds = sorted({r["task_seed"] for r in rows})
        write_tuning(rows, f"{args.threads} thread(s), {time.strftime('%Y-%m-%d', time.gmtime())}, shared 2-core machine. Command: "
                     f"`PYTHONPATH=. python benchmarks/tuning/balancekv_needle.py stream {' '.join(sys.argv[2:])}`.", "balancekv_needle_slack",
                     f"BalanceKV stream (chunked mode, blocks of 128) on the needle, slack {args.slacks} at ratios {args.ratios}: "
                     f"niah_single at {args.length} tokens, task seeds {seeds[0]}..{seeds[-1]}")
        return
    if args.from_log is not None:
        rows = [ast.literal_eval(line) for line in args.from_log.read_text(encoding="utf-8").splitlines() if line.startswith("{'config'")]
        note = f"Rows from the log of a run stopped early ({args.from_log}); {args.threads} thread(s)."
    else:
        rows = tune(args, configurations(args))
        note = f"{args.threads} thread(s), {time.strftime('%Y-%m-%d', time.gmtime())}."
    write_tuning(rows, note)


if __name__ == "__main__":
    main()
