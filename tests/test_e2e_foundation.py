"""End-to-end on the real default model (SmolLM2-135M-Instruct): select with `-m e2e`."""

import pytest

import kvcompress as kvc
from kvcompress.cli import main
from kvcompress.eval.tasks import niah_single, score

# Every test here runs on the real model (e2e); those marked smoke also run in `make test`. The 2000-token needle
# answered by the full cache and by SnapKV, and the CLI printing it, are e2e only: the README's examples
# (tests/test_readme.py) and tests/test_smoke_features.py run the same paths on shorter contexts.
pytestmark = pytest.mark.e2e


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


@pytest.mark.smoke
def test_cli_reports_bad_input(tmp_path, capsys):
    context = tmp_path / "context.txt"
    context.write_text("some text")
    assert main(["generate", "--method", "nope", "--budget", "8", "--context-file", str(context)]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err
    assert main(["generate", "--method", "knorm", "--compression-ratio", "1.2", "--context-file", str(context)]) == 2
    assert "error: --compression-ratio must be in [0, 1)" in capsys.readouterr().err
    assert main(["generate", "--method", "knorm", "--budget", "8", "--context-file", str(tmp_path / "missing.txt")]) == 2


@pytest.mark.smoke
def test_the_default_method_answers_a_padded_batch_as_each_context_alone(default_model):
    """The default (AdaKV over KVzap's scores, one budget over the model) cannot compress the rows of one padded forward
    apart: each context is compressed and answered alone, with its solo answer. (Contexts of 150 tokens and more: the
    default keeps its sink and window of 68 tokens exactly, and a ratio of 0.5 must leave room beyond them.)"""
    model, tokenizer = default_model
    contexts = ["The magic number is 4217. " + "The sky was grey all morning, and the streets were wet with rain. " * 10,
                "Anna keeps her keys in the blue bowl by the door. She bought the bowl in Lisbon last summer. "
                + "The door is painted green, and the hall smells of coffee. " * 14]
    question = "What is the magic number, or where are the keys?"
    run = dict(compression_ratio=0.5, max_new_tokens=6, progress=False)
    batch = kvc.generate(model, tokenizer, contexts, question, **run)
    for context, res in zip(contexts, batch):
        alone = kvc.generate(model, tokenizer, context, question, **run)
        assert res.token_ids == alone.token_ids and res.text == alone.text
        assert res.method == "adakv" and res.extra["batch_run"] == "one_by_one" and res.kv_bytes < res.kv_bytes_full


@pytest.mark.smoke
def test_a_calibration_of_another_method_is_refused_before_the_model_runs(default_model, tmp_path):
    from kvcompress.calibration import Calibration

    model, tokenizer = default_model
    path = tmp_path / "compactor.json"
    Calibration("compactor", alpha=0.0, beta=-3.0, model="SmolLM2-135M-Instruct").save(path)
    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(ValueError, match="calibration was fitted for method 'compactor', got method='keydiff'"):
            kvc.generate(model, tokenizer, "The magic number is 4217.", "What is the magic number?", method="keydiff",
                         calibration=path, quality=0.9, progress=False)
    finally:
        hook.remove()
    assert forwards == []
