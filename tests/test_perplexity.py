"""Language modelling under compression (`kvcompress.eval.perplexity`, `kvcompress eval --tasks perplexity`) on tiny random models."""

import json
import math
from dataclasses import replace

import pytest
import torch
from scipy import stats as scipy_stats

import kvcompress as kvc
from registered import SHARED
from kvcompress.cli import main
from kvcompress.eval.leaderboard import leaderboard, markdown_leaderboard
from kvcompress.eval.perplexity import (
    PERPLEXITY,
    PerplexityConfig,
    continuation_nll,
    prose_document,
    run_perplexity,
    stream_budget,
    summarize,
    write_report,
)
from kvcompress.eval.runner import FULL, RESULTS_FILE, read_results
from kvcompress.integration import load_model
from kvcompress.methods.registry import build_method

from test_integration import tiny

N, N_CONTEXT = 160, 120


@pytest.fixture(scope="module")
def document():
    return torch.randint(0, 96, (1, N), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def checkpoint_model(tiny_checkpoint):
    """The conftest's tiny Llama with its byte-level tokenizer (vocabulary 256, up to 2048 positions)."""
    return load_model(tiny_checkpoint)


def test_full_cache_nll_is_a_plain_forwards(document):
    """Teacher forcing in blocks through a DynamicCache scores token j with the logits of position j - 1."""
    model = tiny()
    nll = continuation_nll(model, document, N_CONTEXT, block=16)
    with torch.inference_mode():
        logits = model(document).logits[0]
    expected = torch.nn.functional.cross_entropy(logits[N_CONTEXT - 1 : N - 1], document[0, N_CONTEXT:], reduction="none")
    assert nll.shape == (N - N_CONTEXT,) and nll.dtype == torch.float32
    torch.testing.assert_close(nll, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_every_method_at_ratio_zero_scores_as_the_full_cache(document, mode):
    model = tiny()
    reference = continuation_nll(model, document, N_CONTEXT, block=16)
    for method in [m for m in SHARED if mode in build_method(m).requirements.modes]:  # KVzip: prefill only
        sizes = [{"compression_ratio": 0.0}] if mode == "prefill" else [{"budget": stream_budget(method, 0.0, N)}, {"budget": 1000}]
        for size in sizes:
            nll = continuation_nll(model, document, N_CONTEXT, method, mode=mode, block=16, chunk_size=32, **size)
            torch.testing.assert_close(nll, reference, rtol=1e-5, atol=1e-5, msg=lambda m: f"{method} {mode} {size}: {m}")
    size = {"compression_ratio": 0.3} if mode == "prefill" else {"budget": stream_budget("snapkv", 0.3, N)}
    compressed = continuation_nll(model, document, N_CONTEXT, "snapkv", mode=mode, block=16, chunk_size=32, **size)
    assert torch.isfinite(compressed).all() and (compressed - reference).abs().max() > 1e-3  # compression does change the NLL


@pytest.mark.parametrize("mode", ["prefill", "chunked", "decode"])
def test_the_default_method_scores_in_every_mode(document, mode, tiny_default_scorer):
    """`default` is a perplexity method (the library's default, AdaKV over KVzap; on the tiny model a random scorer of its
    shapes stands for the shipped one): at ratio 0 its NLL is the full cache's, at 0.4 (room beyond its sink and window
    of 68 tokens) it differs and stays finite."""
    model = tiny()
    reference = continuation_nll(model, document, N_CONTEXT, block=16)
    streamed = N if mode == "decode" else N_CONTEXT  # the tokens the stream takes
    size = (lambda r: {"compression_ratio": r}) if mode == "prefill" else (lambda r: {"budget": stream_budget("default", r, streamed)})
    exact = continuation_nll(model, document, N_CONTEXT, "default", mode=mode, block=16, chunk_size=32, **size(0.0))
    torch.testing.assert_close(exact, reference, rtol=1e-5, atol=1e-5)
    compressed = continuation_nll(model, document, N_CONTEXT, "default", mode=mode, block=16, chunk_size=32, **size(0.4))
    assert torch.isfinite(compressed).all() and (compressed - reference).abs().max() > 1e-3
    assert PerplexityConfig(methods=["default"]).methods == ["default"]


def test_documents_are_reproducible_distinct_and_exactly_long(checkpoint_model):
    _, tokenizer = checkpoint_model
    docs = [prose_document(i, 2048, tokenizer) for i in range(30)]
    assert all(len(d.ids) == 2048 for d in docs)
    assert len({d.first_paragraph for d in docs}) == 30 and len({tuple(d.ids) for d in docs}) == 30
    assert prose_document(7, 2048, tokenizer).ids == docs[7].ids
    assert prose_document(7, 512, tokenizer).ids == docs[7].ids[:512]
    assert prose_document(0, 2048, tokenizer, seed=1).first_paragraph != docs[0].first_paragraph
    with pytest.raises(ValueError, match="n_tokens must be at most the prose's size.*got 10000000"):
        prose_document(0, 10_000_000, tokenizer)


def test_run_records_summary_leaderboard_and_resume(checkpoint_model, tmp_path):
    model, tokenizer = checkpoint_model
    config = PerplexityConfig(methods=["snapkv", "streamingllm"], ratios=[0.5], lengths=[256], documents=3, block=32, chunk_size=64)
    records = run_perplexity(model, tokenizer, config, tmp_path, progress=False)
    assert len(records) == 3 * (1 + 2 * 2) and len({r["key"] for r in records}) == len(records)
    for r in records:
        assert r["error"] is None and r["task"] == r["benchmark"] == PERPLEXITY and r["lower_is_better"]
        assert (r["context_tokens"], r["scored_tokens"]) == (192, 64)
        assert math.isfinite(r["nll_mean"]) and r["score"] == pytest.approx(math.exp(r["nll_mean"]))
        assert (r["kv_bytes"] == r["kv_bytes_full"]) == (r["method"] == FULL)
        assert (r["budget"] is not None) == (r["mode"] == "decode")
    assert {(r["method"], r["mode"]) for r in records} == {(FULL, "-"), *((m, mode) for m in ("snapkv", "streamingllm") for mode in ("prefill", "decode"))}

    paths = write_report(records, tmp_path)
    assert [p.name for p in paths] == ["summary.md", "summary.csv", "leaderboard_perplexity.md", "leaderboard_perplexity.html", "leaderboard_perplexity.png"]
    summary = paths[0].read_text()
    assert "lower is better" in summary and "| full cache | 256 | 3 |" in summary and "| snapkv @ 0.5 (decode) | 256 | 3 |" in summary
    board = paths[2].read_text()
    assert "lower is better" in board and "| snapkv @ 0.5 (decode) |" in board
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["task"] == PERPLEXITY and meta["named_settings"] == {}  # no named setting among its methods (`check_same_run`)

    before = (tmp_path / RESULTS_FILE).read_text()
    assert run_perplexity(model, tokenizer, config, tmp_path, progress=False) == records  # every cell recorded: nothing rerun
    assert (tmp_path / RESULTS_FILE).read_text() == before
    # another setting of the scored tokens would be summarised with these documents as if it were the same run: refused
    with pytest.raises(ValueError, match=r"holds the results of another run: block \(--block\) 8, there 32"):
        run_perplexity(model, tokenizer, replace(config, block=8), tmp_path, progress=False)


def _records(full_nll, method_nll):
    rec = lambda method, i, nll: {"task": PERPLEXITY, "benchmark": PERPLEXITY, "lower_is_better": True, "length": 512, "index": i,  # noqa: E731
                                   "method": method, "ratio": None if method == FULL else 0.5, "mode": "-" if method == FULL else "decode",
                                   "nll_mean": nll, "score": math.exp(nll), "error": None, "kv_bytes": 1, "kv_bytes_full": 2, "wall_s": 1.0}
    return [rec(FULL, i, x) for i, x in enumerate(full_nll)] + [rec("knorm", i, x) for i, x in enumerate(method_nll)]


def test_intervals_are_over_documents_and_paired_with_the_full_cache():
    full = [2.0, 3.0, 4.5, 2.5]
    records = _records(full, [x + 0.1 for x in full])  # documents vary a lot; the method adds exactly 0.1 nat to each
    rows = {r["method"]: r for r in summarize(records)}
    low, high = scipy_stats.t.interval(0.95, len(full) - 1, loc=sum(full) / 4, scale=scipy_stats.sem(full))
    assert rows[FULL]["n"] == 4 and rows[FULL]["perplexity"] == pytest.approx(math.exp(sum(full) / 4))
    assert (rows[FULL]["ppl_low"], rows[FULL]["ppl_high"]) == pytest.approx((math.exp(low), math.exp(high)))
    knorm = rows["knorm"]
    assert knorm["pairs"] == 4 and knorm["ratio_to_full"] == pytest.approx(math.exp(0.1))
    assert knorm["ratio_low"] == pytest.approx(math.exp(0.1)) and knorm["ratio_high"] == pytest.approx(math.exp(0.1))  # paired: no spread
    assert knorm["ppl_high"] / knorm["ppl_low"] > 5  # unpaired: the documents' spread
    _, entries, cells = leaderboard(records)
    cell = cells[(("knorm", 0.5, "decode"), PERPLEXITY)]
    assert (cell["mean"], cell["low"], cell["high"]) == pytest.approx((knorm["perplexity"], knorm["ppl_low"], knorm["ppl_high"]))
    assert f"{knorm['perplexity']:.2f} [" in markdown_leaderboard(PERPLEXITY, records)  # as is, not × 100
    one = summarize(_records([2.0], [2.5]))
    assert all(math.isnan(r["ppl_low"]) for r in one)  # one document: no interval


def test_bad_input_names_the_parameter_and_what_is_accepted(document):
    for kwargs, message in [
        ({"methods": ["zip"]}, r"methods must be among \[.*'snapkv'.*\], got \['zip'\]"),
        ({"modes": ["fast"]}, r"modes must be among .*got \['fast'\]"),
        ({"ratios": [1.0]}, r"ratios must be numbers in \[0, 1\).*got 1.0"),
        ({"lengths": [10]}, r"lengths must be integers >= 64.*got 10"),
        ({"documents": 0}, r"documents must be an integer >= 1, got 0"),
        ({"context_fraction": 1.0}, r"context_fraction must be a number in \(0, 1\).*got 1.0"),
        ({"block": 0}, r"block must be an integer >= 1, got 0"),
        ({"chunk_size": 2.5}, r"chunk_size must be an integer >= 1, got 2.5"),
    ]:
        with pytest.raises(ValueError, match=message):
            PerplexityConfig(**kwargs)
    model = tiny()
    with pytest.raises(ValueError, match=r"n_context must be in \[1, n - 1\] = \[1, 159\].*got 160"):
        continuation_nll(model, document, N)
    with pytest.raises(ValueError, match=r"ids must be an integer tensor \[1, n\].*float32"):
        continuation_nll(model, document.float(), N_CONTEXT)
    with pytest.raises(ValueError, match="method=None is the full cache.*compression_ratio=0.5"):
        continuation_nll(model, document, N_CONTEXT, compression_ratio=0.5)


def test_cli_runs_the_task_with_its_default_modes(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "ppl"
    status = main(["eval", "--tasks", "perplexity", "--model", str(tiny_checkpoint), "--methods", "knorm", "--ratios", "0.25",
                   "--lengths", "256", "--samples", "2", "--block", "16", "--chunk-size", "32", "--context-fraction", "0.5",
                   "--threads", str(torch.get_num_threads()), "--no-progress", "--out", str(out)])
    assert status == 0
    printed = capsys.readouterr().out
    assert "| knorm @ 0.25 (prefill) | 256 | 2 |" in printed and "| knorm @ 0.25 (decode) | 256 | 2 |" in printed
    records = read_results(out / RESULTS_FILE)
    assert len(records) == 2 * (1 + 2) and {r["context_tokens"] for r in records} == {128}
    assert all(r["error"] is None and f"{PERPLEXITY};seed=0;context=0.5;block=16;chunk=32|256|" in r["key"] for r in records)
    assert (out / "leaderboard_perplexity.md").is_file() and (out / "summary.csv").is_file()
