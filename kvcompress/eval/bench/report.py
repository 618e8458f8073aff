"""The bench run and its report: `run` measures the chosen sections into CSVs, `report` rewrites bench.md and the PNGs from them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from ..tables import markdown_table, read_csv, write_csv
from .common import machine_description
from .config import SECTIONS, BenchConfig
from .decode import attention_step_rows, check_decode_fits, decode_rows, plot_decode
from .memory import memory_rows, plot_memory
from .overhead import EXPONENT_COLUMNS, exponent_rows, overhead_pivot, overhead_rows, plot_overhead, unfit_reasons
from .prefill import prefill_rows
from .throughput import throughput_rows


def read_machines(out_dir: Path) -> dict[str, str]:
    """{section: the machine line of the run that measured it} from out_dir's machine.txt (one `section: line` per line; a
    line naming no section, as a folder written before sections had their own lines, is every section's)."""
    path = Path(out_dir) / "machine.txt"
    machines: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else ():
        section, named, rest = line.partition(": ")
        if named and section in SECTIONS:
            machines[section] = rest.strip()
        elif line.strip():
            machines.update(dict.fromkeys(SECTIONS, line.strip()))
    return machines


def machine_heading(machines: dict[str, str], sections) -> list[str]:
    """The page's machine paragraph for `sections`: one line when one run measured them all, else one line per section."""
    lines = {section: machines.get(section, "not recorded") for section in sections}
    if len(set(lines.values())) <= 1:
        return [f"Machine: {next(iter(lines.values()), 'not recorded')}."]
    return ["Machines (the sections were measured by different runs):", "", *(f"- {s}: {line}." for s, line in lines.items())]


