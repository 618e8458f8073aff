"""PNG plots of sweep and approximation-bench results (matplotlib Figures outside pyplot: the user's backend is left alone)."""

from __future__ import annotations

from pathlib import Path

import matplotlib
from matplotlib.figure import Figure

from .runner import FULL, aggregate, beyond_model
from .tasks import TASKS


# Horizontal offset between methods' points at one ratio (in ratio units), so error bars do not overlap.
_NUDGE = 0.004
# The legend entry of the hollow markers `mark_errored` draws
ERRORED_LABEL = "hollow: some of the point's cells errored (* in the tables)"


def mark_errored(ax, x, y, errored, color) -> None:
    """Hollow markers over the points (x, y) whose cells did not all run (`errored`, one flag per point): the tables'
    `*`, so that a mean over what ran is not read as a mean over everything."""
    points = [(a, b) for a, b, e in zip(x, y, errored) if e]
    if points:
        xs, ys = zip(*points)
        ax.plot(xs, ys, "o", ms=7, mfc="white", mec=color, mew=1.2, ls="none", zorder=3, label=ERRORED_LABEL)


def figure_legend(fig, axes, **kwargs) -> None:
    """One legend below the panels, of every line any panel draws (a method with no point in the first panel
    included), first seen first; the hollow-marker entry in black."""
    from matplotlib.lines import Line2D

    entries: dict[str, object] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if ERRORED_LABEL in entries:
        entries[ERRORED_LABEL] = Line2D([], [], marker="o", ms=7, mfc="white", mec="black", ls="none")
        entries[ERRORED_LABEL] = entries.pop(ERRORED_LABEL)  # last
    if entries:  # none when every cell errored: the panels are empty
        fig.legend(list(entries.values()), list(entries), loc="lower center", ncol=min(7, len(entries)), fontsize=8, **kwargs)


