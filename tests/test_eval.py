"""Evaluation suite on a tiny random Llama with a byte-level tokenizer: sweep outputs, resume, tables, approx bench, CLI."""

import copy
import csv
import json
import platform
import re
from dataclasses import replace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kvcompress.cli import build_parser
from kvcompress.eval import runner, tasks
from kvcompress.eval.approx import ApproxConfig, run_approx, write_approx
from kvcompress.eval.plots import plot_approx, plot_sweep
from kvcompress.eval.runner import FULL, SweepConfig, read_results, run_sweep, write_summary
from kvcompress.eval.stats import paired_comparisons


@pytest.fixture(scope="module")
def tiny():
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(alphabet), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    return LlamaForCausalLM(config).eval(), tokenizer


def small_config(**kw):
    base = dict(methods=["knorm", "random"], ratios=[0.5], tasks=["niah_single", "common_words"], lengths=[200],
                samples=2, grid_lengths=[150, 220], grid_depths=[0.0, 1.0], grid_ratios=[0.5], max_new_tokens=2,
                task_params={"common_words": {"n_common": 3, "common_freq": 4, "rare_freq": 1}})  # fits 200 tokens
    return SweepConfig(**(base | kw))


def test_sweep_writes_results_summary_and_plots(tiny, tmp_path):
    model, tokenizer = tiny
    records = run_sweep(model, tokenizer, small_config(), tmp_path, progress=False)
    # 2 tasks × 1 length × 2 samples + 2 × 2 grid samples, each with full + 2 methods × 1 ratio
    assert len(records) == (4 + 4) * 3
    assert len({r["key"] for r in records}) == len(records)
    assert all(r["error"] is None and 0.0 <= r["score"] <= 1.0 for r in records)
    assert {r["method"] for r in records} == {FULL, "knorm", "random"}
    compressed = [r for r in records if r["method"] != FULL]
    assert all(r["kv_bytes"] < r["kv_bytes_full"] for r in compressed)
    assert all(r["kv_bits"] is None for r in records)  # the bits each answer's context was stored in: full precision here
    needles = [r for r in records if r["task"] == "niah_single" and not r["grid"]]
    assert sorted({r["depth"] for r in needles}) == [0.118, 0.5]
    assert all(r["depth"] is None for r in records if r["task"] == "common_words")

    csv_path, md_path = write_summary(records, tmp_path)
    rows = list(csv.DictReader(csv_path.open()))
    task_rows = [r for r in rows if r["kind"] == "task"]
    grid_rows = [r for r in rows if r["kind"] == "grid"]
    assert len(task_rows) == 3 * 2  # (full, knorm, random) × 2 tasks × 1 length
    assert len(grid_rows) == 3 * 2 * 2  # 3 entries × 2 lengths × 2 depths
    assert all(int(r["n"]) == 2 for r in task_rows) and all(int(r["n"]) == 1 for r in grid_rows)
    md = md_path.read_text()
    task_table = md.split("### Paired comparison")[0]
    lines = [ln for ln in task_table.splitlines() if ln.startswith("|")]
    # the random tiny model fails every task with the full cache too: both are flagged
    assert lines[0].split("|")[1:-1] == [" method @ ratio ", " niah_single† ", " common_words† ", " 200 tok ", " all "]
    assert [ln.split("|")[1].strip() for ln in lines[2:]] == ["full cache", "knorm @ 0.5", "random @ 0.5"]
    assert all("(" in ln and "–" in ln for ln in lines[2:])  # every score carries its Wilson interval
    paired = [ln for ln in md.split("### Paired comparison")[1].split("### Wall time")[0].splitlines() if ln.startswith("|")]
    assert len(paired) == 2 + 2  # one non-best method per task
    assert "decoded tokens" in md
    grid_lines = [ln for ln in md.split("### Needle grid")[1].splitlines() if ln.startswith("|")]
    assert len(grid_lines) == 2 + 3 * 2

    paths = plot_sweep(records, tmp_path)
    assert sorted(p.name for p in paths) == ["accuracy_vs_ratio_prefill.png", "needle_heatmap.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_interrupted_sweep_resumes_without_redoing_cells(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    config = small_config(grid_lengths=[], grid_depths=[])
    complete = {r["key"]: r for r in run_sweep(model, tokenizer, config, tmp_path / "a", progress=False)}

    calls = []
    real_answer = runner._answer

    def interrupted(*args, **kwargs):
        if len(calls) == 5:
            raise KeyboardInterrupt
        calls.append(args[1].key)
        return real_answer(*args, **kwargs)

    monkeypatch.setattr(runner, "_answer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(model, tokenizer, config, tmp_path / "b", progress=False)
    path = tmp_path / "b" / runner.RESULTS_FILE
    assert len(read_results(path)) == 5
    with path.open("a") as f:
        f.write('{"key": "cut sh')  # a line torn by the interruption
    calls.clear()
    monkeypatch.setattr(runner, "_answer", lambda *a, **k: (calls.append(a[1].key), real_answer(*a, **k))[1])
    resumed = run_sweep(model, tokenizer, config, tmp_path / "b", progress=False)
    assert len(calls) == len(complete) - 5 and not set(calls) & {r["key"] for r in read_results(path)[:5]}
    assert {r["key"] for r in resumed} == set(complete)
    for r in resumed:
        assert r["prediction"] == complete[r["key"]]["prediction"]
    calls.clear()
    run_sweep(model, tokenizer, config, tmp_path / "b", progress=False)
    assert calls == []


def test_a_named_setting_a_mode_cannot_run_is_recorded_per_cell_and_data_is_compared_as_a_place(tiny, tmp_path, monkeypatch):
    """`kvzip_refit` (prefill only) in a streaming mode failed the whole run before its first cell, after config.json
    was written, so the folder then refused the corrected run as another run: its streamed cells now record the
    refusal, as a prefill-only method's do, and its prefill cells run. The benchmark's data is compared as the place it
    names: the same folder written relative or absolute continues a run."""
    from kvcompress.eval.runner import check_same_run

    model, tokenizer = tiny
    config = small_config(grid_lengths=[], grid_depths=[], tasks=["niah_single"], methods=["kvzip_refit"], modes=["prefill", "chunked"],
                          include_full=False, samples=1)
    records = run_sweep(model, tokenizer, config, tmp_path, progress=False, model_name="tiny")
    by_mode = {r["mode"]: r for r in records}
    assert by_mode["chunked"]["error"] == "ValueError: method 'kvzip_refit' runs in mode 'prefill' only, got mode='chunked'"
    assert by_mode["prefill"]["error"] is None and by_mode["prefill"]["resolved_method"] == "adakv", by_mode["prefill"]
    (tmp_path / "data").mkdir()
    meta = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(meta | {"config": meta["config"] | {"data": "data"}}))  # as typed, relative
    monkeypatch.chdir(tmp_path)
    check_same_run(tmp_path / "config.json", {"data": str(tmp_path / "data")})
    check_same_run(tmp_path / "config.json", {"data": "./data/"})
    with pytest.raises(ValueError, match=r"data \(--data\) .*'other', there 'data'"):
        check_same_run(tmp_path / "config.json", {"data": "other"})


def test_a_results_folder_refuses_records_of_another_run(tiny, tmp_path, capsys):
    """Cells are keyed by task, length, sample, method, ratio and mode: a rerun into the same folder with another seed,
    haystack, answer length, ... (or another model) would find its cells done and report the old run's answers, so it
    is refused, naming each setting and the folder's value; the same settings continue the run."""
    model, tokenizer = tiny
    config = small_config(grid_lengths=[], grid_depths=[], tasks=["niah_single"], methods=["knorm"])
    run_sweep(model, tokenizer, config, tmp_path, progress=False, model_name="tiny")
    for change, match in [({"seed": 7}, r"seed \(--seed\) 7, there 0"), ({"haystack": "prose"}, r"haystack \(--haystack\) 'prose'"),
                          ({"max_new_tokens": 3}, r"max_new_tokens \(--max-new-tokens\) 3, there 2")]:
        with pytest.raises(ValueError, match=rf"holds the results of another run: {match}"):
            run_sweep(model, tokenizer, small_config(**{**dict(grid_lengths=[], grid_depths=[], tasks=["niah_single"], methods=["knorm"]),
                                                        **change}), tmp_path, progress=False, model_name="tiny")
    with pytest.raises(ValueError, match=r"model \(--model\) 'other', there 'tiny'"):
        run_sweep(model, tokenizer, config, tmp_path, progress=False, model_name="other")
    # another dtype (--dtype) was taken, its cells beside the float32 ones (a full cache's bytes half of theirs)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"
    with pytest.raises(ValueError, match=r"dtype \(--dtype\) 'bfloat16', there 'float32'"):
        run_sweep(copy.deepcopy(model).to(torch.bfloat16), tokenizer, config, tmp_path, progress=False, model_name="tiny")
    from kvcompress.cli import main

    assert main(["eval", "--model", str(tmp_path / "no-model"), "--tasks", "niah_single", "--methods", "knorm", "--dtype", "bfloat16",
                 "--out", str(tmp_path)]) == 2  # refused before the model loads (which would fail on this path)
    assert "dtype (--dtype) 'bfloat16', there 'float32'" in capsys.readouterr().err
    grown = small_config(grid_lengths=[], grid_depths=[], tasks=["niah_single"], methods=["knorm", "random"])
    assert {r["method"] for r in run_sweep(model, tokenizer, grown, tmp_path, progress=False, model_name="tiny")} >= {"knorm", "random"}



def test_a_sample_whose_text_changed_is_refused_where_its_cells_are_recorded(tiny, tmp_path, monkeypatch):
    """Every record holds the SHA-256 of the prompt it answered, and config.json the Python that ran: the prose tasks'
    text is that Python's standard library's, so another Python builds other samples under the same keys. Adding
    cells of such a sample to a folder is refused, writing nothing, and so is pairing records of the two texts; the
    same text goes on."""
    model, tokenizer = tiny
    config = small_config(grid_lengths=[], grid_depths=[], tasks=["niah_single"], methods=["knorm"])
    first = run_sweep(model, tokenizer, config, tmp_path, progress=False)
    digests = {r["index"]: r["prompt_sha256"] for r in first}
    assert len(set(digests.values())) == 2 and all(len(d) == 64 for d in digests.values())
    assert all(r["prompt_sha256"] == digests[r["index"]] for r in first)  # one prompt per sample, whatever its cell
    recorded = json.loads((tmp_path / "config.json").read_text())
    assert recorded["python"] == platform.python_version()
    import kvcompress
    import transformers

    assert recorded["versions"] == {"kvcompress": kvcompress.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
    grown = replace(config, methods=["knorm", "random"])
    monkeypatch.setattr(tasks, "FILLER", tasks.FILLER.replace("green", "red"))  # the text another Python might give
    with pytest.raises(ValueError, match=r"results\.jsonl holds sample 'task\|niah_single\|200\|0\|0\.5' answered from "
                                         r"another prompt \(token ids' sha256 [0-9a-f]{12}\.\.\., this run's [0-9a-f]{12}\.\.\.\).* "
                                         r"write to a new folder \(--out\)"):
        run_sweep(model, tokenizer, grown, tmp_path, progress=False)
    assert len(read_results(tmp_path / runner.RESULTS_FILE)) == len(first)
    elsewhere = [r for r in run_sweep(model, tokenizer, grown, tmp_path / "other", progress=False) if r["method"] == "random"]
    with pytest.raises(ValueError, match=r"answered two prompts"):
        paired_comparisons(first + elsewhere, ["knorm"])
    monkeypatch.undo()
    assert {r["method"] for r in run_sweep(model, tokenizer, grown, tmp_path, progress=False)} == {FULL, "knorm", "random"}


def test_a_length_the_model_cannot_take_is_refused_before_any_prefill(tiny, tmp_path, monkeypatch):
    """A length past the model's max_position_embeddings was prefilled whole (70 s at 9k tokens on the real model)
    before every cell recorded its refusal. Such a length is now refused by name before any sample runs, and a prompt
    that only its question and answer push past the limit is every cell's error, with no prefill."""
    model, tokenizer = tiny
    monkeypatch.setattr(model.config, "max_position_embeddings", 220)
    base = dict(grid_lengths=[], grid_depths=[], tasks=["niah_single"])
    with pytest.raises(ValueError, match=r"^lengths 300 exceeds the 220 positions the model takes "
                                         r"\(max_position_embeddings\): give lengths of at most 220 tokens"):
        run_sweep(model, tokenizer, small_config(**base | {"lengths": [200, 300]}), tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match=r"^grid_lengths 250, 260 exceed the 220 positions"):
        run_sweep(model, tokenizer, small_config(grid_lengths=[150, 260, 250], grid_depths=[0.5]), tmp_path / "a", progress=False)
    assert not (tmp_path / "a").exists()
    monkeypatch.setattr(runner, "capture_qkv", lambda *a, **k: pytest.fail("the context was prefilled"))
    records = run_sweep(model, tokenizer, small_config(**base), tmp_path / "b", progress=False)  # 200 tokens and the question
    assert len(records) == 2 * 3 and all(r["capture_s"] == 0 and r["prompt_sha256"] for r in records)
    assert all(re.fullmatch(r"ValueError: the prompt has \d+ tokens but the model takes at most max_position_embeddings=220; .*",
                            r["error"]) for r in records)



def test_a_sample_whose_text_holds_a_special_token_records_the_refusal_in_each_cell(tiny, tmp_path, monkeypatch):
    """A sample whose text holds a special token's text (a benchmark's document with "<|im_end|>") is refused by
    `build_prompt`; the sweep records that in each of its cells, with no prefill, and goes on with the next sample."""
    model, tokenizer = tiny
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    monkeypatch.setattr(tasks, "FILLER", tasks.FILLER + "Then <|im_end|> came. ")
    records = run_sweep(model, tokenizer, small_config(grid_lengths=[], grid_depths=[], tasks=["niah_single"]), tmp_path, progress=False)
    assert len(records) == 2 * 3 and all(r["capture_s"] == 0 and r["context_tokens"] is None for r in records)
    assert all(r["error"].startswith("ValueError: context holds '<|im_end|>' (at character ") for r in records)
    from kvcompress.integration import build_prompt

    tokenizer.split_special_tokens = True  # a tokenizer that reads such text as text is taken at its word
    assert build_prompt(tokenizer, "Then <|im_end|> came.", "Why?")[0].shape[1] == len("Then <|im_end|> came.")

def test_the_command_line_names_a_length_past_the_model_and_fails_a_sweep_where_no_cell_answered(tiny_checkpoint, tmp_path, capsys):
    """Lengths past the model (2048 positions) name --lengths, in the sweep and the perplexity run; a sweep where every
    cell holds an error exits 1 (it exited 0), naming the first error."""
    from kvcompress.cli import main

    common = ["--model", str(tiny_checkpoint), "--methods", "knorm", "--no-progress", "--samples", "1"]
    assert main(["eval", "--tasks", "niah_single", "--lengths", "3000", *common, "--out", str(tmp_path / "a")]) == 2
    assert "error: --lengths 3000 exceeds the 2048 positions the model takes" in capsys.readouterr().err
    assert main(["eval", "--tasks", "perplexity", "--lengths", "512,4096", *common, "--out", str(tmp_path / "p")]) == 2
    assert "error: --lengths 4096 exceeds the 2048 positions the model takes" in capsys.readouterr().err
    assert main(["eval", "--tasks", "niah_single", "--lengths", "2040", "--ratios", "0.5", *common, "--out", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err
    assert re.search(r"kvcompress eval: no cell of .*/b answered: all 2 hold an error, the first: ValueError: the prompt has \d+ "
                     r"tokens but the model takes at most max_position_embeddings=2048", err)

def test_a_sweep_whose_every_cell_errored_still_reports(tiny, tmp_path, monkeypatch):
    """Every cell recorded with its error (e.g. a setting no method takes): the summary and the plots are written, the
    plots' panels empty, rather than the report failing."""
    model, tokenizer = tiny

    def refused(*args, **kwargs):
        raise ValueError("refused")

    monkeypatch.setattr(runner, "_answer", refused)
    records = run_sweep(model, tokenizer, small_config(grid_lengths=[], grid_depths=[]), tmp_path, progress=False)
    assert records and all(r["error"] == "ValueError: refused" for r in records)
    assert [p.name for p in plot_sweep(records, tmp_path)] == ["accuracy_vs_ratio_prefill.png"]


def test_prefill_reuse_matches_reprefilling(tiny, tmp_path):
    model, tokenizer = tiny
    config = dict(grid_lengths=[], grid_depths=[], tasks=["niah_single"], include_full=False, max_new_tokens=6)
    reused = run_sweep(model, tokenizer, small_config(**config), tmp_path / "a", progress=False)
    fresh = run_sweep(model, tokenizer, small_config(reuse_prefill=False, **config), tmp_path / "b", progress=False)
    assert [r["prediction"] for r in reused] == [r["prediction"] for r in fresh]
    assert all(r["capture_s"] > 0 for r in reused) and all(r["capture_s"] == 0 for r in fresh)


def test_kvzip_scored_cells_share_one_recorded_reconstruction_per_sample(tiny, tmp_path, monkeypatch):
    """With prefill reuse, every KVzip-scored cell of a sample (each ratio, kvzip and kvzip_refit built on its scores)
    compresses one recorded reconstruction, answering as cells that each reconstruct the context themselves."""
    from kvcompress.integration import reconstruction

    model, tokenizer = tiny
    calls = []
    real = reconstruction.record_reconstruction
    monkeypatch.setattr(reconstruction, "record_reconstruction", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    config = dict(methods=["kvzip", "kvzip_refit"], ratios=[0.5, 0.75], grid_lengths=[], grid_depths=[], tasks=["niah_single"],
                  include_full=False, max_new_tokens=4)
    reused = run_sweep(model, tokenizer, small_config(**config), tmp_path / "a", progress=False)
    assert len(reused) == 2 * 4 and all(r["error"] is None for r in reused) and len(calls) == 2  # one per sample
    fresh = run_sweep(model, tokenizer, small_config(reuse_prefill=False, **config), tmp_path / "b", progress=False)
    assert [r["prediction"] for r in reused] == [r["prediction"] for r in fresh]
    assert [r["kv_bytes"] for r in reused] == [r["kv_bytes"] for r in fresh]


def test_streaming_modes_and_unfit_cells_are_recorded(tiny, tmp_path):
    model, tokenizer = tiny
    config = small_config(methods=["streamingllm", "balancekv"], modes=["prefill", "chunked"], tasks=["niah_single"],
                          ratios=[0.9], lengths=[600], grid_lengths=[], grid_depths=[], samples=1, include_full=False)
    records = run_sweep(model, tokenizer, config, tmp_path, progress=False)
    by = {(r["method"], r["mode"]): r for r in records}
    assert by[("balancekv", "chunked")]["error"] is None
    # StreamingLLM keeps 4 sink + 64 window tokens exactly: no room at 600 tokens and ratio 0.9 (60 kept)
    assert "sink" in by[("streamingllm", "prefill")]["error"] and by[("streamingllm", "prefill")]["score"] is None
    md = write_summary(records, tmp_path)[1].read_text()
    assert "| streamingllm @ 0.9 (prefill) | n/a |" in md


def test_tasks_beyond_the_model_are_flagged_and_left_out_of_the_averages():
    def rec(method, ratio, task, score):
        return {"grid": False, "method": method, "ratio": ratio, "mode": "-" if method == FULL else "prefill",
                "task": task, "length": 1000, "depth": None, "error": None, "score": score, "wall_s": 1.0}

    records = [rec(FULL, None, "niah_single", 1.0), rec(FULL, None, "niah_multikey", 0.5),
               rec("knorm", 0.5, "niah_single", 0.0), rec("knorm", 0.5, "niah_multikey", 1.0)]
    assert runner.beyond_model(records) == ["niah_multikey"]
    lines = [ln for ln in runner.score_table(records).splitlines() if ln.startswith("|")]
    assert lines[0].split("|")[1:-1] == [" method @ ratio ", " niah_single ", " niah_multikey† ", " 1000 tok ", " all "]
    assert lines[2].split("|")[1:-1] == [" full cache ", " 100 (21–100) ", " 50 (5–95) ", " 100 (21–100) ", " 100 (21–100) "]
    assert lines[3].split("|")[1:-1] == [" knorm @ 0.5 ", " 0 (0–79) ", " 100 (21–100) ", " 0 (0–79) ", " 0 (0–79) "]
    assert "beyond this model" in runner.score_table(records)


def test_config_errors_name_the_parameter():
    for kw, name in [({"methods": ["nope"]}, "methods"), ({"ratios": [1.0]}, "ratios"), ({"tasks": ["x"]}, "tasks"),
                     ({"modes": ["fast"]}, "modes"), ({"samples": 0}, "samples"), ({"lengths": [10]}, "lengths"),
                     ({"grid_lengths": [100], "grid_depths": []}, "grid_lengths"), ({"grid_task": "common_words"}, "grid_task")]:
        with pytest.raises(ValueError, match=name):
            SweepConfig(**kw)
    with pytest.raises(ValueError, match="tokens"):
        ApproxConfig(tokens=300, sink=256, n_queries=256)


def test_task_params_reach_the_generator_and_the_cell_key(tiny, tmp_path):
    model, tokenizer = tiny
    config = small_config(tasks=["niah_multikey"], samples=1, grid_lengths=[], grid_depths=[],
                          task_params={"niah_multikey": {"n_keys": 3}})
    spec = runner.sample_specs(config)[0]
    assert len(spec.build(config, tokenizer).needles) == 3
    records = run_sweep(model, tokenizer, config, tmp_path, progress=False)
    assert all("niah_multikey;n_keys=3|" in r["key"] for r in records)
    for bad, name in [({"nope": {}}, "task"), ({"niah_single": {"n_keys": 2}}, "n_keys"), ({"niah_single": {"seed": 1}}, "seed")]:
        with pytest.raises(ValueError, match=name):
            SweepConfig(task_params=bad)
    args = build_parser().parse_args(["eval", "--task-param", "niah_multikey.n_keys=4", "--task-param", "line_retrieval.n_lines=1"])
    from kvcompress.commands.eval import _sweep_config

    assert _sweep_config(args).task_params == {"niah_multikey": {"n_keys": 4}, "line_retrieval": {"n_lines": 1}}


def test_approx_bench_rows_error_bars_and_exactness(tiny, tmp_path):
    model, tokenizer = tiny
    config = ApproxConfig(methods=["random", "knorm"], ratios=[0.0, 0.75], layers=[0, 1], tokens=240, n_queries=32, sink=16, seeds=3)
    rows = run_approx(model, tokenizer, config, progress=False)
    assert len(rows) == 2 * 2 * 2
    cell = {(r["method"], r["ratio"], r["layer"]): r for r in rows}
    for layer in (0, 1):
        for method in ("random", "knorm"):
            assert cell[(method, 0.0, layer)]["error_mean"] < 1e-4  # nothing removed: exact attention
            assert 0.0 < cell[(method, 0.75, layer)]["error_mean"] < 2.0
        assert cell[("knorm", 0.75, layer)]["error_std"] == pytest.approx(0.0, abs=1e-12)  # deterministic (up to the mean's rounding)
        assert cell[("random", 0.75, layer)]["error_std"] > 0.0  # seeds differ
    csv_path, md_path = write_approx(rows, tmp_path, config)
    assert len(list(csv.DictReader(csv_path.open()))) == len(rows)
    settings, _, *table = md_path.read_text().splitlines()  # the settings were not recorded (--text-seed, --sink, --queries)
    assert settings == "Text seed 0, 240 tokens, the last 32 as queries, a sink of 16, 3 seeds per cell."
    assert table[0] == "| method | ratio | layer 0 | layer 1 | mean over layers |"
    knorm = [cell[("knorm", 0.75, layer)]["error_mean"] for layer in (0, 1)]
    assert table[-1].endswith(f"| {(knorm[0] + knorm[1]) / 2:.3f} |")
    assert plot_approx(rows, tmp_path / "approx.png").stat().st_size > 1000
    # past the model's positions: refused before any capture (it ran, and reported the length it was given)
    too_long = model.config.max_position_embeddings + 1
    with pytest.raises(ValueError, match=rf"^tokens {too_long} exceeds the {too_long - 1} positions the model takes"):
        run_approx(model, tokenizer, ApproxConfig(methods=["knorm"], ratios=[0.5], layers=[0], tokens=too_long, n_queries=32, sink=16,
                                                  seeds=1), progress=False)


def test_eval_help_documents_every_option(capsys):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["eval"]
    for action in sub._actions:
        if action.dest != "help":
            assert action.help, action.dest
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "--help"])
    out = capsys.readouterr().out
    assert "approx" in out and "resumes" in out
    args = parser.parse_args(["eval", "approx", "--layers", "1,2", "--ratios", "0.5,0.75"])
    assert args.bench == "approx" and args.layers == [1, 2] and args.ratios == [0.5, 0.75]


def test_sweep_runs_the_library_default_and_records_what_it_resolved_to(tiny, tmp_path, tiny_default_scorer, monkeypatch):
    """`default` is a sweep method (and in the sweep's default methods): in each mode it runs the mode's default method
    (`options.DEFAULT_METHODS`; on the tiny model a random scorer of its shapes stands for the shipped one), and each
    record names the method and parameters it stood for. KVzap reads the layers' hidden states, so a prefill cell runs
    its own forward rather than a recorded prefill (which keeps none)."""
    from kvcompress.methods.registry import method_names
    from kvcompress.options import DEFAULT, DEFAULT_METHODS

    assert SweepConfig().methods == [DEFAULT, *method_names()]
    assert build_parser().parse_args(["eval", "--methods", "default,knorm"]).methods == ["default", "knorm"]
    model, tokenizer = tiny
    config = small_config(methods=[DEFAULT, "knorm"], modes=["prefill", "chunked"], tasks=["niah_single"], samples=1,
                          grid_lengths=[], grid_depths=[], lengths=[300])
    records = run_sweep(model, tokenizer, config, tmp_path, progress=False)
    assert all(r["error"] is None for r in records), [r["error"] for r in records]
    for mode in ("prefill", "chunked"):
        (default,) = [r for r in records if r["method"] == DEFAULT and r["mode"] == mode]
        name, params, exact = DEFAULT_METHODS[mode]
        assert (default["resolved_method"], default["method_params"]) == (name, params | exact)
        assert default["kv_bytes"] < default["kv_bytes_full"]
    (knorm,) = [r for r in records if r["method"] == "knorm" and r["mode"] == "prefill"]
    assert (knorm["resolved_method"], knorm["method_params"]) == ("knorm", {})
    assert "resolved_method" not in next(r for r in records if r["method"] == FULL)
    _, md_path = write_summary(records, tmp_path)
    shown = [f"{mode}: {DEFAULT_METHODS[mode][0]}({', '.join(f'{k}={v}' for k, v in sorted((DEFAULT_METHODS[mode][1] | DEFAULT_METHODS[mode][2]).items()))})"
             for mode in ("prefill", "chunked")]
    assert f"`default` is the library's default method, here: {'; '.join(shown)}." in md_path.read_text()
    with pytest.raises(ValueError, match="methods"):
        ApproxConfig(methods=[DEFAULT])
    # the folder records what `default` stood for: a kvcompress whose default differs would key its cells by the same
    # name, so it may not add to them (the same run continues; a run without `default` is not concerned)
    assert json.loads((tmp_path / "config.json").read_text())["named_settings"] == json.loads(json.dumps({DEFAULT: DEFAULT_METHODS}))
    assert run_sweep(model, tokenizer, config, tmp_path, progress=False) == records
    monkeypatch.setitem(runner.NAMED_SETTINGS, DEFAULT, DEFAULT_METHODS | {"prefill": ("snapkv", {}, {})})
    with pytest.raises(ValueError, match=r"holds the results of another run: method 'default' \(--methods\) stands for .*'snapkv'.* "
                                         r"in this kvcompress, there for .*'kvzap'"):
        run_sweep(model, tokenizer, config, tmp_path, progress=False)
    run_sweep(model, tokenizer, replace(config, methods=["knorm"]), tmp_path, progress=False)


def test_attention_mass_methods_get_their_own_recorded_prefill(tiny, tmp_path, monkeypatch):
    """H2O's prefill is recorded through the attention that computes its mass; every other cell answers from
    a recording of the model's own attention, so its answer does not depend on whether H2O shares the run."""
    model, tokenizer = tiny
    flags, used = [], {}
    real_capture, real_answer = runner.capture_qkv, runner._answer

    def capture(*args, **kwargs):
        flags.append(kwargs["attention_mass"])
        return real_capture(*args, **kwargs)

    def answer(model, cell, context_ids, question_ids, captured, *rest):
        used[cell.method, cell.mode] = None if captured is None else any(len(t) == 4 for t in captured.values())
        return real_answer(model, cell, context_ids, question_ids, captured, *rest)

    monkeypatch.setattr(runner, "capture_qkv", capture)
    monkeypatch.setattr(runner, "_answer", answer)
    config = dict(grid_lengths=[], grid_depths=[], tasks=["niah_single"], samples=1, max_new_tokens=4, modes=["prefill", "chunked"])
    mixed = run_sweep(model, tokenizer, small_config(methods=["h2o", "snapkv"], **config), tmp_path / "a", progress=False)
    assert flags == [False, True]
    assert used == {(FULL, "-"): False, ("snapkv", "prefill"): False, ("h2o", "prefill"): True,
                    ("snapkv", "chunked"): None, ("h2o", "chunked"): None}
    flags.clear()
    alone = run_sweep(model, tokenizer, small_config(methods=["snapkv"], **config), tmp_path / "b", progress=False)
    assert flags == [False]
    by_key = {r["key"]: r for r in mixed}
    assert all(r["error"] is None and r["prediction"] == by_key[r["key"]]["prediction"] for r in alone)
    streamed = [r for r in mixed if r["mode"] == "chunked"]
    assert streamed and all(r["capture_s"] == 0 for r in streamed)
    assert all(r["capture_s"] > 0 for r in mixed if r["mode"] != "chunked")


def test_needle_heatmap_panels_name_their_mode_when_the_sweep_has_several(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from kvcompress.eval.plots import plot_needle_heatmaps

    def records(modes):
        cells = [("full", None, "-", 1.0)] + [("snapkv", 0.75, mode, score) for mode, score in modes]
        return [dict(grid=True, method=m, ratio=r, mode=mode, task="niah_single", length=n, depth=d, index=0, score=s, error=None, wall_s=1.0)
                for m, r, mode, s in cells for n in (256, 512) for d in (0.0, 1.0)]

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    plot_needle_heatmaps(records([("prefill", 1.0), ("chunked", 0.0)]), tmp_path / "two.png")
    plot_needle_heatmaps(records([("prefill", 1.0)]), tmp_path / "one.png")
    titles = [[ax.get_title() for ax in fig.axes if ax.get_title()] for fig in saved]
    assert titles == [["full cache", "snapkv @ 0.75 (chunked)", "snapkv @ 0.75 (prefill)"], ["full cache", "snapkv @ 0.75"]]


def test_the_figure_legend_names_every_line_and_flags_partial_points():
    """The legend was read from the first panel only: a method with no answered cell there was drawn but not named.
    A point whose cells did not all run gets a hollow marker, the tables' *."""
    from matplotlib.figure import Figure

    from kvcompress.eval.plots import ERRORED_LABEL, figure_legend, mark_errored

    fig = Figure()
    axes = fig.subplots(1, 2, squeeze=False)
    axes[0, 0].plot([0.5], [1.0], label="keydiff")
    axes[0, 1].plot([0.5], [0.2], label="snapkv")
    mark_errored(axes[0, 1], [0.5, 0.75], [0.2, 0.1], [True, False], "red")
    figure_legend(fig, axes)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["keydiff", "snapkv", ERRORED_LABEL]
    hollow = [line for line in axes[0, 1].get_lines() if line.get_label() == ERRORED_LABEL]
    assert len(hollow) == 1 and list(hollow[0].get_xdata()) == [0.5] and hollow[0].get_markerfacecolor() == "white"


def test_task_param_values_are_checked_when_the_sweep_is_configured(tmp_path, capsys):
    """A task parameter's value was checked, if at all, by its generator once the model had loaded: n_keys=2.5 ended in a
    traceback, n_keys=1000000 in "Sample larger than population", n_chains=20000 never ended, true was taken as 1."""
    for params, message in [({"niah_multikey": {"n_keys": 2.5}}, r"task_params\['niah_multikey'\]\['n_keys'\] must be an integer >= 2, got 2\.5"),
                            ({"common_words": {"n_common": True}}, r"task_params\['common_words'\]\['n_common'\] must be an integer >= 1, got True"),
                            ({"niah_multikey": {"n_keys": 1000}}, r"task_params\['niah_multikey'\]\['n_keys'\] must be at most \d+ with words")]:
        with pytest.raises(ValueError, match=message):
            SweepConfig(tasks=["niah_multikey", "common_words"], kind="words", task_params=params)
    with pytest.raises(ValueError, match=r"kind must be one of \('numbers', 'words', 'uuids'\), got 'colors'"):
        SweepConfig(kind="colors")
    from kvcompress.cli import main

    for param, tasks, message in [
        ("niah_multikey.n_keys=2.5", "niah_multikey", "--task-param niah_multikey.n_keys must be an integer >= 2, got 2.5"),
        ("frequent_words.vocab_size=None", "frequent_words", "--task-param frequent_words.vocab_size must be an integer in [4, "),
        ("niah_multikey.n_keys=1000000", "niah_multikey", "--task-param niah_multikey.n_keys must be at most "),
        ("frequent_words.alpha=nan", "frequent_words", "--task-param frequent_words.alpha must be a finite number >= 1.0, got nan"),
        ("variable_tracking.n_chains=20000", "variable_tracking",
         "--task-param variable_tracking.n_chains × (--task-param variable_tracking.n_hops + 1), the variables named, must be at most 10000"),
        ("common_words.n_common=true", "common_words", "--task-param common_words.n_common must be an integer >= 1, got True"),
    ]:
        # refused before the model loads (which would fail on this path), on one line
        assert main(["eval", "--model", str(tmp_path / "no-model"), "--tasks", tasks, "--methods", "knorm", "--task-param", param,
                     "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvcompress eval: error: {message}") and err.count("\n") == 1, err
    # with --kind words, niah_multikey's keys and values share the vocabulary: half as many keys
    assert main(["eval", "--model", str(tmp_path / "no-model"), "--tasks", "niah_multikey", "--kind", "words", "--task-param",
                 "niah_multikey.n_keys=1000", "--out", str(tmp_path / "out")]) == 2
    assert "--task-param niah_multikey.n_keys must be at most" in capsys.readouterr().err
