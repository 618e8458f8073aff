"""Cost-benchmark machinery (kvcompress.eval.bench): runs on tiny sizes and writes its files. No timing is asserted."""

import csv
import importlib
import math
import mmap
import os
import statistics
import subprocess
import sys
from dataclasses import FrozenInstanceError

import pytest
import torch

import kvcompress as kvc
from registered import SHARED
from kvcompress.cli import build_parser, main
from kvcompress.eval import bench
from kvcompress.eval.bench.report import markdown
from kvcompress.eval.tables import read_csv, write_csv

TINY = bench.Shape("tiny", 1, 2, 8)
QUIET = {"log": lambda s: None}


def config(**options) -> bench.BenchConfig:
    return bench.BenchConfig(**options)


def test_fit_exponent_recovers_power_law():
    sizes = [1024, 2048, 4096, 8192, 16384]
    a, c = bench.fit_exponent(sizes, [3e-9 * n**1.7 for n in sizes])
    assert a == pytest.approx(1.7, abs=1e-9) and c == pytest.approx(3e-9, rel=1e-6)
    noise = [1.05, 0.95, 1.02, 0.97, 1.01]
    a, _ = bench.fit_exponent(sizes, [2e-6 * n * e for n, e in zip(sizes, noise)])
    assert a == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("sizes, values", [([1024], [1.0]), ([8, 8], [1.0, 2.0]), ([8, 16], [1.0, 0.0]), ([8, 16], [1.0])])
def test_fit_exponent_rejects_bad_input(sizes, values):
    with pytest.raises(ValueError, match="fit_exponent"):
        bench.fit_exponent(sizes, values)


def test_time_calls_counts_and_stops_early():
    calls = []
    assert len(bench.time_calls(lambda: calls.append(1), 4)) == 4 and len(calls) == 4
    assert len(bench.time_calls(lambda: calls.append(1), 5, max_seconds=0.0)) == 1
    with pytest.raises(ValueError, match="repeats"):
        bench.time_calls(lambda: None, 0)


def test_synthetic_layer_shapes():
    layer = bench.synthetic_layer(bench.SHAPES["smollm2"], 16, torch.Generator().manual_seed(0))
    assert layer["keys"].shape == layer["values"].shape == layer["pre_rope_keys"].shape == (1, 3, 16, 64)
    assert layer["queries"].shape == (1, 9, 16, 64)
    assert bench.exact_attention_pass(layer).shape == (1, 9, 16, 64)


def test_overhead_covers_every_method():
    rows = bench.overhead_rows(config(methods=SHARED, shapes=[TINY], sizes=[32, 64], repeats=2, stream="none"), **QUIET)
    for n in (32, 64):
        exact = [r for r in rows if r["n"] == n and r["kind"] == "exact"]
        assert len(exact) == 1
        for method in SHARED:
            (row,) = [r for r in rows if r["n"] == n and r["method"] == method]
            assert row["kind"] == "compress" and row["repeats"] == 2 and row["min_s"] <= row["median_s"]
            assert row["ratio_min"] == pytest.approx(row["min_s"] / exact[0]["min_s"])
    exps = bench.exponent_rows(rows)
    assert {(e["method"], e["kind"]) for e in exps} == {(r["method"], r["kind"]) for r in rows}
    assert all(math.isfinite(e["time_exponent"]) and math.isfinite(e.get("ratio_exponent", 0.0)) for e in exps)


def test_overhead_streams_natively_streaming_methods():
    assert bench.natively_streaming("subgen") and not bench.natively_streaming("knorm")
    rows = bench.overhead_rows(config(methods=["subgen", "knorm"], shapes=[TINY], sizes=[64], repeats=1, block=16), **QUIET)
    assert [(r["method"], r["kind"]) for r in rows] == [("exact", "exact"), ("subgen", "compress"), ("subgen", "stream"), ("knorm", "compress")]
    rows = bench.overhead_rows(config(methods=["knorm"], shapes=[TINY], sizes=[64], repeats=1, block=16, stream="all"), **QUIET)
    assert [(r["method"], r["kind"]) for r in rows] == [("exact", "exact"), ("knorm", "compress"), ("knorm", "stream")]


