"""The results report: docs/results.md, and the README's summary block when the README has its markers, are byte for
byte what `benchmarks/report.py` writes from the committed records; the records it reads are all that `results/` and
`benchmarks/results/` keep, at most MAX_RECORD_FILES files, none named after a session or a run date. No model is loaded."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RECORD_TREES = ("results", "benchmarks/results")
RUN_METADATA = {"results/runs.json", "benchmarks/results/runs.json"}
# the records stay few: five held-out sets at two lengths and four layouts take 130 of them, the sixth's two folders 7,
# the tuning records at 0.9's bytes 2
MAX_RECORD_FILES = 273


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("report", REPO / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["report"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def page(report):
    return report.results_page()


def record_files() -> list[str]:
    """The files under results/ and benchmarks/results/ that git tracks or would track (every file there without git)."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *RECORD_TREES], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
        return sorted({f for f in out.split() if (REPO / f).is_file()})
    except (OSError, subprocess.CalledProcessError):
        return [p.relative_to(REPO).as_posix() for tree in RECORD_TREES for p in (REPO / tree).rglob("*") if p.is_file()]


def test_results_page_is_what_the_report_writes_from_the_records(page):
    committed = (REPO / "docs" / "results.md").read_text(encoding="utf-8")
    assert committed == page, "docs/results.md differs from what the records give: run `.venv/bin/python benchmarks/report.py`"


def test_readme_summary_block_is_what_the_report_writes(report, page):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    if report.SUMMARY_START not in readme:
        pytest.skip("README.md has no report:summary markers yet")
    assert report.SUMMARY_END in readme
    assert readme == report.readme_text(readme), "README.md's summary block is stale: run `.venv/bin/python benchmarks/report.py`"


def test_readme_block_is_replaced_between_the_markers_only(report, page):
    text = f"# x\n\nbefore\n{report.SUMMARY_START}\nold table\n{report.SUMMARY_END}\nafter\n"
    out = report.readme_text(text)
    assert out.startswith(f"# x\n\nbefore\n{report.SUMMARY_START}\n") and out.endswith(f"{report.SUMMARY_END}\nafter\n")
    assert "old table" not in out and report.summary_table() in out
    assert report.readme_text(out) == out
    assert report.readme_text("# no markers\n") == "# no markers\n"


def test_every_table_states_its_command_machine_threads_dates_and_n(page):
    """Each run block names its records, machine, torch threads, dates, n and at least one command line."""
    blocks = re.findall(r"^- Records: .+\n- Machine: (.+)\n- Torch threads: (.+)\n- Dates: (.+)\n- n: (.+)\n- Command:\n\n(?:      \S.*\n)+",
                        page, re.M)
    assert len(blocks) == page.count("\n- Records: ") >= 25
    for machine, threads, dates, n in blocks:
        assert machine.strip() and "None" not in machine and re.fullmatch(r"\d+(, \d+)*", threads) and n.strip()
        assert re.fullmatch(r"20\d\d-\d\d-\d\d( to 20\d\d-\d\d-\d\d)?", dates), dates


def test_the_records_are_those_the_report_reads_and_few(report, page):
    files = record_files()
    assert files and len(files) <= MAX_RECORD_FILES, f"{len(files)} record files; at most {MAX_RECORD_FILES}"
    cited = {c.rstrip("/") for c in report.CITED}
    unread = [f for f in files if f not in RUN_METADATA and not any(f == c or f.startswith(c + "/") for c in cited)]
    assert not unread, f"records no table of the report reads: {unread}"
    missing = [c for c in cited if not (REPO / c).exists()]
    assert not missing, f"the report names records that are not there: {missing}"


def test_no_record_is_named_after_a_session_or_a_date():
    dated = [f for f in record_files() if re.search(r"session|20\d\d-?\d\d-?\d\d", f, re.I)]
    assert not dated, dated


def test_bulky_records_are_compressed():
    big = [f for f in record_files() if (REPO / f).stat().st_size > 512 * 1024 and not f.endswith(".gz")]
    assert not big, f"records over 512 KiB should be gzip-compressed (the readers read .gz): {big}"


