"""The task sweep: methods × compression ratios × modes × tasks × lengths × samples on one model.

Each sample (task, length, index, depth) is generated offline (`eval.tasks`), chat-formatted
(`integration.build_prompt`) and answered greedily by `integration.generate_ids` for the full
cache and for every (method, ratio, mode) cell. In prefill mode the context is prefilled once
(`eval.capture.capture_qkv`) and that recorded prefill is compressed by every method and ratio,
each on its own copy (`generate_ids(prefill=...)`), so M methods cost one context prefill per
sample instead of M; the full cache answers from the same record with every token kept.
`reuse_prefill=False` re-prefills per cell (for the speed-up measurement). Decoding stops at the
sample's answer limit, its stop strings or EOS (`Sample.max_new_tokens`, `Sample.stop`).

Results are appended to `results.jsonl` in the output directory, one line per cell, flushed as
they are produced; a rerun with the same directory skips every cell already recorded, so an
interrupted sweep continues where it stopped. `summarize` turns the records into
`summary.csv` / `summary.md`, and `eval.plots` into PNGs.

A cell whose method cannot run at that size (e.g. its seed's sink + window exceed the tokens a
ratio keeps) is recorded with its error message and no score, and shown as such in the summary.
"""

from __future__ import annotations

import csv
import inspect
import json
import math
import platform
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..cache import MODES
from ..methods.base import method_names
from .capture import capture_qkv
from .prefill_replay import full_as_ratio_zero
from .stats import paired_comparisons, wilson
from .stopping import stop_token_ids
from .tasks import GENERATORS, HAYSTACKS, Sample, TASKS, generate_sample, score

FULL = "full"
# Methods built from other methods: compared with the best single method, never chosen as it.
COMPOSED = ("hybrid",)
# A task counts as a compression result only where the full cache scores at least this.
FULL_CACHE_BAR = 0.9
# Generator arguments the sweep sets itself (not settable through task_params).
_SWEEP_ARGUMENTS = ("target_tokens", "seed", "tokenizer", "depth")
RESULTS_FILE = "results.jsonl"
DEFAULT_TASKS = TASKS
DEFAULT_RATIOS = (0.5, 0.75, 0.9)
DEFAULT_LENGTHS = (2048, 4096)


