"""Before/after tables of two runs of the same `kvcompress eval` command (e.g. two kvcompress trees).

`tasks`: two `kvcompress eval` output folders (results.jsonl, or results.jsonl.gz as committed). Each method @ ratio (and mode) is
paired on the samples both runs answered: scores before and after (%, 95% Wilson intervals), the
pairs where each run scored higher, and the exact sign test (McNemar's for 0/1 scores).

`approx`: two `kvcompress eval approx` folders (approx.csv). Each method @ ratio: the relative error
averaged over the layers, before and after, with 95% intervals (normal approximation over seeds,
layers independent), and the difference with its interval.

    python benchmarks/tuning/compare_runs.py tasks BEFORE_DIR AFTER_DIR
    python benchmarks/tuning/compare_runs.py approx BEFORE_DIR AFTER_DIR
"""

from __future__ import annotations

import argparse
import csv
import math
from collections import defaultdict
from pathlib import Path

from kvcompress.eval.runner import read_results
from kvcompress.eval.stats import SAMPLE_KEY, Z95, check_one_prompt_per_sample, sign_test, wilson


def _records(folder: Path) -> list[dict]:
    """A run's answered cells (no error, a score, not of the needle grid)."""
    found = [path for path in (folder / "results.jsonl", folder / "results.jsonl.gz") if path.is_file()]
    if not found:
        raise SystemExit(f"{folder} holds no kvcompress eval records (results.jsonl, or results.jsonl.gz as committed)")
    return [r for r in read_results(found[0]) if r.get("error") is None and r.get("score") is not None and not r.get("grid")]


def _scores(records: list[dict]) -> dict[tuple, dict[tuple, float]]:
    """{(method, ratio, mode): {sample key: score}} of answered cells."""
    cells: dict[tuple, dict[tuple, float]] = defaultdict(dict)
    for r in records:
        cells[(r["method"], r["ratio"], r["mode"])][tuple(r[k] for k in SAMPLE_KEY)] = r["score"]
    return cells


def _percent(scores: list[float]) -> str:
    low, high = wilson(sum(scores), len(scores))
    return f"{100 * sum(scores) / len(scores):.0f} ({100 * low:.0f}–{100 * high:.0f})"


def tasks_table(before: Path, after: Path) -> str:
    earlier, later = _records(before), _records(after)
    try:  # a sample pairs across the runs only if both answered the same prompt
        check_one_prompt_per_sample(earlier + later)
    except ValueError as err:
        raise SystemExit(f"{before} and {after}: {err}") from None
    old, new = _scores(earlier), _scores(later)
    lines = ["| method @ ratio (mode) | pairs | before % | after % | after higher | before higher | p (sign test) |",
             "|---|---|---|---|---|---|---|"]
    for cell in sorted(set(old) & set(new), key=str):
        common = sorted(set(old[cell]) & set(new[cell]), key=str)
        if not common:
            continue
        a, b = [old[cell][k] for k in common], [new[cell][k] for k in common]
        up, down = sum(y > x for x, y in zip(a, b)), sum(y < x for x, y in zip(a, b))
        method, ratio, mode = cell
        lines.append(f"| {method} @ {ratio} ({mode}) | {len(common)} | {_percent(a)} | {_percent(b)} | {up} | {down} | {sign_test(up, down):.2f} |")
    return "\n".join(lines)


def _layer_means(folder: Path, method: str) -> dict[float, tuple[float, float]]:
    """{ratio: (error averaged over layers, variance of that average)} from approx.csv."""
    cells: dict[float, list[tuple[float, float]]] = defaultdict(list)
    with open(folder / "approx.csv", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if row["method"] == method:
                cells[float(row["ratio"])].append((float(row["error_mean"]), float(row["error_std"]) ** 2 / int(row["seeds"])))
    return {ratio: (sum(m for m, _ in c) / len(c), sum(v for _, v in c) / len(c) ** 2) for ratio, c in cells.items()}


def approx_table(before: Path, after: Path, method: str) -> str:
    old, new = _layer_means(before, method), _layer_means(after, method)
    lines = [f"| {method} @ ratio | before | after | after − before |", "|---|---|---|---|"]
    for ratio in sorted(set(old) & set(new)):
        (a, va), (b, vb) = old[ratio], new[ratio]
        half = Z95 * math.sqrt(va + vb)
        lines.append(f"| {ratio} | {a:.4f} ± {Z95 * math.sqrt(va):.4f} | {b:.4f} ± {Z95 * math.sqrt(vb):.4f} | "
                     f"{b - a:+.4f} [{b - a - half:+.4f}, {b - a + half:+.4f}] |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=["tasks", "approx"])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--methods", default=None, help="approx: comma-separated methods (default: every method of the before run)")
    args = p.parse_args()
    if args.kind == "tasks":
        print(tasks_table(args.before, args.after))
        return
    with open(args.before / "approx.csv", encoding="utf-8") as f:
        methods = args.methods.split(",") if args.methods else list(dict.fromkeys(r["method"] for r in csv.DictReader(f)))
    for method in methods:
        print(approx_table(args.before, args.after, method) + "\n")


if __name__ == "__main__":
    main()