def write_markdown(path: Path, machines: dict[str, str], overhead=(), exponents=(), decode=(), step=(), memory=(), prefill=(),
                   throughput=()) -> None:
    """One Markdown page with every section that was run; `machines` as `read_machines` gives them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    present = [name for name, rows in zip(("overhead", "decode", "attention", "memory", "prefill", "throughput"),
                                          (overhead, decode, step, memory, prefill, throughput)) if rows]
    path.write_text("\n".join(["# kvcompress bench", "", *machine_heading(machines, present), "",
                               markdown(overhead, exponents, decode, step, memory, prefill, throughput)]), encoding="utf-8")


def markdown(overhead=(), exponents=(), decode=(), step=(), memory=(), prefill=(), throughput=()) -> str:
    """The sections of a bench page for the rows given (each section a `##` heading), without its title and machine line."""
    out = []
    if overhead:
        removed = sorted({float(r["ratio_removed"]) for r in overhead if r.get("ratio_removed") not in (None, "")}) or [0.5]  # 0.5: rows before the column
        out += ["## Compression overhead", "",
                "Time of each method over one exact causal attention pass (SDPA) over the same n tokens "
                f"(min of repeats, synthetic tensors of the shape, {' and '.join(f'{x:.0%}' for x in removed)} of them removed). "
                "`skipped`: a smaller n already took longer than the per-call limit; `n/a`: the method cannot run on the "
                "shape (why follows the shape's tables).", ""]
        for shape in dict.fromkeys(r["shape"] for r in overhead):
            exact = [r for r in overhead if r["shape"] == shape and r["method"] == "exact"]
            out += [f"### {shape}: exact attention seconds", "",
                    markdown_table([{"n": r["n"], "min_s": r.get("min_s", "skipped"), "repeats": r.get("repeats")} for r in exact]), ""]
            for kind in ("compress", "stream"):
                table = overhead_pivot(overhead, shape, kind)
                if table:
                    out += [f"### {shape}: {kind} time / exact attention", "", markdown_table(table), ""]
            unfit = unfit_reasons(overhead, shape)
            out += [*(f"- n/a, {method}: {reason}" for method, reason in unfit.items()), ""] if unfit else []
    if exponents:
        out += ["### Growth exponents (time ≈ c·n^a; ratio ≈ c·n^b)", "",
                markdown_table(exponents, EXPONENT_COLUMNS), ""]
    if prefill:
        out += ["## End to end: `generate` prefill with compression ÷ plain transformers prefill", "",
                f"{prefill[0]['tokens']} tokens of real prose, {prefill[-1]['ratio_removed']:.0%} of the context removed, prefill mode, "
                "the model's own attention. overhead_min: min over repeats ÷ min of the run's plain prefills; overhead_paired: median "
                "over repeats of each run ÷ the plain prefill run just before it; implied_overhead: "
                "1 / (1 − compress_share), the compression share of each method's own prefill (load-robust).", "",
                markdown_table(sorted(prefill, key=lambda r: r["implied_overhead"]),
                               ["method", "runs", "min_s", "median_s", "overhead_min", "overhead_median", "overhead_paired", "compress_min_s", "fused_extra_s",
                                "compress_share", "implied_overhead"]), ""]
    if throughput:
        out += ["## Streaming throughput vs KeyDiff", "",
                f"{throughput[0]['shape']} shape, {throughput[0]['tokens']} tokens in blocks of {throughput[0]['block']}, half kept, no sink or window; "
                "tokens/s from the min of the runs.", "",
                markdown_table(throughput, ["method", "stream", "runs", "min_s", "median_s", "tokens_per_s", "over_keydiff",
                                            *(["skipped"] if any("skipped" in r for r in throughput) else [])]), ""]
    if decode:
        out += ["## Decode speed", "", markdown_table(decode, [*(["model"] if any("model" in r for r in decode) else []), "method", "kept", *(["kept_realised"] if any("kept_realised" in r for r in decode) else []), "context_tokens", "new_tokens", "tokens_per_s", "speedup", "kv_bytes"]), ""]
    if step:
        out += ["## Attention-only decode step", "", markdown_table(step), ""]
    if memory:
        out += [f"## Memory: {' vs '.join(dict.fromkeys(r['mode'] for r in memory))}", "",
                markdown_table(memory, ["mode", "method", "n", "budget", "peak_kv_bytes", "kv_bytes_full", "peak_rss_growth_bytes", "prompt_s"]), ""]
    return "\n".join(out)


def report(out_dir: Path) -> dict:
    """Rewrite bench.md and the PNGs of out_dir from the CSVs (and machine.txt, each section's machine) runs left there;
    for a run of several thread counts (out_dir/threads-<count>/ folders and no CSV of its own), each count's and then
    the page of them all, the counts in increasing order. Returns the rows of every CSV, or {count: those rows} for several counts."""
    out_dir = Path(out_dir)
    results = {name: read_csv(out_dir / f"{name}.csv") for name in SECTIONS if (out_dir / f"{name}.csv").is_file()}
    empty = [f"{name}.csv" for name, rows in results.items() if not rows]
    if empty:
        raise ValueError(f"{', '.join(empty)} in {str(out_dir)!r} holds no rows (a run interrupted before its first row?): rerun "
                         "its section, or remove the file")
    counts = sorted(int(p.name.removeprefix("threads-")) for p in out_dir.glob("threads-*") if p.name.removeprefix("threads-").isdigit())
    if not results and counts:
        by_count = {count: report(out_dir / f"threads-{count}") for count in counts}
        _write_thread_counts_page(out_dir, counts)
        return by_count
    if not results:
        raise ValueError(f"the folder {str(out_dir)!r} holds no bench CSV ({', '.join(SECTIONS)}) and no threads-<count>/ folder of one")
    if "overhead" in results:
        results["exponents"] = exponent_rows(results["overhead"])
        plot_overhead(results["overhead"], out_dir / "overhead.png")
        write_csv(out_dir / "exponents.csv", results["exponents"], EXPONENT_COLUMNS)  # its header even when one size gives no fit
    if "decode" in results or "attention" in results:
        plot_decode(results.get("decode", []), results.get("attention", []), out_dir / "decode.png")
    if "memory" in results:
        plot_memory(results["memory"], out_dir / "memory.png")
    write_markdown(out_dir / "bench.md", read_machines(out_dir), results.get("overhead", ()), results.get("exponents", ()),
                   results.get("decode", ()), results.get("attention", ()), results.get("memory", ()),
                   results.get("prefill", ()), results.get("throughput", ()))
    return results


def run(out_dir: Path, config: BenchConfig, log: Callable[[str], None] = print) -> dict:
    """Run config's sections, writing <section>.csv, machine.txt, bench.md and PNGs into out_dir; returns the rows of every CSV there.

    Synthetic tensors are created on config.device in config.dtype, and the model of the
    prefill/decode/memory sections is loaded in that dtype and moved to that device. Sections
    already in out_dir from an earlier run stay in the report (rerun a section to replace it), each
    with the machine line of the run that measured it (machine.txt: one `section: line` each).
    With several config.threads, everything runs once per torch thread count, each into
    out_dir/threads-<count>/ (its own CSVs, plots and bench.md), then out_dir/bench.md holds every
    count's page in turn; the result is then {count: that run's rows}.
    """
    if len(config.threads) > 1:
        return _run_thread_counts(Path(out_dir), config, log)
    if config.threads:
        torch.set_num_threads(config.threads[0])
    machine = machine_description(torch.get_num_threads(), config.device, config.dtype)
    log(machine)
    out_dir = Path(out_dir)
    results: dict[str, list[dict]] = {}

    written: set[str] = set()  # the sections this run has written a CSV of

    def saver(name: str) -> Callable[[list[dict]], None]:
        def save(rows: list[dict]) -> None:
            write_csv(out_dir / f"{name}.csv", rows)
            written.add(name)

        return save

    out_dir.mkdir(parents=True, exist_ok=True)
    kept = {section: line for section, line in read_machines(out_dir).items() if (out_dir / f"{section}.csv").is_file()}
    _write_machines(out_dir, kept | dict.fromkeys(config.sections, machine))
    sections = set(config.sections)
    model = tokenizer = None
    if {"decode", "memory", "prefill"} & sections:  # loaded first: a decode run the model cannot take is refused before anything runs
        from ...integration import load_model

        model, tokenizer = load_model(config.model, dtype=config.dtype)
        model.to(config.device)
        if "decode" in sections:
            check_decode_fits(model, tokenizer, config)
    try:
        if "overhead" in sections:
            results["overhead"] = overhead_rows(config, log, saver("overhead"))
        if "throughput" in sections:
            results["throughput"] = throughput_rows(config, log)
            saver("throughput")(results["throughput"])
        if "attention" in sections:
            results["attention"] = attention_step_rows(config, log)
            saver("attention")(results["attention"])
        if "prefill" in sections:
            results["prefill"] = prefill_rows(model, tokenizer, config, log, saver("prefill"))
        if "decode" in sections:
            results["decode"] = decode_rows(model, tokenizer, config, log, saver("decode"))
        if "memory" in sections:
            results["memory"] = memory_rows(model, tokenizer, config, log, saver("memory"))
    except BaseException:  # an interrupt or an error part way: the report shows the rows written, not an earlier run's
        _report_what_was_written(out_dir, {section: machine if section in written else kept.get(section) for section in SECTIONS})
        raise
    return report(out_dir)


def _report_what_was_written(out_dir: Path, machines: dict[str, str | None]) -> None:
    """After a run that stopped part way: machine.txt names, for each section with a CSV, the machine `machines` gives
    it (this run's where it wrote the CSV, the earlier run's where the CSV is that run's), and bench.md, the exponents and
    the plots are rebuilt from the CSVs there (left as they are when there is none to rebuild from)."""
    machines = {section: line for section, line in machines.items() if line is not None and (out_dir / f"{section}.csv").is_file()}
    _write_machines(out_dir, machines)
    if machines:  # a section's CSV to rebuild the report from (a run stopped before its first row leaves none)
        report(out_dir)


def _write_machines(out_dir: Path, machines: dict[str, str]) -> None:
    """out_dir/machine.txt: one `section: machine line` per section (`read_machines` reads it back)."""
    (out_dir / "machine.txt").write_text("".join(f"{section}: {line}\n" for section, line in machines.items()), encoding="utf-8")


def _run_thread_counts(out_dir: Path, config: BenchConfig, log: Callable[[str], None]) -> dict[int, dict[str, list[dict]]]:
    """`run` once per count of config.threads, each into out_dir/threads-<count>/, then out_dir/bench.md with every count's page."""
    results = {count: run(out_dir / f"threads-{count}", replace(config, threads=(count,)), log) for count in config.threads}
    _write_thread_counts_page(out_dir, sorted(config.threads))  # the order `report` rebuilds it in
    return results


def _write_thread_counts_page(out_dir: Path, counts) -> None:
    """out_dir/bench.md: the page of each thread count's run (out_dir/threads-<count>/bench.md), in turn."""
    page = [f"# kvcompress bench at {', '.join(map(str, counts))} torch threads", "",
            "One run per thread count, in turn, in one process; each count's CSVs and plots are in threads-<count>/.", ""]
    for count in counts:
        text = (out_dir / f"threads-{count}" / "bench.md").read_text(encoding="utf-8").splitlines()
        page += [f"## {count} thread{'s' if count > 1 else ''}", ""]
        page += ["#" + line if line.startswith("#") else line for line in text[1:]]
    (out_dir / "bench.md").write_text("\n".join(page) + "\n", encoding="utf-8")
