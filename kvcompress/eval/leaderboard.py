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

Score direction: higher is better unless a task's records carry `lower_is_better: True` (the
perplexity task, `eval.perplexity`). Such a task's scores are positive values shown as they are
(not × 100): its cell is the geometric mean over samples with exp of the 95% Student-t interval
of the mean log score (`stats.t_interval`), and an average over such tasks is the geometric mean
of their means (± 1.96·√(Σ se_t²)/T on the log scale). A benchmark whose tasks differ in
direction has no average column. The caption and the plot's axis say which direction holds.
"""

from __future__ import annotations

import html
import math
from collections import defaultdict
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure

from .benchmarks import LONGBENCH_E_BUCKETS
from .plots import figure_legend, mark_errored
from .runner import FULL, cell_label
from .stats import Z95, t_interval, wilson
from .tables import markdown_table

def score_stats(scores: list[float], lower_is_better: bool = False) -> dict:
    """Mean, standard error and 95% interval (fractions in [0, 1]) of per-sample scores; lower_is_better:
    `log_score_stats` (positive scores such as perplexities)."""
    if lower_is_better:
        return log_score_stats(scores)
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


def log_score_stats(scores: list[float]) -> dict:
    """Geometric mean of positive scores (lower is better, e.g. per-document perplexity), exp of the 95% t-interval of
    the mean log score; "se" is the standard error of the mean log score."""
    bad = [s for s in scores if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0)]
    if bad:
        raise ValueError(f"scores of a lower-is-better task must be finite and > 0 (e.g. perplexities), got {bad[:3]}")
    logs = [math.log(s) for s in scores]
    n = len(logs)
    mean, low, high = t_interval(logs)
    se = math.sqrt(sum((v - mean) ** 2 for v in logs) / (n - 1) / n) if n > 1 else float("nan")
    return {"mean": math.exp(mean), "se": se, "low": math.exp(low), "high": math.exp(high), "n": n, "lower_is_better": True}


def _clipped(mean: float, se: float) -> tuple[float, float]:
    """mean -/+ 1.96 se within [0, 1]; NaN bounds when se is unknown (one non-binary sample)."""
    if math.isnan(se):
        return float("nan"), float("nan")
    return max(0.0, mean - Z95 * se), min(1.0, mean + Z95 * se)


def mean_of_tasks(stats: list[dict]) -> dict:
    """Unweighted mean of task means, with the interval from the tasks' standard errors (one task: its own stats)."""
    if len(stats) == 1:
        return stats[0]
    lower = {bool(s.get("lower_is_better")) for s in stats}
    if len(lower) > 1:
        raise ValueError("tasks averaged together must share a score direction: got higher-is-better and lower-is-better tasks")
    if lower == {True}:  # geometric mean, the interval on the log scale
        log_mean = sum(math.log(s["mean"]) for s in stats) / len(stats)
        se = math.sqrt(sum(s["se"] ** 2 for s in stats)) / len(stats)
        return {"mean": math.exp(log_mean), "se": se, "low": math.exp(log_mean - Z95 * se), "high": math.exp(log_mean + Z95 * se),
                "n": sum(s["n"] for s in stats), "lower_is_better": True}
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
    lower = lower_is_better(records)
    mixed = len(set(lower.values())) > 1
    entries = sorted({_entry(r) for r in records}, key=_entry_order)
    cells: dict[tuple, dict | None] = {}
    for entry in entries:
        per_task = {}
        for task in tasks:
            rows = [r for (e, t, _), rs in groups.items() if e == entry and t == task for r in rs]
            per_task[task] = _stats(rows, lower[task])
            cells[(entry, task)] = per_task[task]
        for bucket in buckets:
            in_bucket = [_stats(rs, lower[t]) for (e, t, b), rs in groups.items() if e == entry and b == bucket]
            cells[(entry, bucket)] = _combine([s for s in in_bucket if s is not None], len(in_bucket))
        if not mixed:
            cells[(entry, "average")] = _combine([s for s in per_task.values() if s is not None], len(tasks))
    return [*([] if mixed else ["average"]), *buckets, *tasks], entries, cells


def lower_is_better(records: list[dict]) -> dict[str, bool]:
    """Each task's score direction: lower is better where its records say `lower_is_better` (perplexity), else higher."""
    out: dict[str, bool] = {}
    for r in records:
        out[r["task"]] = out.get(r["task"], False) or bool(r.get("lower_is_better"))
    return out


def _stats(rows: list[dict], lower: bool = False) -> dict | None:
    scores = [r["score"] for r in rows if r["error"] is None]
    if not rows:
        return None
    errors = len(rows) - len(scores)
    return (score_stats(scores, lower) | {"errors": errors}) if scores else {"n": 0, "errors": errors}


