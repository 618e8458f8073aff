"""End-to-end on the real default model (SmolLM2-135M-Instruct): select with `-m e2e`."""

import pytest

import kvcompress as kvc
from kvcompress.cli import main
from kvcompress.eval.tasks import niah_single, score

pytestmark = [pytest.mark.e2e, pytest.mark.smoke]


@pytest.fixture(scope="module")
def needle(default_model):
    _, tokenizer = default_model
    return niah_single(target_tokens=2000, depth=0.5, seed=3, tokenizer=tokenizer)


# SnapKV scores tokens by the attention of the last queries: it is built for question-aware
# compression (the question inside the compressed prompt). Query-agnostic (the default, question
# appended after compression) its observation window sees only haystack and it misses this needle.
@pytest.mark.parametrize("method, ratio", [(None, None), ("snapkv", 0.5)])
def test_needle_answered_with_full_cache_and_snapkv_half(default_model, needle, method, ratio):
    model, tokenizer = default_model
    res = kvc.generate(model, tokenizer, needle.context, needle.question, method=method, compression_ratio=ratio,
                       max_new_tokens=32, progress=False, compress_question=method is not None)
    assert score(needle, res.text) == 1.0, res.text
    if method is not None:
        assert res.kv_bytes < 0.55 * res.kv_bytes_full


def test_cli_generate_prints_answer_and_stats(tmp_path, capsys, needle):
    context = tmp_path / "context.txt"
    context.write_text(needle.context)
    code = main(["generate", "--method", "snapkv", "--compression-ratio", "0.5", "--context-file", str(context),
                 "--question", needle.question, "--max-new-tokens", "32", "--compress-question"])
    out = capsys.readouterr().out
    assert code == 0
    assert needle.answers[0] in out
    assert "tokens kept/layer" in out and "KV bytes" in out and "prefill" in out


def test_cli_reports_bad_input(tmp_path, capsys):
    context = tmp_path / "context.txt"
    context.write_text("some text")
    assert main(["generate", "--method", "nope", "--budget", "8", "--context-file", str(context)]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err
    assert main(["generate", "--method", "knorm", "--compression-ratio", "1.2", "--context-file", str(context)]) == 2
    assert "compression_ratio must be in [0, 1)" in capsys.readouterr().err
    assert main(["generate", "--method", "knorm", "--budget", "8", "--context-file", str(tmp_path / "missing.txt")]) == 2
