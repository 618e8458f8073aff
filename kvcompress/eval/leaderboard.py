"""Leaderboard of a benchmark sweep: method × ratio rows, average and per-task columns, 95% intervals.

`write_leaderboard(records, out_dir)` writes, for every benchmark in the records,
`leaderboard_<benchmark>.md`, `.html` and `.png` (score vs compression ratio per task).
Scores are the benchmark's metric × 100, averaged over a task's samples; the average column is
the mean of the task means (LongBench's convention), and LongBench-E adds one column per length
bucket (mean over tasks within the bucket).

Intervals (95%): Wilson for a task whose sample scores are all 0 or 1, else the normal
approximation mean ± 1.96·s/√n (clipped to [0, 100]; none for a single non-binary sample); a
mean over tasks gets ± 1.96·√(Σ se_t²)/T from the tasks' standard errors (a binary task's se is
its Wilson half-width / 1.96). Cells that could not run are left out and
flag the entry with `*`.
"""

from __future__ import annotations

import html
import math
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .benchmarks import LONGBENCH_E_BUCKETS  # noqa: E402
from .runner import FULL  # noqa: E402
from .stats import Z95, wilson  # noqa: E402

def score_stats(scores: list[float]) -> dict:
    """Mean, standard error and 95% interval (fractions in [0, 1]) of per-sample scores."""
    n = len(scores)
    mean = sum(scores) / n
    var = sum((s - mean) ** 2 for s in scores) / (n - 1) if n > 1 else 0.0
    se = math.sqrt(var / n) if n > 1 else float("nan")
    if all(s in (0.0, 1.0) for s in scores):
        low, high = wilson(sum(scores), n)
        se = (high - low) / (2 * Z95)  # the Wilson half-width as a standard error, for means over tasks
    else:
        low, high = _clipped(mean, se)
    return {"mean": mean, "se": se, "low": low, "high": high, "n": n}


def _clipped(mean: float, se: float) -> tuple[float, float]:
    """mean -/+ 1.96 se within [0, 1]; NaN bounds when se is unknown (one non-binary sample)."""
    if math.isnan(se):
        return float("nan"), float("nan")
    return max(0.0, mean - Z95 * se), min(1.0, mean + Z95 * se)


def mean_of_tasks(stats: list[dict]) -> dict:
    """Unweighted mean of task means, with the interval from the tasks' standard errors (one task: its own stats)."""
    if len(stats) == 1:
        return stats[0]
    mean = sum(s["mean"] for s in stats) / len(stats)
    se = math.sqrt(sum(s["se"] ** 2 for s in stats)) / len(stats)
    low, high = _clipped(mean, se)
    return {"mean": mean, "se": se, "low": low, "high": high, "n": sum(s["n"] for s in stats)}


def _entry(record: dict) -> tuple:
    return (record["method"], record["ratio"], record["mode"])


def _entry_order(entry: tuple) -> tuple:
    method, ratio, mode = entry
    return (method != FULL, method, ratio or 0.0, mode)


def leaderboard(records: list[dict]) -> tuple[list[str], list[tuple], dict]:
    """(columns, entries, cells) of one benchmark's records.

    columns: "average", the length buckets (LongBench-E), then the tasks in order of first
    appearance; entries: (method, ratio, mode), full cache first; cells[(entry, column)]: stats
    (see `score_stats`) plus "errors", or None when no cell of it ran.
    """
    tasks = list(dict.fromkeys(r["task"] for r in records))
    buckets = [b for b in LONGBENCH_E_BUCKETS if any(r.get("bucket") == b for r in records)]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(_entry(r), r["task"], r.get("bucket") if buckets else None)].append(r)
    entries = sorted({_entry(r) for r in records}, key=_entry_order)
    cells: dict[tuple, dict | None] = {}
    for entry in entries:
        per_task = {}
        for task in tasks:
            rows = [r for (e, t, _), rs in groups.items() if e == entry and t == task for r in rs]
            per_task[task] = _stats(rows)
            cells[(entry, task)] = per_task[task]
        for bucket in buckets:
            in_bucket = [_stats(rs) for (e, _, b), rs in groups.items() if e == entry and b == bucket]
            cells[(entry, bucket)] = _combine([s for s in in_bucket if s is not None], len(in_bucket))
        cells[(entry, "average")] = _combine([s for s in per_task.values() if s is not None], len(tasks))
    return ["average", *buckets, *tasks], entries, cells


def _stats(rows: list[dict]) -> dict | None:
    scores = [r["score"] for r in rows if r["error"] is None]
    if not rows:
        return None
    errors = len(rows) - len(scores)
    return (score_stats(scores) | {"errors": errors}) if scores else {"n": 0, "errors": errors}


def _combine(stats: list[dict], expected: int) -> dict | None:
    """Mean of the task stats; flagged with errors when a task has none or errored cells."""
    ran = [s for s in stats if s["n"]]
    if not ran:
        return {"n": 0, "errors": 1} if stats else None
    errors = sum(s["errors"] for s in stats) + (expected - len(ran))
    return mean_of_tasks(ran) | {"errors": errors}