def _combine(stats: list[dict], expected: int) -> dict | None:
    """Mean of the task stats; flagged with errors when a task has none or errored cells."""
    ran = [s for s in stats if s["n"]]
    if not ran:
        return {"n": 0, "errors": 1} if stats else None
    errors = sum(s["errors"] for s in stats) + (expected - len(ran))
    return mean_of_tasks(ran) | {"errors": errors}


def _text(cell: dict | None) -> str:
    if cell is None:
        return ""
    if cell["n"] == 0:
        return "n/a"
    flag = "*" if cell["errors"] else ""
    scale, digits = (1, 2) if cell.get("lower_is_better") else (100, 1)
    if math.isnan(cell["low"]):
        return f"{scale * cell['mean']:.{digits}f}{flag} (n={cell['n']}, no interval)"
    return f"{scale * cell['mean']:.{digits}f}{flag} [{scale * cell['low']:.{digits}f}, {scale * cell['high']:.{digits}f}]"


def _table(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    columns, entries, cells = leaderboard(records)
    modes = {e[2] for e in entries if e[0] != FULL}
    head = ["method @ ratio", *columns]
    rows = [[cell_label(*e, modes), *(_text(cells.get((e, c))) for c in columns)] for e in entries]
    return head, rows


def _caption(benchmark: str, records: list[dict]) -> str:
    n_samples = len({(r["task"], r.get("length"), r["index"]) for r in records})
    lower = lower_is_better(records)
    flags = "`*`: some cells could not run (see results.jsonl); n/a: none could."
    if all(lower.values()):
        return (f"{benchmark}: lower is better. Score per sample as it is (perplexity: exp of the mean NLL of a document's scored "
                f"tokens), geometric mean [95% interval: Student t on the log scores, exponentiated] over {n_samples} samples; "
                f"average = geometric mean of the task means. {flags}")
    down = sorted(t for t, v in lower.items() if v)
    note = (f" Lower is better for {', '.join(down)} (shown as is, geometric mean, no average column); higher for the others."
            if down else " Higher is better.")
    return (f"{benchmark}: score × 100 (the benchmark's metric), mean [95% interval] over {n_samples} samples; "
            f"average = mean of the task means.{note} {flags}")


def markdown_leaderboard(benchmark: str, records: list[dict]) -> str:
    """The leaderboard of one benchmark's records as a Markdown table with a caption."""
    head, rows = _table(records)
    table = markdown_table([dict(zip(head, r)) for r in rows], head)
    return "\n".join([f"### {benchmark}", "", table, "", _caption(benchmark, records), ""])


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
    """Score vs compression ratio, one panel per task plus the average, a line with 95% bars per method (and mode, where there are several)."""
    columns, entries, cells = leaderboard(records)
    panels = [c for c in columns if c not in LONGBENCH_E_BUCKETS]  # the average (where there is one) first, then the tasks
    lines = sorted({(e[0], e[2]) for e in entries if e[0] != FULL})
    several_modes = len({mode for _, mode in lines}) > 1
    lower = lower_is_better(records)
    scale, what = (1, "score (lower is better)") if all(lower.values()) else (100, "score × 100")
    colors = matplotlib.colormaps["tab20"].resampled(max(len(lines), 1))
    ncols = min(4, len(panels))
    nrows = -(-len(panels) // ncols)
    fig = Figure(figsize=(4 * ncols, 3.2 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True)
    for ax, panel in zip(axes.flat, panels):
        for i, (method, mode) in enumerate(lines):
            pts = sorted(((e[1], cells[(e, panel)]) for e in entries if e[0] == method and e[2] == mode and cells.get((e, panel)) and cells[(e, panel)]["n"]),
                         key=lambda p: p[0])
            if pts:
                x = [p[0] for p in pts]
                y = [scale * p[1]["mean"] for p in pts]
                err = [[scale * (p[1]["mean"] - p[1]["low"]) for p in pts], [scale * (p[1]["high"] - p[1]["mean"]) for p in pts]]
                ax.errorbar(x, y, yerr=err, marker="o", ms=3, lw=1.2, capsize=2, color=colors(i),
                            label=f"{method} ({mode})" if several_modes else method)
                mark_errored(ax, x, y, [bool(p[1]["errors"]) for p in pts], colors(i))
        full = [cells[(e, panel)] for e in entries if e[0] == FULL and cells.get((e, panel)) and cells[(e, panel)]["n"]]
        if full:
            ax.axhline(scale * full[0]["mean"], color="black", ls="--", lw=1, label="full cache")
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("compression ratio (fraction removed)")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel(what)
    figure_legend(fig, axes)
    fig.suptitle(f"{benchmark}: {what} vs compression ratio (95% intervals)")
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(path, dpi=110)
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
        md.write_text(markdown_leaderboard(benchmark, rows), encoding="utf-8")
        page.write_text(html_leaderboard(benchmark, rows), encoding="utf-8")
        paths += [md, page, plot_leaderboard(benchmark, rows, stem.with_suffix(".png"))]
    return paths