def test_overhead_skips_larger_sizes_after_the_limit():
    rows = bench.overhead_rows(config(methods=["knorm"], shapes=[TINY], sizes=[32, 64], repeats=3, stream="all", max_seconds=0.0), **QUIET)
    first = [r for r in rows if r["n"] == 32]
    assert all(not r.get("skipped") and r["repeats"] == 1 for r in first)
    later = [r for r in rows if r["n"] == 64]  # the exact pass went over the limit too: the whole size is skipped
    assert {(r["method"], r["kind"]) for r in later} == {("exact", "exact"), ("knorm", "compress"), ("knorm", "stream")}
    assert all(r["skipped"] and "min_s" not in r for r in later)
    assert bench.exponent_rows(rows) == []


@pytest.mark.parametrize("kwargs, match", [
    ({"sections": ["speed"]}, r"sections must name one or more of \['overhead'.*got \['speed'\]"),
    ({"sections": "overhead"}, "sections must be a list or tuple, got 'overhead'"),
    ({"sections": []}, "sections must name one or more of .*got none"),
    ({"methods": ["nope"]}, r"methods must name one or more of .*got \['nope'\]"),
    ({"memory_method": "nope"}, "memory_method must be one of .*got 'nope'"),
    ({"memory_modes": ["fast"]}, r"memory_modes must name one or more of \['prefill', 'chunked', 'decode'\], got \['fast'\]"),
    ({"shapes": ["gpt"]}, r"must be bench Shapes .*got \['gpt'\]"),
    ({"step_shape": "gpt"}, r"must be bench Shapes .*got \['gpt'\]"),
    ({"stream": "some"}, "stream must be one of native, all, none, got 'some'"),
    ({"compression_ratio": 1.0}, r"compression_ratio must be in \[0, 1\) \(the fraction of the n tokens removed\), got 1.0"),
    ({"prefill_ratio": -0.5}, r"prefill_ratio must be in \[0, 1\)"),
    ({"block": 0}, "block must be an integer >= 1, got 0"),
    ({"repeats": 2.5}, "repeats must be an integer >= 1, got 2.5"),
    ({"sizes": [64, 1]}, "sizes must be an integer >= 2, got 1"),
    ({"sizes": []}, "sizes must hold at least one integer >= 2, got none"),
    ({"plain_every": 0}, "plain_every must be an integer >= 1, got 0"),
    ({"prefill_tokens": 1}, "prefill_tokens must be an integer >= 2, got 1"),
    ({"decode_tokens": 1}, "decode_tokens must be an integer >= 2, got 1"),
    ({"kept": [0.5, 0.0]}, r"kept must hold fractions of the context kept, in \(0, 1\], got \[0.0\]"),
    ({"max_seconds": -1}, "max_seconds must be a number of seconds >= 0, got -1"),
    ({"threads": [0]}, "threads must be an integer >= 1, got 0"),
    ({"threads": [2, 2]}, r"threads must not repeat a value, got 2 more than once in \[2, 2\]"),
    ({"seed": -1}, "seed must be an integer >= 0, got -1"),
    ({"model": 3}, "model must be a checkpoint directory"),
    ({"device": "cpu"}, "device must be a torch.device, got 'cpu'"),
    ({"dtype": torch.int64}, "dtype must be a floating torch dtype, got torch.int64"),
])
def test_config_rejects_bad_options_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        config(**kwargs)


def test_config_is_frozen_with_tuples_and_every_method_by_default():
    c = config(sizes=[32, 64], threads=[1])
    assert c.sizes == (32, 64) and c.threads == (1,) and c.methods == tuple(kvc.methods())
    assert c == config(sizes=(32, 64), threads=(1,)) and hash(c) == hash(config(sizes=(32, 64), threads=(1,)))
    with pytest.raises(FrozenInstanceError):
        c.repeats = 5