def _label(entry: tuple, modes: set[str]) -> str:
    method, ratio, mode = entry
    if method == FULL:
        return "full cache"
    return f"{method} @ {ratio:g}" + (f" ({mode})" if len(modes) > 1 else "")


def _text(cell: dict | None) -> str:
    if cell is None:
        return ""
    if cell["n"] == 0:
        return "n/a"
    flag = "*" if cell["errors"] else ""
    if math.isnan(cell["low"]):
        return f"{100 * cell['mean']:.1f}{flag} (n={cell['n']}, no interval)"
    return f"{100 * cell['mean']:.1f}{flag} [{100 * cell['low']:.1f}, {100 * cell['high']:.1f}]"


def _table(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    columns, entries, cells = leaderboard(records)
    modes = {e[2] for e in entries if e[0] != FULL}
    head = ["method @ ratio", *columns]
    rows = [[_label(e, modes), *(_text(cells.get((e, c))) for c in columns)] for e in entries]
    return head, rows


def _caption(benchmark: str, records: list[dict]) -> str:
    n_samples = len({(r["task"], r["index"]) for r in records})
    return (f"{benchmark}: score × 100 (the benchmark's metric), mean [95% interval] over {n_samples} samples; "
            "average = mean of the task means. `*`: some cells could not run (see results.jsonl); n/a: none could.")


def markdown_leaderboard(benchmark: str, records: list[dict]) -> str:
    """The leaderboard of one benchmark's records as a Markdown table with a caption."""
    head, rows = _table(records)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join([f"### {benchmark}", "", *lines, "", _caption(benchmark, records), ""])


def html_leaderboard(benchmark: str, records: list[dict]) -> str:
    """The leaderboard of one benchmark's records as a standalone HTML page."""
    head, rows = _table(records)
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "\n".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    style = "table{border-collapse:collapse;font-family:sans-serif;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child{text-align:left}"
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(benchmark)} leaderboard</title>"
            f"<style>{style}</style></head><body>\n<h3>{html.escape(benchmark)}</h3>\n<table>\n<tr>{th}</tr>\n{body}\n</table>\n"
            f"<p>{html.escape(_caption(benchmark, records))}</p>\n</body></html>\n")


def plot_leaderboard(benchmark: str, records: list[dict], path: str | Path) -> Path:
    """Score vs compression ratio, one panel per task plus the average, a line with 95% bars per method."""
    columns, entries, cells = leaderboard(records)
    panels = ["average"] + [c for c in columns if c != "average" and c not in LONGBENCH_E_BUCKETS]
    methods = sorted({e[0] for e in entries} - {FULL})
    colors = plt.colormaps["tab20"].resampled(max(len(methods), 1))
    ncols = min(4, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4 * ncols, 3.2 * nrows), squeeze=False, sharey=True)
    for ax, panel in zip(axes.flat, panels):
        for i, method in enumerate(methods):
            pts = sorted((e[1], cells[(e, panel)]) for e in entries if e[0] == method and cells.get((e, panel)) and cells[(e, panel)]["n"])
            if pts:
                x = [p[0] for p in pts]
                y = [100 * p[1]["mean"] for p in pts]
                err = [[100 * (p[1]["mean"] - p[1]["low"]) for p in pts], [100 * (p[1]["high"] - p[1]["mean"]) for p in pts]]
                ax.errorbar(x, y, yerr=err, marker="o", ms=3, lw=1.2, capsize=2, color=colors(i), label=method)
        full = [cells[(e, panel)] for e in entries if e[0] == FULL and cells.get((e, panel)) and cells[(e, panel)]["n"]]
        if full:
            ax.axhline(100 * full[0]["mean"], color="black", ls="--", lw=1, label="full cache")
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("compression ratio (fraction removed)")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("score × 100")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(7, len(labels)), fontsize=8)
    fig.suptitle(f"{benchmark}: score vs compression ratio (95% intervals)")
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def write_leaderboard(records: list[dict], out_dir: str | Path) -> list[Path]:
    """leaderboard_<benchmark>.md, .html and .png for every benchmark in the records; returns the paths (Markdown first)."""
    out = Path(out_dir)
    by_benchmark: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("benchmark"):
            by_benchmark[r["benchmark"]].append(r)
    if not by_benchmark:
        raise ValueError("records must hold benchmark results (a sweep run with --benchmark), got none")
    paths = []
    for benchmark, rows in by_benchmark.items():
        stem = out / f"leaderboard_{benchmark}"
        md, page = stem.with_suffix(".md"), stem.with_suffix(".html")
        md.write_text(markdown_leaderboard(benchmark, rows))
        page.write_text(html_leaderboard(benchmark, rows))
        paths += [md, page, plot_leaderboard(benchmark, rows, stem.with_suffix(".png"))]
    return paths