def _grid_of(n: int, cols: int = 4) -> tuple[int, int]:
    cols = min(cols, n)
    return -(-n // cols), cols


def plot_accuracy_vs_ratio(records: list[dict], path: str | Path, mode: str = "prefill") -> Path | None:
    """One panel per task (mean over lengths and samples) plus 'all tasks': score vs compression ratio, a line per method.

    Each point has its 95% Wilson interval as an error bar (points of different methods at one
    ratio are nudged apart so the bars stay readable). The full cache is a dashed horizontal line
    in a grey band (its interval). Tasks in `runner.beyond_model` get a † in their
    title and are left out of 'all tasks', as in the summary table. Returns the path, or None
    when there is nothing to plot.
    """
    rows = [r for r in records if not r["grid"] and (r["mode"] == mode or r["method"] == FULL)]
    hard = beyond_model(rows)
    by_task = aggregate(rows, by=("method", "ratio", "mode", "task"))
    overall = [a | {"task": "all tasks"} for a in aggregate([r for r in rows if r["task"] not in hard], by=("method", "ratio", "mode"))]
    panels = [t for t in TASKS if any(a["task"] == t for a in by_task)] + ["all tasks"]
    if len(panels) == 1:
        return None
    methods = sorted({a["method"] for a in by_task} - {FULL})
    colors = matplotlib.colormaps["tab20"].resampled(max(len(methods), 1))
    nrows, ncols = _grid_of(len(panels))
    fig = Figure(figsize=(4 * ncols, 3.2 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True)
    for ax, panel in zip(axes.flat, panels):
        data = [a for a in by_task + overall if a["task"] == panel and a["n"] > 0]
        for i, method in enumerate(methods):
            pts = sorted((a["ratio"], a["score"], a["ci_low"], a["ci_high"], a["errors"] > 0) for a in data if a["method"] == method)
            if pts:
                x, y, low, high, errored = zip(*pts)
                nudge = (i - (len(methods) - 1) / 2) * _NUDGE
                x = [v + nudge for v in x]
                ax.errorbar(x, y, yerr=[[m - lo for m, lo in zip(y, low)], [hi - m for m, hi in zip(y, high)]],
                            marker="o", ms=3, lw=1.2, elinewidth=0.8, capsize=1.5, color=colors(i), label=method)
                mark_errored(ax, x, y, errored, colors(i))
        full = [a for a in data if a["method"] == FULL]
        if full:
            ax.axhline(full[0]["score"], color="black", ls="--", lw=1, label="full cache")
            ax.axhspan(full[0]["ci_low"], full[0]["ci_high"], color="grey", alpha=0.15, lw=0)
        ax.set_title(panel + (" † (full cache < 90%)" if panel in hard else ""), fontsize=10)
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("compression ratio (fraction removed)")
    return _finish_panels(fig, axes, len(panels), "score", f"Task score vs compression ratio ({mode} mode)", path)


def _finish_panels(fig, axes, n_panels: int, ylabel: str, title: str, path) -> Path:
    """Hide unused panels, label the rows, put one legend below, save and close."""
    for ax in axes.flat[n_panels:]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    figure_legend(fig, axes, bbox_to_anchor=(0.5, -0.02))
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    fig.savefig(path, dpi=110)
    return Path(path)


def plot_needle_heatmaps(records: list[dict], path: str | Path) -> Path | None:
    """Needle grid: one heat-map (context length × depth, colour = score) per method @ ratio (mode)."""
    agg = aggregate(records, grid=True, by=("method", "ratio", "mode", "length", "depth"))
    if not agg:
        return None
    panels = list(dict.fromkeys((a["method"], a["ratio"], a["mode"]) for a in agg))
    lengths = sorted({a["length"] for a in agg})
    depths = sorted({a["depth"] for a in agg})
    nrows, ncols = _grid_of(len(panels), cols=5)
    fig = Figure(figsize=(2.8 * ncols, 2.4 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    image = None
    for ax, (method, ratio, mode) in zip(axes.flat, panels):
        grid = [[float("nan")] * len(depths) for _ in lengths]
        for a in agg:
            if (a["method"], a["ratio"], a["mode"]) == (method, ratio, mode):
                grid[lengths.index(a["length"])][depths.index(a["depth"])] = a["score"]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        modes = {m for name, _, m in panels if name != FULL}
        title = "full cache" if method == FULL else f"{method} @ {ratio:g}" + (f" ({mode})" if len(modes) > 1 else "")
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("needle depth", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("context tokens", fontsize=8)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label="score")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return Path(path)


def plot_approx(rows: list[dict], path: str | Path) -> Path | None:
    """Relative attention error vs compression ratio, one panel per layer, a line per method, error bars over seeds."""
    if not rows:
        return None
    layers = sorted({r["layer"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    colors = matplotlib.colormaps["tab20"].resampled(max(len(methods), 1))
    nrows, ncols = _grid_of(len(layers))
    fig = Figure(figsize=(4 * ncols, 3.2 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True)
    for ax, layer in zip(axes.flat, layers):
        for i, method in enumerate(methods):
            pts = sorted((r["ratio"], r["error_mean"], r["error_std"]) for r in rows if r["layer"] == layer and r["method"] == method)
            x, y, e = zip(*pts)
            ax.errorbar(x, y, yerr=e, marker="o", ms=3, lw=1.2, capsize=2, color=colors(i), label=method)
        ax.set_title(f"layer {layer}", fontsize=10)
        ax.set_xlabel("compression ratio of the middle")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    title = f"Attention approximation error on real q/k/v ({rows[0]['tokens']} tokens)"
    return _finish_panels(fig, axes, len(layers), "relative error", title, path)


def plot_sweep(records: list[dict], out_dir: str | Path) -> list[Path]:
    """Every plot of a sweep: accuracy_vs_ratio_<mode>.png per mode and needle_heatmap.png."""
    out = Path(out_dir)
    modes = sorted({r["mode"] for r in records if r["method"] != FULL})
    paths = [plot_accuracy_vs_ratio(records, out / f"accuracy_vs_ratio_{mode}.png", mode) for mode in modes]
    paths.append(plot_needle_heatmaps(records, out / "needle_heatmap.png"))
    return [p for p in paths if p is not None]
