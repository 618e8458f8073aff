"""Every script of benchmarks/ run once, end to end, on the real default model.

No other test runs the scripts themselves (tests/test_benchmarks.py imports a few of their functions), and several
broke silently in the past. Each script of SCRIPT_RUNS runs as a subprocess on its smallest meaningful arguments (short
contexts, one or two samples or seeds, one ratio, one thread) in a copy of the repository, so that nothing it writes
lands in the real tree: it must exit 0 and write (anew, in the copy) the files EXPECTED_OUTPUTS names for it. NOT_RUN
holds the scripts that cannot run here, each with the reason. A unit test checks that every script with an entry point
is in exactly one of the two, so a new script has to be added to one.

    .venv/bin/python -m pytest -q -m e2e tests/test_benchmark_runs.py
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CELL = "adakv[scorer=kvzap,scope=model,alpha=0.05,kv_bits=auto,budget_unit=memory]"  # the prefill default, as benchmarks/kvpress_side_by_side.py names it
DUMP = "runthrough/dump"  # a one-sample dump of benchmarks/kvpress_side_by_side.py, made in the copy (SETUP_RUNS)


def tuning_needle_run(name: str, *extra: str) -> tuple[str, ...]:
    """A tuning needle script's arguments: tuning seed 1000 alone at 1024 tokens and ratio 0.9 (it keeps too few of 512
    for the exact window), one thread, its record at runthrough/NAME.jsonl."""
    return ("--out", f"runthrough/{name}.jsonl", "--lengths", "1024", "--seeds", "1000", "--ratio", "0.9", *extra, "--threads", "1")


# script (relative to the repository root) -> its arguments; relative paths are the copy's (the run's working directory)
SCRIPT_RUNS: dict[str, tuple[str, ...]] = {
    "benchmarks/answer_margin.py": (
        "--out", "results/kvpress_side_by_side_prose", "--sample-indices", "0", "--cells", "keydiff", "--ratios", "0.75",
        "--threads", "1"),
    "benchmarks/answer_stopping.py": ("--samples", "1", "--methods", "keydiff", "--threads", "1"),
    # two seeds: the table gives a standard deviation over them
    "benchmarks/balancekv_attention_error.py": (
        "--tokens", "512", "--prompts", "1", "--seeds", "2", "--sink", "64", "--window", "64", "--layers", "1", "--ratios", "0.75"),
    "benchmarks/cli_startup.py": ("--runs", "1"),
    "benchmarks/compactor_ablation.py": (
        "--tokens", "256", "--samples", "1", "--tasks", "niah_single", "--kept", "0.5", "--max-new-tokens", "8", "--threads", "1"),
    "benchmarks/compactor_kvpress_departures.py": ("--out", DUMP, "--ratio", "0.5", "--threads", "1"),
    "benchmarks/default_cost.py": (
        "--lengths", "256", "--methods", "default", "--modes", "prefill", "--new-tokens", "2", "--repeats", "1", "--warmup", "0",
        "--threads", "1", "--out", "runthrough/default_cost.csv"),
    "benchmarks/eval_prefill_reuse.py": ("--methods", "knorm", "--length", "512", "--samples", "1", "--max-new-tokens", "4", "--threads", "1"),
    # 1024 tokens: the stream's checkpoints (part B) start at 512
    "benchmarks/express_attention_error.py": ("--tokens", "1024", "--layers", "2", "--seeds", "1", "--budgets", "128"),
    # 1024 tokens: more than the Express prefill cache holds (sink 32 + window 32 + 512 slots), so it compresses
    "benchmarks/express_prefill_recipe.py": (
        "--tokens", "1024", "--samples", "1", "--max-new-tokens", "8", "--out", "runthrough/express_prefill_recipe"),
    "benchmarks/keydiff_memory.py": ("--lengths", "512", "--budget", "128", "--block", "64", "--threads", "1"),
    # a ratio the committed folder does not hold, so the cell is answered
    "benchmarks/kvpress_side_by_side.py": (
        "kvcompress", "--out", "results/kvpress_side_by_side", "--cells", DEFAULT_CELL, "--ratios", "0.25", "--sample-indices", "0",
        "--threads", "1"),
    "benchmarks/kvzap_fidelity.py": ("--contexts", "1", "--tokens", "512", "--threads", "1", "--out", "runthrough/kvzap_fidelity.csv"),
    "benchmarks/line_retrieval.py": ("--lengths", "512", "--kept", "0.5", "--samples", "1", "--max-new-tokens", "8", "--threads", "1"),
    "benchmarks/many_questions.py": ("--tokens", "512", "--max-new-tokens", "2", "--threads", "1"),
    # 1024 tokens: the default 10 % kept leaves room beyond the method's sink and window
    "benchmarks/native_speed.py": (
        "--contexts", "1024", "--new-tokens", "2", "--repeats", "1", "--prefill-repeats", "1", "--threads", "1", "--out", "runthrough/native"),
    "benchmarks/needle_retention.py": (
        "--out", "results/kvpress_side_by_side_prose", "--cell", "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05]",
        "--ratios", "0.75", "--sample-indices", "0", "--threads", "1"),
    # two documents: the intervals over documents need two
    "benchmarks/quantized_storage.py": (
        "--documents", "2", "--context", "256", "--scored", "64", "--methods", "snapkv", "--ratios", "0.5", "--bits", "32,4",
        "--steps", "2", "--threads", "1", "--out", "runthrough/quantized_storage"),
    "benchmarks/ray_overhead.py": ("--length", "256", "--samples", "1", "--max-new-tokens", "2", "--threads", "1", "--name", "runthrough"),
    "benchmarks/refit_cost.py": ("--length", "256", "--layers", "1", "--ratios", "0.75", "--repeats", "1", "--threads", "1"),
    "benchmarks/report.py": (),
    "benchmarks/tova_needles.py": ("--depth-indices", "5", "--csv", "runthrough/tova_needles.csv"),
    "benchmarks/tuning/balancekv_cascade_rounds.py": (
        "--tokens", "512", "--seeds", "2", "--sink", "64", "--window", "64", "--block", "64", "--layers", "1", "--ratios", "0.75",
        "--threads", "1"),
    "benchmarks/tuning/balancekv_needle.py": (
        "tune", "--samples", "1", "--length", "512", "--augments", "0.25", "--sink-windows", "4,16", "--threads", "1"),
    "benchmarks/tuning/compare_runs.py": ("tasks", "results/sweep_2k", "results/sweep_2k"),
    "benchmarks/tuning/coreset_quality.py": (
        "--tokens", "512", "--seeds", "2", "--sink", "64", "--window", "64", "--block", "64", "--layers", "1", "--ratios", "0.75",
        "--threads", "1"),
    "benchmarks/tuning/equal_memory.py": (
        "--out", "runthrough/equal_memory.jsonl", "--lengths", "1024", "--seeds", "1000", "--variants", "full,q4_0.55", "--threads", "1"),
    "benchmarks/tuning/evicted_merge.py": tuning_needle_run("evicted_merge"),
    # the candidate the paired tables compare with; its task samples are 2048 tokens, whatever the arguments
    "benchmarks/tuning/hybrid_tuning.py": (
        "--samples", "1", "--candidates", "tova .1 + leverage .3, express", "--tasks", "niah_single", "--threads", "1",
        "--csv", "runthrough/hybrid_tuning.csv"),
    "benchmarks/tuning/kvzap_default.py": tuning_needle_run("kvzap_default", "--variants", "full,adakv_kvzap_model"),
    "benchmarks/tuning/needle_keep.py": tuning_needle_run("needle_keep"),
    "benchmarks/tuning/needle_oracle.py": tuning_needle_run("needle_oracle"),
    "benchmarks/tuning/own_query_refit.py": tuning_needle_run("own_query_refit"),
    "benchmarks/tuning/prompt_layout.py": (
        "--split", "tuning", "--length", "512", "--samples", "1", "--threads", "1", "--out", "runthrough/prompt_layout"),
    "benchmarks/tuning/reconstruction_query_share.py": tuning_needle_run("reconstruction_query_share"),
    # two contexts of 512 tokens per text: the first half of the training text is one context
    "benchmarks/tuning/scorer_inputs.py": (
        "--out", "runthrough/scorer_inputs.csv", "--layers", "0,29", "--tokens", "512", "--contexts", "2", "--threads", "1"),
    "benchmarks/tuning/stream_slack.py": ("--slacks", "0.5", "--sizes", "512", "--repeats", "1", "--threads", "1"),
}

# script -> why it does not run here
NOT_RUN: dict[str, str] = {
    "benchmarks/tova_kvpress_check.py": (
        "imports kvpress, which is no dependency of .venv: it needs a kvpress source checkout on PYTHONPATH (its package "
        "__init__ emptied, as its docstring says), and kvpress's own virtualenv pins transformers < 5.3, under which "
        "kvcompress (transformers >= 5.23) does not import"),
}

# script -> the run that writes the input it reads, made first in the same copy
SETUP_RUNS: dict[str, tuple[str, tuple[str, ...]]] = {
    # it answers every sample of its dump (no option picks fewer; the committed dumps hold 30 of 2048 tokens and more)
    "benchmarks/compactor_kvpress_departures.py": (
        "benchmarks/kvpress_side_by_side.py", ("dump", "--samples", "1", "--length", "512", "--out", DUMP)),
}

# script -> files (relative to the copy) removed before it runs: report.py rewrites only what differs from the records, so
# alone (or before any other script changed a record) it would find results.md current and rightly write nothing
REMOVED_FIRST: dict[str, tuple[str, ...]] = {"benchmarks/report.py": ("docs/results.md",)}

# script -> files (relative to the copy) its run writes
EXPECTED_OUTPUTS: dict[str, tuple[str, ...]] = {
    "benchmarks/answer_margin.py": ("results/kvpress_side_by_side_prose/margin.md", "results/kvpress_side_by_side_prose/margin_cells.md"),
    "benchmarks/answer_stopping.py": ("benchmarks/results/answer_stopping.md",),
    "benchmarks/balancekv_attention_error.py": ("benchmarks/results/balancekv_attention_error.md", "benchmarks/results/balancekv_attention_error.png"),
    "benchmarks/compactor_ablation.py": ("benchmarks/results/compactor_ablation.md", "benchmarks/results/compactor_ablation_leverage.csv"),
    "benchmarks/compactor_kvpress_departures.py": (f"{DUMP}/compactor_departures.md",),
    "benchmarks/default_cost.py": ("runthrough/default_cost.csv",),
    "benchmarks/eval_prefill_reuse.py": ("benchmarks/results/eval_prefill_reuse.md",),
    "benchmarks/express_attention_error.py": ("benchmarks/results/express_attention_error.md", "benchmarks/results/express_attention_error.png"),
    "benchmarks/express_prefill_recipe.py": ("runthrough/express_prefill_recipe.csv", "runthrough/express_prefill_recipe.md"),
    "benchmarks/keydiff_memory.py": ("benchmarks/results/keydiff_memory.md", "benchmarks/results/keydiff_memory.png"),
    "benchmarks/kvpress_side_by_side.py": ("results/kvpress_side_by_side/kvcompress.jsonl",),
    "benchmarks/kvzap_fidelity.py": ("runthrough/kvzap_fidelity.csv",),
    "benchmarks/line_retrieval.py": ("benchmarks/results/line_retrieval.csv", "benchmarks/results/line_retrieval.md"),
    "benchmarks/many_questions.py": ("benchmarks/results/many_questions.md",),
    "benchmarks/native_speed.py": ("runthrough/native/native_speed.md",),
    "benchmarks/needle_retention.py": ("results/kvpress_side_by_side_prose/retention.md",),
    "benchmarks/quantized_storage.py": ("runthrough/quantized_storage.md",),
    "benchmarks/ray_overhead.py": ("benchmarks/results/ray_overhead_runthrough.md",),
    "benchmarks/refit_cost.py": ("benchmarks/results/refit_cost_log_weights_values.md",),
    "benchmarks/report.py": ("docs/results.md",),
    "benchmarks/tova_needles.py": ("runthrough/tova_needles.csv", "benchmarks/results/tova_needles.md"),
    "benchmarks/tuning/balancekv_cascade_rounds.py": ("benchmarks/results/balancekv_cascade_rounds.md",),
    "benchmarks/tuning/balancekv_needle.py": ("benchmarks/results/balancekv_needle_tuning.md",),
    "benchmarks/tuning/coreset_quality.py": ("benchmarks/results/coreset_quality.md",),
    "benchmarks/tuning/equal_memory.py": ("runthrough/equal_memory.jsonl",),
    "benchmarks/tuning/evicted_merge.py": ("runthrough/evicted_merge.jsonl",),
    "benchmarks/tuning/hybrid_tuning.py": ("runthrough/hybrid_tuning.csv", "benchmarks/results/hybrid_tuning.md"),
    "benchmarks/tuning/kvzap_default.py": ("runthrough/kvzap_default.jsonl",),
    "benchmarks/tuning/needle_keep.py": ("runthrough/needle_keep.jsonl",),
    "benchmarks/tuning/needle_oracle.py": ("runthrough/needle_oracle.jsonl",),
    "benchmarks/tuning/own_query_refit.py": ("runthrough/own_query_refit.jsonl",),
    "benchmarks/tuning/prompt_layout.py": ("runthrough/prompt_layout/summary.md",),
    "benchmarks/tuning/reconstruction_query_share.py": ("runthrough/reconstruction_query_share.jsonl",),
    "benchmarks/tuning/scorer_inputs.py": ("runthrough/scorer_inputs.csv",),
    "benchmarks/tuning/stream_slack.py": ("benchmarks/results/bench/slack/stream_slack.md",),
}

TIMEOUT_S = 600  # each run took under 90 s on one thread here, but the 2-core machines are shared
ENTRY_POINT = re.compile(r"^if __name__ == [\"']__main__[\"']:", re.MULTILINE)


def entry_point_scripts() -> list[str]:
    """benchmarks/**/*.py with an entry point (a `__main__` block or an argument parser), relative to the repository root."""
    scripts = []
    for path in (REPO / "benchmarks").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if ENTRY_POINT.search(text) or "ArgumentParser(" in text:
            scripts.append(path.relative_to(REPO).as_posix())
    return sorted(scripts)


def test_every_benchmark_script_is_run_or_says_why_not():
    """Every script with an entry point is run (SCRIPT_RUNS) or says why not (NOT_RUN), never both; the other tables name run scripts."""
    scripts = entry_point_scripts()
    assert scripts
    assert not SCRIPT_RUNS.keys() & NOT_RUN.keys(), "a script is both run and not run"
    assert sorted(SCRIPT_RUNS.keys() | NOT_RUN.keys()) == scripts, (
        f"not in SCRIPT_RUNS or NOT_RUN: {sorted(set(scripts) - SCRIPT_RUNS.keys() - NOT_RUN.keys())}; "
        f"not a script with an entry point: {sorted((SCRIPT_RUNS.keys() | NOT_RUN.keys()) - set(scripts))}")
    assert EXPECTED_OUTPUTS.keys() | SETUP_RUNS.keys() | REMOVED_FIRST.keys() <= SCRIPT_RUNS.keys()


def run_script(copy: Path, script: str, args: tuple[str, ...], timeout: float) -> None:
    """`python script *args` in `copy`, one OpenMP thread, the copy's package and benchmarks/tuning/ on the path; fails the
    test, with the tail of the script's stderr, unless it exits 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), str(copy / "benchmarks" / "tuning")]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, script, *args], cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"`{script} {' '.join(args)}` exited {done.returncode}; stderr ends:\n{done.stderr[-4000:]}"


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory) -> Path:
    """A copy of the repository (no .venv, .git or caches) that the scripts run and write in."""
    copy = tmp_path_factory.mktemp("benchmark_runs") / "repo"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", ".pytest_cache"))
    return copy


@pytest.mark.e2e
@pytest.mark.parametrize("script", list(SCRIPT_RUNS))
def test_benchmark_script_runs(script, repo_copy):
    """The script, on its SCRIPT_RUNS arguments in the copy (after its SETUP_RUNS run, its REMOVED_FIRST files removed), exits 0
    and writes its EXPECTED_OUTPUTS."""
    if script in SETUP_RUNS:
        run_script(repo_copy, *SETUP_RUNS[script], timeout=TIMEOUT_S)
    for path in REMOVED_FIRST.get(script, ()):
        (repo_copy / path).unlink()
    started = time.time()
    run_script(repo_copy, script, SCRIPT_RUNS[script], timeout=TIMEOUT_S)
    for path in EXPECTED_OUTPUTS.get(script, ()):
        output = repo_copy / path
        assert output.is_file() and output.stat().st_size > 0, f"{script} wrote no {path}"
        # the copy keeps the committed files' times: one the run did not write is older than the run
        assert output.stat().st_mtime >= started, f"{script} did not write {path}: the copy's is the committed one"