@dataclass
class SweepConfig:
    """What a sweep runs. methods None means every registered method; lengths are context tokens.

    samples: samples per (task, length); tasks that take a depth place sample i at
    `sample_depth(i)`. grid_lengths × grid_depths: the needle heat-map (task `grid_task`, one
    sample per cell, compressed at `grid_ratios`). max_new_tokens None uses each sample's own limit
    (`Sample.max_new_tokens`); decoding also stops at the sample's stop strings and at EOS.
    """

    methods: list[str] | None = None
    ratios: list[float] = field(default_factory=lambda: list(DEFAULT_RATIOS))
    modes: list[str] = field(default_factory=lambda: ["prefill"])
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    lengths: list[int] = field(default_factory=lambda: list(DEFAULT_LENGTHS))
    samples: int = 4
    seed: int = 0
    haystack: str = "filler"
    kind: str = "numbers"
    grid_task: str = "niah_single"
    grid_lengths: list[int] = field(default_factory=list)
    grid_depths: list[float] = field(default_factory=list)
    grid_ratios: list[float] = field(default_factory=list)
    include_full: bool = True
    reuse_prefill: bool = True
    max_new_tokens: int | None = None
    chunk_size: int = 128
    task_params: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self):
        if self.methods is None:
            self.methods = method_names()
        known = set(method_names())
        for name, values, allowed in (
            ("methods", self.methods, known),
            ("modes", self.modes, set(MODES)),
            ("tasks", self.tasks, set(TASKS)),
        ):
            bad = [v for v in values if v not in allowed]
            if bad:
                raise ValueError(f"{name} must be among {sorted(allowed)}, got {bad}")
        if self.grid_task not in GENERATORS or "depth" not in inspect.signature(GENERATORS[self.grid_task]).parameters:
            raise ValueError(f"grid_task must be a task with a depth, got {self.grid_task!r}")
        for r in list(self.ratios) + list(self.grid_ratios):
            if not 0.0 <= r < 1.0:
                raise ValueError(f"ratios must lie in [0, 1), got {r}")
        for n in list(self.lengths) + list(self.grid_lengths):
            if n < 64:
                raise ValueError(f"lengths must be >= 64 tokens, got {n}")
        for d in self.grid_depths:
            if not 0.0 <= d <= 1.0:
                raise ValueError(f"grid depths must lie in [0, 1], got {d}")
        if bool(self.grid_lengths) != bool(self.grid_depths):
            raise ValueError("grid_lengths and grid_depths go together: pass both or neither")
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.haystack not in HAYSTACKS:
            raise ValueError(f"haystack must be one of {HAYSTACKS}, got {self.haystack!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for task, params in self.task_params.items():
            if task not in GENERATORS:
                raise ValueError(f"task_params: task must be one of {TASKS}, got {task!r}")
            allowed = set(inspect.signature(GENERATORS[task]).parameters) - set(_SWEEP_ARGUMENTS)
            bad = sorted(set(params) - allowed)
            if bad:
                raise ValueError(f"task_params[{task!r}]: parameters must be among {sorted(allowed)}, got {bad}")

    def params_of(self, task: str) -> tuple:
        """The task's `task_params` as sorted (name, value) pairs (hashable, part of the cell key)."""
        return tuple(sorted(self.task_params.get(task, {}).items()))


@dataclass(frozen=True)
class SampleSpec:
    """One generated sample: which task, length, index and (for depth tasks) depth."""

    task: str
    length: int
    index: int
    depth: float | None
    grid: bool = False
    params: tuple = ()

    def build(self, config: SweepConfig, tokenizer) -> Sample:
        params = inspect.signature(GENERATORS[self.task]).parameters
        kwargs = {"target_tokens": self.length, "seed": config.seed + self.index, "tokenizer": tokenizer}
        if self.depth is not None:
            kwargs["depth"] = self.depth
        for name in ("haystack", "kind"):
            if name in params:
                kwargs[name] = getattr(config, name)
        kwargs.update(self.params)
        return generate_sample(self.task, **kwargs)


@dataclass(frozen=True)
class Cell:
    """One answer to produce: a sample under a method (FULL for the full cache), ratio and mode."""

    sample: SampleSpec
    method: str
    ratio: float | None
    mode: str

    @property
    def key(self) -> str:
        s = self.sample
        task = s.task + "".join(f";{k}={v}" for k, v in s.params)
        return f"{'grid' if s.grid else 'task'}|{task}|{s.length}|{s.index}|{s.depth}|{self.method}|{self.ratio}|{self.mode}"


def sample_depth(index: int) -> float:
    """Depth of sample `index` for tasks that take one: 0.5, then a golden-ratio sequence that spreads
    over [0, 1] and does not depend on how many samples the sweep has (so a sweep can be extended)."""
    return round((0.5 + index * 0.6180339887498949) % 1.0, 3)


def sample_specs(config: SweepConfig) -> list[SampleSpec]:
    """Every sample of the sweep, sample-major (a partial run covers every task and length), then the needle grid."""
    specs = []
    for i in range(config.samples):
        for length in config.lengths:
            for task in config.tasks:
                takes_depth = "depth" in inspect.signature(GENERATORS[task]).parameters
                specs.append(SampleSpec(task, length, i, sample_depth(i) if takes_depth else None, params=config.params_of(task)))
    for i, length in enumerate(config.grid_lengths):
        for j, depth in enumerate(config.grid_depths):
            specs.append(SampleSpec(config.grid_task, length, i * len(config.grid_depths) + j, depth, grid=True,
                                    params=config.params_of(config.grid_task)))
    return specs


def cells_for(spec: SampleSpec, config: SweepConfig) -> list[Cell]:
    """The full cache (once) and every method × ratio × mode for one sample."""
    ratios = config.grid_ratios if spec.grid else config.ratios
    cells = [Cell(spec, FULL, None, "-")] if config.include_full else []
    cells += [Cell(spec, m, r, mode) for mode in config.modes for m in config.methods for r in ratios]
    return cells


def read_results(path: Path) -> list[dict]:
    """Records of a results JSONL file; a line cut short by an interruption is ignored."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _answer(model, cell: Cell, context_ids, question_ids, captured, config: SweepConfig, max_new: int, stop_ids):
    """The cell's generation; the full cache is answered from the recorded prefill when there is one
    (every token kept exactly, `prefill_replay.full_as_ratio_zero`), so it costs no second prefill."""
    from ..integration import generate_ids

    if cell.method == FULL and captured is None:
        return generate_ids(model, context_ids, question_ids, method=None, max_new_tokens=max_new, stop_token_ids=stop_ids)
    if cell.method == FULL:
        method, ratio = full_as_ratio_zero(None, 0.0)
        return generate_ids(model, context_ids, question_ids, method=method, compression_ratio=ratio, prefill=captured,
                            max_new_tokens=max_new, stop_token_ids=stop_ids)
    size = {"compression_ratio": cell.ratio} if cell.mode == "prefill" else {"budget": _stream_budget(cell, context_ids.shape[1])}
    return generate_ids(
        model, context_ids, question_ids, method=cell.method, mode=cell.mode, max_new_tokens=max_new,
        seed=config.seed, chunk_size=config.chunk_size, prefill=captured if cell.mode == "prefill" else None,
        stop_token_ids=stop_ids, **size,
    )


def _stream_budget(cell: Cell, n_context: int) -> int:
    """Chunked/decode modes take a budget: the middle budget the ratio gives in prefill mode."""
    from ..api import default_sink_window
    from ..methods.base import resolve_budget

    sink, window = default_sink_window(cell.method, None, None)
    return resolve_budget(n_context, None, cell.ratio, sink, window)


def run_sweep(model, tokenizer, config: SweepConfig, out_dir: str | Path, progress: bool = True, model_name: str = "") -> list[dict]:
    """Run every cell not yet in `out_dir/results.jsonl`, appending one record per cell; return all records.

    Writes `out_dir/config.json` (the config, model name, host, start time) on every run.
    """
    from ..integration import build_prompt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS_FILE
    done = {r["key"] for r in read_results(path)}
    meta = {"config": asdict(config), "model": model_name, "host": platform.node(), "threads": torch.get_num_threads(),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    (out / "config.json").write_text(json.dumps(meta, indent=1))
    specs = sample_specs(config)
    todo = {spec: [c for c in cells_for(spec, config) if c.key not in done] for spec in specs}
    bar = tqdm(total=sum(map(len, todo.values())), desc="eval", unit="cell", disable=not progress)
    torn = path.is_file() and not path.read_bytes().endswith(b"\n") and path.stat().st_size > 0
    with path.open("a") as f:
        if torn:
            f.write("\n")
        for spec, cells in todo.items():
            if not cells:
                continue
            sample = spec.build(config, tokenizer)
            context_ids, question_ids = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
            max_new = config.max_new_tokens or sample.max_new_tokens
            stop_ids = stop_token_ids(tokenizer, sample.stop)
            captured, capture_s = None, 0.0
            if config.reuse_prefill and any(c.mode == "prefill" or c.method == FULL for c in cells):
                start = time.perf_counter()
                captured = capture_qkv(model, context_ids)
                capture_s = time.perf_counter() - start
            for cell in cells:
                record = _record(cell, sample, context_ids, capture_s)
                start = time.perf_counter()
                try:
                    res = _answer(model, cell, context_ids, question_ids, captured, config, max_new, stop_ids)
                except (ValueError, RuntimeError) as err:
                    record["error"] = f"{type(err).__name__}: {err}"
                    bar.write(f"[{cell.key}] {record['error']}")
                else:
                    prediction = tokenizer.decode(res.token_ids, skip_special_tokens=True).strip()
                    record.update(
                        prediction=prediction, score=score(sample, prediction), kv_bytes=res.kv_bytes, kv_bytes_full=res.kv_bytes_full,
                        prefill_s=res.prefill_seconds, compress_s=res.compress_seconds, decode_s=res.decode_seconds,
                        new_tokens=len(res.token_ids),
                    )
                record["wall_s"] = time.perf_counter() - start
                f.write(json.dumps(record) + "\n")
                f.flush()
                bar.update(1)
    bar.close()
    return read_results(path)


def _record(cell: Cell, sample: Sample, context_ids, capture_s: float) -> dict:
    s = cell.sample
    return {
        "key": cell.key, "grid": s.grid, "task": s.task, "length": s.length, "index": s.index, "depth": s.depth,
        "measured_depth": sample.depth, "context_tokens": int(context_ids.shape[1]), "method": cell.method,
        "ratio": cell.ratio, "mode": cell.mode, "answers": sample.answers, "prediction": None, "score": None,
        "error": None, "capture_s": capture_s if cell.method == FULL or cell.mode == "prefill" else 0.0,
    }


def _rows(records: list[dict], grid: bool) -> Iterator[dict]:
    return (r for r in records if r["grid"] == grid)


def _mean_sem(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def aggregate(records: list[dict], grid: bool = False, by: tuple[str, ...] = ("method", "ratio", "mode", "task", "length")) -> list[dict]:
    """Mean score, its standard error and 95% Wilson interval (ci_low, ci_high) per group of `by`,
    with the count of errored cells and the mean wall time per answered cell."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in _rows(records, grid):
        groups[tuple(r[k] for k in by)].append(r)
    out = []
    for key, rs in groups.items():
        answered = [r for r in rs if r["error"] is None]
        scores = [r["score"] for r in answered]
        mean, sem = _mean_sem(scores) if scores else (float("nan"), float("nan"))
        low, high = wilson(sum(scores), len(scores))
        wall = sum(r["wall_s"] for r in answered) / len(answered) if answered else float("nan")
        out.append(dict(zip(by, key)) | {"n": len(scores), "errors": len(rs) - len(scores), "score": mean, "sem": sem,
                                         "ci_low": low, "ci_high": high, "wall_s": wall})
    return sorted(out, key=_order)


def _order(row: dict) -> tuple:
    """Full cache first, then by method, ratio, mode, task (in TASKS order), length, depth."""
    task = row.get("task")
    return (row["method"] != FULL, row["method"], row.get("ratio") or 0.0, row.get("mode", ""),
            TASKS.index(task) if task else 0, row.get("length", 0), row.get("depth") or 0.0)


def _fmt(row: dict | None) -> str:
    """Score % with its 95% Wilson interval, e.g. `83 (66–93)`."""
    if row is None:
        return ""
    if row["n"] == 0:
        return "n/a"
    return f"{100 * row['score']:.0f} ({100 * row['ci_low']:.0f}–{100 * row['ci_high']:.0f})" + ("*" if row["errors"] else "")


def _label(method: str, ratio, mode: str, modes: list[str]) -> str:
    if method == FULL:
        return "full cache"
    label = f"{method} @ {ratio:g}"
    return label + (f" ({mode})" if len(modes) > 1 else "")


def beyond_model(records: list[dict]) -> list[str]:
    """Tasks whose full-cache score is below FULL_CACHE_BAR: too hard for the model, so their
    compressed scores say nothing about compression (left out of the summary's averages)."""
    full = aggregate(records, by=("method", "task"))
    return [a["task"] for a in full if a["method"] == FULL and a["n"] and a["score"] < FULL_CACHE_BAR]


def markdown_table(records: list[dict]) -> str:
    """Task-sweep scores (%, with 95% Wilson intervals) per method@ratio: one column per task (mean over
    lengths) and per length (mean over tasks). Tasks in `beyond_model` are marked † and left out of the
    per-length and "all" columns."""
    rows = [r for r in _rows(records, False)]
    if not rows:
        return ""
    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    lengths = sorted({r["length"] for r in rows})
    modes = sorted({r["mode"] for r in rows if r["method"] != FULL})
    hard = beyond_model(records)
    kept = [r for r in records if r["task"] not in hard]
    by_task = {(a["method"], a["ratio"], a["mode"], a["task"]): a for a in aggregate(records, by=("method", "ratio", "mode", "task"))}
    by_len = {(a["method"], a["ratio"], a["mode"], a["length"]): a for a in aggregate(kept, by=("method", "ratio", "mode", "length"))}
    overall = {(a["method"], a["ratio"], a["mode"]): a for a in aggregate(kept, by=("method", "ratio", "mode"))}
    head = ["method @ ratio"] + [t + ("†" if t in hard else "") for t in tasks] + [f"{n} tok" for n in lengths] + ["all"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in aggregate(records, by=("method", "ratio", "mode")):
        k = (a["method"], a["ratio"], a["mode"])
        cells = [_fmt(by_task.get(k + (t,))) for t in tasks] + [_fmt(by_len.get(k + (n,))) for n in lengths] + [_fmt(overall.get(k))]
        lines.append("| " + " | ".join([_label(*k, modes)] + cells) + " |")
    if hard:
        lines += ["", f"† full cache below {FULL_CACHE_BAR:.0%}: the task is beyond this model, so it is not a compression "
                  "result; it is left out of the per-length and \"all\" columns."]
    return "\n".join(lines)


def paired_table(records: list[dict]) -> str:
    """Each method against the best single method of its (ratio, mode, task) on the same samples (exact sign test)."""
    singles = sorted({r["method"] for r in records} - {FULL, *COMPOSED})
    rows = paired_comparisons(records, singles)
    if not rows:
        return ""
    modes = sorted({r["mode"] for r in rows})
    head = ["method @ ratio", "task", "best single method", "pairs", "method %", "best %", "wins", "losses", "p (sign test)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (r["ratio"], r["mode"], TASKS.index(r["task"]), r["method"] not in COMPOSED, r["method"])):
        lines.append("| " + " | ".join([
            _label(r["method"], r["ratio"], r["mode"], modes), r["task"], r["baseline"], str(r["n_pairs"]),
            f"{100 * r['method_score']:.0f}", f"{100 * r['baseline_score']:.0f}", str(r["wins"]), str(r["losses"]), f"{r['p']:.3g}",
        ]) + " |")
    return "\n".join(lines)


def wall_table(records: list[dict]) -> str:
    """Mean wall time, decode time and decoded tokens per answered cell, per task and length (full cache apart)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in _rows(records, False):
        if r["error"] is None:
            groups[(r["task"], r["length"], r["method"] == FULL)].append(r)
    if not groups:
        return ""
    lines = ["| task | tokens | cells | wall s | decode s | decoded tokens |", "|---|---|---|---|---|---|"]
    for (task, length, full), rs in sorted(groups.items(), key=lambda kv: (TASKS.index(kv[0][0]), kv[0][1], not kv[0][2])):
        tokens = [r["new_tokens"] for r in rs if "new_tokens" in r]
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        lines.append(f"| {task}{' (full cache)' if full else ''} | {length} | {len(rs)} | {mean([r['wall_s'] for r in rs]):.2f} | "
                     f"{mean([r['decode_s'] for r in rs]):.2f} | {f'{mean(tokens):.1f}' if tokens else 'not recorded'} |")
    return "\n".join(lines)


def heatmap_table(records: list[dict]) -> str:
    """Needle-grid scores (%) per method@ratio and length, one column per depth."""
    agg = aggregate(records, grid=True, by=("method", "ratio", "mode", "length", "depth"))
    if not agg:
        return ""
    depths = sorted({a["depth"] for a in agg})
    modes = sorted({a["mode"] for a in agg if a["method"] != FULL})
    table: dict[tuple, dict] = defaultdict(dict)
    for a in agg:
        table[(a["method"], a["ratio"], a["mode"], a["length"])][a["depth"]] = a
    head = ["method @ ratio", "tokens"] + [f"depth {d:g}" for d in depths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (method, ratio, mode, length), row in table.items():
        lines.append("| " + " | ".join([_label(method, ratio, mode, modes), str(length)] + [_fmt(row.get(d)) for d in depths]) + " |")
    return "\n".join(lines)


def write_summary(records: list[dict], out_dir: str | Path) -> tuple[Path, Path]:
    """`summary.csv` (one row per method, ratio, mode, task, length; and the grid cells) and `summary.md`."""
    out = Path(out_dir)
    csv_path, md_path = out / "summary.csv", out / "summary.md"
    fields = ["kind", "method", "ratio", "mode", "task", "length", "depth", "n", "errors", "score", "sem", "ci_low", "ci_high", "wall_s"]
    with csv_path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for kind, grid, by in (("task", False, ("method", "ratio", "mode", "task", "length")),
                               ("grid", True, ("method", "ratio", "mode", "task", "length", "depth"))):
            for row in aggregate(records, grid=grid, by=by):
                w.writerow({"kind": kind, "depth": ""} | row)
    captures = {(r["grid"], r["task"], r["length"], r["index"], r["depth"]): r["capture_s"] for r in records}
    wall = sum(r["wall_s"] for r in records) + sum(captures.values())
    n_err = sum(r["error"] is not None for r in records)
    parts = [f"{len(records)} cells ({n_err} could not run), {wall / 3600:.2f} h of recorded wall time "
             f"(context captures {sum(captures.values()) / 3600:.2f} h).", ""]
    table = markdown_table(records)
    if table:
        parts += ["### Task scores (%, 95% Wilson interval)", "", table, ""]
    paired = paired_table(records)
    if paired:
        parts += ["### Paired comparison with the best single method (same samples)", "",
                  "wins / losses: samples where the method scores above / below the best single method of its "
                  "ratio and task (the one with the highest mean there); p: exact two-sided sign test "
                  "(McNemar's exact test for 0/1 scores).", "", paired, ""]
    walls = wall_table(records)
    if walls:
        parts += ["### Wall time per cell (s, mean over answered cells; decoded tokens)", "", walls, ""]
    grid = heatmap_table(records)
    if grid:
        parts += ["### Needle grid (%)", "", grid, ""]
    if any(r["error"] for r in records):
        parts += ["`*`: some cells of this entry could not run (the error is in results.jsonl); `n/a`: none could.", ""]
    md_path.write_text("\n".join(parts))
    return csv_path, md_path