def test_attention_step_rows():
    rows = bench.attention_step_rows(config(step_shape=TINY, step_contexts=[64], kept=[0.25, 0.5], step_repeats=2), **QUIET)
    assert [(r["path"], r["kept"], r["slots"]) for r in rows] == [("sdpa", 1.0, 64), ("weighted", 1.0, 64), ("weighted", 0.25, 16), ("weighted", 0.5, 32)]
    assert rows[0]["speedup"] == pytest.approx(1.0)


def test_peak_process_memory_sees_an_allocation():
    def allocate():
        # an anonymous mapping is fresh pages (a tensor's memory may come from a freed heap chunk still resident,
        # as it can after the end-to-end tests), and writing every page makes them resident
        with mmap.mmap(-1, 64 * 2**20) as pages:
            for offset in range(0, len(pages), mmap.PAGESIZE):
                pages[offset] = 1
            return pages[0]

    out, peak, before = bench.peak_process_memory(allocate)
    assert out == 1 and peak - before >= 48 * 2**20


def test_cli_runs_and_writes_tables_and_plots(tmp_path):
    out = tmp_path / "bench"
    argv = ["bench", "--sections", "overhead,attention", "--methods", "knorm,subgen", "--shapes", "smollm2", "--sizes", "32,64", "--repeats", "1",
            "--compression-ratio", "0.9", "--step-shape", "smollm2", "--step-contexts", "64", "--step-repeats", "2", "--out", str(out)]
    assert main(argv) == 0
    for name in ("overhead.csv", "exponents.csv", "attention.csv", "bench.md", "overhead.png", "decode.png"):
        assert (out / name).stat().st_size > 0
    with open(out / "overhead.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["method"], r["kind"]) for r in rows} == {("exact", "exact"), ("knorm", "compress"), ("subgen", "compress"), ("subgen", "stream")}
    assert {r["ratio_removed"] for r in rows} == {"0.9"}
    assert (out / "overhead.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "bench.md").read_text()
    assert "Machine:" in md and "torch threads" in md and "| knorm |" in md and "| subgen |" in md and "90% of them removed" in md
    (out / "bench.md").unlink()
    assert main(["bench", "--report-only", "--out", str(out)]) == 0
    assert (out / "bench.md").read_text() == md
    assert read_csv(out / "overhead.csv")[0]["n"] == 32


def test_cli_synthetic_sections_run_every_method_on_the_default_shapes(tmp_path):
    # docs/bench.md's command, small: every registered method on both default shapes. KVzap's shipped scorer fits the
    # default model's shape only, so on llama8b it is reported as not measured, as KVzip's throughput (it has no stream),
    # and the run goes on.
    out = tmp_path / "bench"
    assert main(["bench", "--sections", "overhead,throughput", "--sizes", "32", "--repeats", "1", "--stream", "all", "--block", "16",
                 "--throughput-tokens", "64", "--throughput-repeats", "1", "--out", str(out)]) == 0
    overhead = read_csv(out / "overhead.csv")
    assert {r["method"] for r in overhead} == {"exact", *kvc.methods()}
    assert all("min_s" in r for r in overhead if r["shape"] == "smollm2")
    unmeasured = {(r["shape"], r["method"]) for r in overhead if "min_s" not in r}
    assert unmeasured == {("llama8b", "kvzap")}
    throughput = {r["method"]: r for r in read_csv(out / "throughput.csv")}
    assert set(throughput) == set(kvc.methods()) and all("min_s" in r for m, r in throughput.items() if m not in ("kvzap", "kvzip"))
    assert throughput["kvzip"]["skipped"] == "it has no stream (mode 'prefill' only)" and throughput["kvzip"]["stream"] == "none"
    assert "min_s" not in throughput["kvzap"]
    assert "- n/a, kvzap: its scorer, trained on SmolLM2-135M-Instruct" in (out / "bench.md").read_text()


def test_report_needs_csvs(tmp_path):
    with pytest.raises(ValueError, match="no bench CSV"):
        bench.report(tmp_path)


def test_cli_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    text = capsys.readouterr().out
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices["bench"]
    for action in sub._actions:
        for opt in action.option_strings:
            assert opt in text
        assert action.help
    for name in bench.SECTIONS:
        assert name in text


@pytest.mark.e2e
def test_memory_chunked_flat_prefill_grows(default_model, tmp_path):
    model, tokenizer = default_model
    rows = bench.memory_rows(model, tokenizer, config(memory_method="knorm", memory_sizes=[384, 768], memory_budget=64, chunk_size=64), **QUIET)
    chunked = [r for r in rows if r["mode"] == "chunked"]
    prefill = [r for r in rows if r["mode"] == "prefill"]
    assert [r["n"] for r in chunked] == [384, 768]
    assert chunked[0]["peak_kv_bytes"] == chunked[1]["peak_kv_bytes"]
    assert prefill[1]["peak_kv_bytes"] == 2 * prefill[0]["peak_kv_bytes"]
    bench.plot_memory(rows, tmp_path / "memory.png")
    assert (tmp_path / "memory.png").stat().st_size > 0


def test_decode_rows_seed_the_compressed_runs_only(tiny_checkpoint):
    """The decode section handed --seed to the full cache too, which draws nothing and (since it refuses a seed) failed
    after the model loaded for any seed but 0."""
    from kvcompress.integration import load_model

    model, tokenizer = load_model(tiny_checkpoint)
    rows = bench.decode_rows(model, tokenizer, config(methods=["random"], decode_context=200, kept=[0.5], decode_tokens=2, seed=3), **QUIET)
    assert [(r["method"], r["kept"]) for r in rows] == [("full", 1.0), ("random", 0.5)]


@pytest.mark.e2e
def test_decode_rows_on_the_default_model(default_model):
    model, tokenizer = default_model
    rows = bench.decode_rows(model, tokenizer, config(methods=["knorm"], decode_context=256, kept=[0.5], decode_tokens=3), **QUIET)
    assert [(r["method"], r["kept"]) for r in rows] == [("full", 1.0), ("knorm", 0.5)]
    assert rows[0]["speedup"] == pytest.approx(1.0)
    assert all(r["new_tokens"] == 3 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[1]["kv_bytes"] < rows[1]["kv_bytes_full"]
    # what is held, the exact sink (4), window (64), question and answer included: more than half of a short context
    assert rows[0]["kept_realised"] == 1.0 and 0.5 < rows[1]["kept_realised"] < 1.0, rows


def test_synthetic_tensors_follow_the_requested_device_and_dtype():
    layer = bench.synthetic_layer(TINY, 16, torch.Generator().manual_seed(0), torch.bfloat16, "cpu")
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in layer.values())
    ref = bench.synthetic_layer(TINY, 16, torch.Generator().manual_seed(0))
    assert torch.equal(layer["keys"], ref["keys"].bfloat16())  # the same draws in every dtype


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_cli_bench_runs_on_the_requested_device_and_dtype(tmp_path, device):
    out = tmp_path / device
    argv = ["bench", "--sections", "overhead,attention", "--methods", "knorm,subgen", "--shapes", "smollm2", "--sizes", "32", "--repeats", "1",
            "--step-shape", "smollm2", "--step-contexts", "64", "--step-repeats", "1", "--out", str(out), "--device", device, "--dtype", "bfloat16"]
    assert main(argv) == 0
    machine = (out / "machine.txt").read_text()
    assert f"device {device}" in machine and "bfloat16" in machine
    assert {r["method"] for r in read_csv(out / "overhead.csv")} == {"exact", "knorm", "subgen"}


def test_a_method_that_cannot_run_on_a_shape_is_reported_with_its_reason(tmp_path):
    # The shipped KVzap scorer reads the default model's hidden states: it fits the smollm2 shape and no other.
    assert bench.unfit_reason("kvzap", bench.SHAPES["smollm2"]) is None and bench.unfit_reason("knorm", TINY) is None
    reason = bench.unfit_reason("kvzap", TINY)
    assert "SmolLM2" in reason and "width 576 for 3 KV heads" in reason and "shape tiny has width 16 and 1 KV heads" in reason
    rows = bench.overhead_rows(config(methods=["kvzap", "knorm"], shapes=[TINY], sizes=[32, 64], repeats=1, stream="all", block=16), **QUIET)
    skipped = [r for r in rows if r["method"] == "kvzap"]
    assert [(r["n"], r["kind"]) for r in skipped] == [(32, "compress"), (32, "stream"), (64, "compress"), (64, "stream")]
    assert all(r["skipped"] == reason and "min_s" not in r for r in skipped)
    assert all("min_s" in r for r in rows if r["method"] != "kvzap")
    # once the exact pass is too slow for larger n, the rest are skipped, but such a method keeps its reason
    slow = bench.overhead_rows(config(methods=["kvzap", "knorm"], shapes=[TINY], sizes=[32, 64], repeats=1, max_seconds=0.0), **QUIET)
    assert {(r["method"], r["skipped"]) for r in slow if r["n"] == 64} == {("exact", True), ("kvzap", reason), ("knorm", True)}
    assert {e["method"] for e in bench.exponent_rows(rows)} == {"exact", "knorm"}
    throughput = bench.throughput_rows(config(methods=["kvzap", "knorm"], throughput_shape=TINY, throughput_tokens=64, block=16,
                                              throughput_repeats=1), **QUIET)
    assert [r["method"] for r in throughput] == ["keydiff", "kvzap", "knorm"]
    assert throughput[1]["skipped"] == reason and "min_s" not in throughput[1] and throughput[2]["runs"] == 1
    write_csv(tmp_path / "overhead.csv", rows)  # the reason survives the CSV the report is written from
    page = markdown(read_csv(tmp_path / "overhead.csv"), throughput=throughput)
    assert "| kvzap | n/a | n/a |" in page and f"- n/a, kvzap: {reason}" in page
    assert f"| kvzap | native |  |  |  |  |  | {reason} |" in page


def test_throughput_rows_put_keydiff_first_as_the_reference():
    rows = bench.throughput_rows(config(methods=["knorm", "subgen"], throughput_shape=TINY, throughput_tokens=96, block=16, throughput_repeats=2),
                                 **QUIET)
    assert [(r["method"], r["stream"]) for r in rows] == [("keydiff", "block-wise"), ("knorm", "block-wise"), ("subgen", "native")]
    assert rows[0]["over_keydiff"] == 1.0 and all(r["runs"] == 2 and r["budget"] == 48 for r in rows)
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(96 / r["min_s"])
        assert r["over_keydiff"] == pytest.approx(r["tokens_per_s"] / rows[0]["tokens_per_s"])


def test_cli_runs_every_thread_count_into_its_own_directory(tmp_path):
    out = tmp_path / "bench"
    argv = ["bench", "--sections", "overhead,throughput", "--methods", "knorm", "--shapes", "smollm2", "--sizes", "32,64", "--repeats", "1",
            "--throughput-shape", "smollm2", "--throughput-tokens", "64", "--throughput-repeats", "1", "--block", "16", "--threads", "1,2",
            "--out", str(out)]
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    for count in (1, 2):
        assert f"torch threads {count}," in (out / f"threads-{count}" / "machine.txt").read_text()
        assert [r["method"] for r in read_csv(out / f"threads-{count}" / "throughput.csv")] == ["keydiff", "knorm"]
        assert {r["method"] for r in read_csv(out / f"threads-{count}" / "overhead.csv")} == {"exact", "knorm"}
    page = (out / "bench.md").read_text()
    assert "## 1 thread\n" in page and "## 2 threads\n" in page and page.count("### Streaming throughput vs KeyDiff") == 2
    for written in [out / "bench.md", *out.glob("threads-*/bench.md")]:
        written.unlink()
    assert main(["bench", "--report-only", "--out", str(out)]) == 0  # each count's page and the page of both, from the CSVs
    assert (out / "bench.md").read_text() == page and all((out / f"threads-{count}" / "bench.md").is_file() for count in (1, 2))
    # a run of one count into it wrote its CSVs beside the counts' folders, and the report then showed it alone
    one = ["bench", "--sections", "attention", "--step-shape", "smollm2", "--step-contexts", "64", "--step-repeats", "1", "--threads", "1"]
    assert main([*one, "--out", str(out)]) == 2
    assert (out / "bench.md").read_text() == page and not list(out.glob("*.csv"))
    assert main([*one, "--out", str(tmp_path / "one")]) == 0  # ... and the other way round
    assert main([*argv[:-4], "--threads", "1,2", "--out", str(tmp_path / "one")]) == 2
    torch.set_num_threads(threads)


@pytest.mark.smoke
def test_prefill_rows_on_the_default_model(default_model):
    model, tokenizer = default_model
    options = config(methods=["knorm", "h2o"], prefill_tokens=160, prefill_ratio=0.5, prefill_repeats=1, plain_every=1, kernel_repeats=1)
    rows = bench.prefill_rows(model, tokenizer, options, **QUIET)
    by_method = {r["method"]: r for r in rows}
    assert list(by_method) == ["plain", "knorm", "h2o"] and by_method["plain"]["runs"] == 2
    assert by_method["plain"]["compress_min_s"] == 0.0 and by_method["plain"]["implied_overhead"] == 1.0
    assert by_method["knorm"]["compress_min_s"] > 0 and by_method["knorm"]["fused_extra_s"] == 0.0
    assert by_method["h2o"]["fused_extra_s"] != 0.0  # the fused mass kernel's extra time is counted for H2O only
    for r in rows:
        assert r["overhead_min"] == pytest.approx(r["min_s"] / by_method["plain"]["min_s"])
        assert r["implied_overhead"] == pytest.approx(1 / (1 - r["compress_share"]))


def test_prefill_rows_pair_each_run_with_the_plain_prefill_just_before_it(monkeypatch):
    """Scripted prefill times: overhead_paired is the median of each run ÷ the plain run before it, while
    overhead_min divides a method's fastest run by the fastest plain run of all."""
    warm_up = [9.9]
    rounds = [[1.0, 1.2, 1.3, 2.0, 2.2], [1.5, 2.1, 1.5, 2.5, 3.0]]  # plain, knorm, snapkv, plain, tova
    script = iter(warm_up + rounds[0] + rounds[1])
    monkeypatch.setattr(bench.prefill, "prefill_seconds", lambda model, ids, method, ratio: (next(script), 0.0 if method is None else 0.01))
    monkeypatch.setattr(bench.prefill, "context_ids", lambda tokenizer, tokens: torch.zeros(1, tokens, dtype=torch.long))
    rows = bench.prefill_rows(None, None, config(methods=["knorm", "snapkv", "tova"], prefill_tokens=16, prefill_repeats=2, plain_every=2), **QUIET)
    by_method = {r["method"]: r for r in rows}
    assert by_method["plain"]["runs"] == 4 and by_method["plain"]["overhead_paired"] == 1.0
    assert by_method["knorm"]["overhead_paired"] == pytest.approx(statistics.median([1.2 / 1.0, 2.1 / 1.5]))
    assert by_method["snapkv"]["overhead_paired"] == pytest.approx(statistics.median([1.3 / 1.0, 1.5 / 1.5]))
    assert by_method["tova"]["overhead_paired"] == pytest.approx(statistics.median([2.2 / 2.0, 3.0 / 2.5]))
    assert by_method["snapkv"]["overhead_min"] == pytest.approx(1.3 / 1.0)


def test_csv_round_trip_keeps_every_column_and_parses_numbers_back(tmp_path):
    from kvcompress.eval.tables import markdown_table, write_csv

    rows = [{"method": "knorm", "n": 32, "ratio": 0.25}, {"method": "subgen", "n": 64, "skipped": True}]
    write_csv(tmp_path / "new" / "rows.csv", rows)
    assert (tmp_path / "new" / "rows.csv").read_text().splitlines()[0] == "method,n,ratio,skipped"
    assert read_csv(tmp_path / "new" / "rows.csv") == rows
    assert markdown_table(rows).splitlines() == ["| method | n | ratio | skipped |", "|---|---|---|---|",
                                                 "| knorm | 32 | 0.25 |  |", "| subgen | 64 |  | True |"]
    assert markdown_table(rows, ["n", "method"]).splitlines()[2] == "| 32 | knorm |"


def test_plots_leave_the_matplotlib_backend_and_pyplot_alone(tmp_path):
    """Importing the plotting modules and writing a plot keeps the user's backend (once `matplotlib.use("Agg")` ran at import)."""
    script = f"""
import sys, matplotlib
from kvcompress.eval import bench, leaderboard, plots
rows = [{{"shape": "tiny", "n": n, "method": "knorm", "kind": "compress", "ratio_min": r}} for n, r in ((32, 1.5), (64, 2.0))]
bench.plot_overhead(rows, __import__("pathlib").Path({str(tmp_path)!r}) / "overhead.png")
print(matplotlib.get_backend(), "matplotlib.pyplot" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env={**os.environ, "MPLBACKEND": "svg"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["svg", "False"]
    assert (tmp_path / "overhead.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sections_kept_from_an_earlier_run_keep_that_runs_machine_line(tmp_path):
    """A run into a folder that holds another run's sections keeps them, each under the machine line of the run that measured
    it: the page names one machine only when one run measured every section shown."""
    out = tmp_path / "bench"
    overhead = ["bench", "--sections", "overhead", "--methods", "knorm", "--shapes", "smollm2", "--sizes", "32", "--repeats", "1", "--out", str(out)]
    throughput = ["bench", "--sections", "throughput", "--methods", "knorm", "--throughput-shape", "smollm2", "--throughput-tokens", "64",
                  "--throughput-repeats", "1", "--block", "16", "--out", str(out)]
    threads = torch.get_num_threads()
    try:
        assert main(overhead + ["--threads", "1"]) == 0
        assert main(throughput + ["--threads", "2"]) == 0
        machines = bench.read_machines(out)
        assert list(machines) == ["overhead", "throughput"]
        assert "torch threads 1," in machines["overhead"] and "torch threads 2," in machines["throughput"]
        page = (out / "bench.md").read_text()
        assert "Machines (the sections were measured by different runs):" in page
        assert f"- overhead: {machines['overhead']}." in page and f"- throughput: {machines['throughput']}." in page
        both = ["overhead,throughput" if a == "overhead" else a for a in overhead] + throughput[5:-2] + ["--threads", "1"]
        assert main(both) == 0  # one run measures both
    finally:
        torch.set_num_threads(threads)
    page = (out / "bench.md").read_text()
    assert "Machines (" not in page and f"Machine: {bench.read_machines(out)['overhead']}." in page
    (out / "machine.txt").write_text("one line naming no section\n")  # a folder written before sections had their own lines
    assert bench.read_machines(out) == dict.fromkeys(bench.SECTIONS, "one line naming no section")


def test_the_attention_section_takes_kept(tmp_path):
    """`--kept` sets the attention step's fractions too, which a run of the attention section alone refused (the flag
    belonged to the decode section only)."""
    from kvcompress.cli import main

    assert main(["bench", "--sections", "attention", "--step-shape", "smollm2", "--step-contexts", "64", "--step-repeats", "1",
                 "--kept", "0.5", "--threads", "1", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "attention.csv").open()))
    assert {float(r["kept"]) for r in rows} == {1.0, 0.5}, rows


def test_an_interrupted_run_reports_what_it_wrote(tmp_path, monkeypatch):
    """A run stopped part way (Ctrl-C) into a folder holding an earlier run left the new overhead.csv beside the earlier
    run's bench.md, exponents.csv and plot, and a machine line for a section it never wrote: the report is rebuilt from
    what was written, and machine.txt names only sections with a CSV. One size gives no exponent, but exponents.csv
    keeps its header (it was an empty file no CSV reader takes)."""
    out = tmp_path / "bench"
    first = ["bench", "--sections", "overhead", "--methods", "knorm", "--shapes", "smollm2", "--sizes", "32", "--repeats", "1", "--out", str(out)]
    assert main(first) == 0
    assert read_csv(out / "exponents.csv") == [] and (out / "exponents.csv").read_text().startswith("shape,method,kind,n_min,n_max")
    bench_report = importlib.import_module("kvcompress.eval.bench.report")  # the package's `report` is the function

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_report, "attention_step_rows", interrupted)
    second = ["bench", "--sections", "overhead,attention", "--methods", "knorm,keydiff", "--shapes", "smollm2", "--sizes", "32,64",
              "--repeats", "1", "--step-shape", "smollm2", "--step-contexts", "64", "--step-repeats", "1", "--out", str(out)]
    assert main(second) == 130
    assert {r["method"] for r in read_csv(out / "exponents.csv")} == {"exact", "knorm", "keydiff"}
    assert "| keydiff |" in (out / "bench.md").read_text()
    assert list(bench.read_machines(out)) == ["overhead"] and not (out / "attention.csv").exists()
    # a section an earlier run wrote and this one never reached keeps that run's machine line
    monkeypatch.undo()
    attention = ["--step-shape", "smollm2", "--step-contexts", "64", "--step-repeats", "1"]
    assert main(["bench", "--sections", "attention", *attention, "--out", str(out)]) == 0
    lines = (out / "machine.txt").read_text()
    (out / "machine.txt").write_text(lines.replace("attention: ", "attention: an earlier machine, ", 1))
    monkeypatch.setattr(bench_report, "overhead_rows", interrupted)
    assert main(["bench", "--sections", "overhead,attention", *attention, *second[3:11], "--out", str(out)]) == 130
    assert bench.read_machines(out)["attention"].startswith("an earlier machine, ")


@pytest.mark.smoke
def test_the_decode_section_fits_the_model_or_is_refused_before_anything_runs(default_model, tiny_checkpoint, tmp_path, capsys):
    """The decode section's default context (8192 tokens) plus the chat template, question and answer passed the default
    model's 8192 positions: the default run was refused only after its 8k-token prefill. The default now fits, and a
    context that does not is refused, naming --decode-context, before any section runs."""
    from kvcompress.eval.bench.decode import decode_prompt

    model, tokenizer = default_model
    ctx, question = decode_prompt(tokenizer, config())
    assert ctx.shape[1] + question.shape[1] + config().decode_tokens - 1 <= model.config.max_position_embeddings
    out = tmp_path / "bench"
    argv = ["bench", "--sections", "overhead,decode", "--methods", "knorm", "--shapes", "smollm2", "--sizes", "32", "--repeats", "1",
            "--model", str(tiny_checkpoint), "--decode-context", "2050", "--decode-tokens", "2", "--kept", "0.5", "--out", str(out)]
    assert main(argv) == 2
    assert "--decode-context 2050 with --decode-tokens 2 (the chat template and question add" in capsys.readouterr().err
    assert not (out / "overhead.csv").exists()