def test_links_from_the_docs_into_the_report_land_on_a_heading(report, page):
    anchors = {report._anchor(line.lstrip("#").strip()) for line in page.splitlines() if line.startswith("#")}
    links = [(doc.name, anchor) for doc in sorted((REPO / "docs").glob("*.md"))
             for anchor in re.findall(r"\(results\.md#([\w-]+)\)", doc.read_text(encoding="utf-8"))]
    assert links
    broken = [link for link in links if link[1] not in anchors]
    assert not broken, broken


def _record(cell, ratio, sample, score, threads=1):
    return {"library": "kvcompress", "cell": cell, "ratio": ratio, "sample": sample, "score": score,
            "env": {"threads": threads, "date": "2026-12-06T00:00:00"}}


def test_a_cell_run_on_the_full_caches_hits_only_is_shown_with_its_flag_and_without_the_full_cache(report):
    manifest = {"samples": {"task": "niah_prose", "length": 2048, "count": 4, "seed": 7000}}
    records = [_record("full", None, f"s{i}", score) for i, score in enumerate((1.0, 0.0, 1.0, 1.0))]
    records += [_record("knorm", r, f"s{i}", 1.0) for i in (0, 2) for r in (0.5, 0.75)]  # hits only, one not reached
    records += [_record("snapkv", 0.5, f"s{i}", 0.0) for i in range(4)]  # every sample
    commands = report.harness_commands("results/x", manifest, records)
    assert commands[1:] == [
        ".venv/bin/python benchmarks/kvpress_side_by_side.py kvcompress --out results/x --threads 1 --ratios 0.5 --cells 'full,snapkv'",
        ".venv/bin/python benchmarks/kvpress_side_by_side.py kvcompress --out results/x --threads 1 --ratios 0.5,0.75 "
        "--full-cache-hits --cells 'knorm'"]
    alone = report.harness_commands("results/x", manifest, [r for r in records if r["cell"] != "snapkv"])
    assert alone[1:] == [".venv/bin/python benchmarks/kvpress_side_by_side.py kvcompress --out results/x --threads 1 --cells 'full'",
                         ".venv/bin/python benchmarks/kvpress_side_by_side.py kvcompress --out results/x --threads 1 --ratios 0.5,0.75 "
                         "--full-cache-hits --cells 'knorm'"]


def test_quality_bars_say_shown_met_at_point_level_missed_or_not_run(report):
    hits = 60
    records = [_record("full", None, f"s{i}", float(i < hits)) for i in range(100)]
    kept = {(report.DEFAULT_CELL, 0.75): 60, (report.CHUNKED_CELL, 0.75): 52, (report.DECODE_CELL, 0.75): 50}  # prefill at 0.9 not run
    for (cell, ratio), n in kept.items():
        records += [_record(cell, ratio, f"s{i}", float(i < n)) for i in range(hits)]
    table = "\n".join(report.quality_bars(report.scores_by_cell(records)))
    assert "| the default, prefill | 0.75 | ≥ 90 % | 60 of 60: 100 (94–100) | shown |" in table
    assert "| the default, chunked | 0.75 | ≥ 85 % | 52 of 60: 87 (76–93) | met at point level |" in table
    assert "| the default, decode | 0.75 | ≥ 85 % | 50 of 60: 83 (72–91) | missed |" in table
    assert "| the default, prefill | 0.9 | ≥ 85 % | not run | – |" in table


def test_shared_misses_names_the_full_caches_hits_a_variant_misses_and_who_else_misses_them(report):
    by_cell = {("full", "prefill", 0.0): {"1": 1.0, "2": 1.0, "3": 0.0, "4": 1.0},
               ("base", "prefill", 0.9): {"1": 0.0, "2": 1.0, "3": 0.0, "4": 0.0},  # 3 is no hit of the full cache
               ("wide", "prefill", 0.9): {"1": 0.0, "2": 0.0, "4": 1.0},
               ("pooled", "prefill", 0.9): {"1": 1.0}}  # answered needle 1 only
    assert report.shared_misses(by_cell, "base") == ("The full cache's hits `base` misses, each with how many of the other "
                                                     "variants that answered it miss it too: 1 (1 of 2), 4 (0 of 1).")
    assert report.shared_misses(by_cell, "pooled").endswith("miss it too: none.")
