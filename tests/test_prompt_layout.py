"""Prompt layouts: build_prompt's exact token split per layout, refused layouts, and the layout reaching
the pipeline and every record of the evaluation (byte-level tiny checkpoint, no model quality involved)."""

import json

import pytest
import torch
from test_hf import _word_tokenizer, tiny
from transformers import AutoTokenizer

from kvcompress.eval import runner
from kvcompress.eval.runner import SweepConfig, read_results, run_sweep, write_summary
from kvcompress.integration.model import (
    DEFAULT_PROMPT_LAYOUT,
    PROMPT_LAYOUTS,
    PromptLayout,
    build_prompt,
    load_model,
    prompt_layout,
)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONTEXT = "The archivist was Margaret Okafor. The sky is blue."
QUESTION = "Who was the archivist?"
PREFIX = "The archivist was"


@pytest.fixture(scope="module")
def byte_tokenizer(tiny_checkpoint):
    """The tiny checkpoint's byte-level tokenizer (one token per byte), without and with a ChatML template."""
    plain = AutoTokenizer.from_pretrained(tiny_checkpoint)
    chat = AutoTokenizer.from_pretrained(tiny_checkpoint)
    chat.chat_template = CHATML
    return plain, chat


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


@pytest.mark.parametrize("name", list(PROMPT_LAYOUTS))
def test_each_layout_splits_context_from_separator_question_and_primed_prefix(byte_tokenizer, name):
    _, tok = byte_tokenizer
    layout = PROMPT_LAYOUTS[name]
    context_ids, question_ids = build_prompt(tok, CONTEXT, QUESTION, PREFIX, name)
    closing = "<|im_end|>\n<|im_start|>assistant\n"
    assert torch.equal(context_ids, _ids(tok, "<|im_start|>user\n" + CONTEXT))
    expected = layout.separator + QUESTION + closing + (PREFIX if layout.primed else "")
    assert torch.equal(question_ids, _ids(tok, expected))
    assert tok.decode(question_ids[0]) == expected
    assert torch.equal(build_prompt(tok, CONTEXT, QUESTION, PREFIX, layout)[1], question_ids)  # the object, as its name
    # question None: the split falls at the end of the context, and only the closing tokens follow
    assert torch.equal(build_prompt(tok, CONTEXT, None, PREFIX, name)[1], _ids(tok, closing + (PREFIX if layout.primed else "")))


def test_layouts_differ_only_after_the_context(byte_tokenizer):
    plain, chat = byte_tokenizer
    for tok in (plain, chat):
        splits = {name: build_prompt(tok, CONTEXT, QUESTION, PREFIX, name) for name in PROMPT_LAYOUTS}
        assert all(torch.equal(c, splits["newline"][0]) for c, _ in splits.values())  # one compressed context serves every layout
        assert len({tuple(q[0].tolist()) for _, q in splits.values()}) == len(PROMPT_LAYOUTS)
    # without a chat template the plain text is used: context, separator, question, primed prefix
    context_ids, question_ids = build_prompt(plain, CONTEXT, QUESTION, PREFIX, "newline_primed")
    assert plain.decode(torch.cat([context_ids, question_ids], 1)[0]) == CONTEXT + "\n" + QUESTION + PREFIX
    assert torch.equal(torch.cat(build_prompt(chat, CONTEXT, QUESTION), 1), torch.cat(build_prompt(chat, CONTEXT, QUESTION, "", DEFAULT_PROMPT_LAYOUT), 1))


def test_a_layout_built_by_hand_is_used_and_named_by_its_fields(byte_tokenizer):
    _, tok = byte_tokenizer
    layout = PromptLayout("\n\nQuestion: ", primed=False)
    _, question_ids = build_prompt(tok, CONTEXT, QUESTION, PREFIX, layout)
    assert tok.decode(question_ids[0]).startswith("\n\nQuestion: " + QUESTION + "<|im_end|>")
    assert layout.name == "separator='\\n\\nQuestion: ',primed=False"
    assert PromptLayout("\n", primed=True).name == "newline_primed"


@pytest.mark.parametrize("bad, message", [
    (lambda: prompt_layout("kvpress"), "layout must be one of blank_line, newline, blank_line_primed, newline_primed or a PromptLayout, got 'kvpress'"),
    (lambda: prompt_layout(None), "layout must be one of .* got None"),
    (lambda: prompt_layout({"separator": "\n"}), "layout must be one of .* got {'separator'"),
    (lambda: PromptLayout("", primed=True), "PromptLayout separator must be a non-empty string .* got ''"),
    (lambda: PromptLayout(None, primed=True), "PromptLayout separator must be a non-empty string .* got None"),
    (lambda: PromptLayout("\n", primed="yes"), "PromptLayout primed must be True or False, got 'yes'"),
    (lambda: SweepConfig(prompt_layout="blank"), "prompt_layout must be one of .* got 'blank'"),
])
def test_bad_layouts_are_refused_naming_what_was_given_and_what_is_accepted(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


def test_build_prompt_refuses_a_bad_layout_before_tokenizing(byte_tokenizer):
    _, tok = byte_tokenizer
    with pytest.raises(ValueError, match="layout must be one of .* got 'newlines'"):
        build_prompt(tok, CONTEXT, QUESTION, layout="newlines")


def test_pipeline_takes_the_prompt_layout():
    from transformers import pipeline

    from kvcompress.integration import PIPELINE_TASK, answer_questions_ids

    model, tokenizer = tiny("qwen2"), _word_tokenizer()
    context = " ".join(f"w{i % 90}" for i in range(3, 163))
    options = dict(method="snapkv", compression_ratio=0.5, window=8, max_new_tokens=5, stop_at_eos=False)
    pipe = pipeline(PIPELINE_TASK, model=model, tokenizer=tokenizer)
    answers = {}
    for name, prefix in (("newline", ""), ("newline_primed", "w11 w12 w13")):  # a prefix takes a primed layout
        out = pipe(context, question="w5 w7", answer_prefix=prefix, prompt_layout=name, **options)
        context_ids, question_ids = build_prompt(tokenizer, context, "w5 w7", prefix, name)
        (direct,) = answer_questions_ids(model, context_ids, [question_ids], **options)
        assert out["result"].token_ids == direct.token_ids
        answers[name] = out["result"].token_ids
    assert answers["newline"] != answers["newline_primed"]  # the primed prompt ends with the prefix's three tokens
    with pytest.raises(ValueError, match="prompt_layout must be one of .* got 'primed'"):
        pipe(context, question="w5", prompt_layout="primed", **options)


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint):
    return load_model(str(tiny_checkpoint), device="cpu")


def _config(**kw):
    return SweepConfig(**(dict(methods=["knorm"], ratios=[0.5], tasks=["niah_prose", "niah_single"], lengths=[200], samples=1,
                               max_new_tokens=2) | kw))


def test_the_sweep_answers_in_its_layout_and_records_it(tiny_model, tmp_path, monkeypatch):
    model, tokenizer = tiny_model
    config = _config(prompt_layout="newline")
    asked = {}
    real_answer = runner._answer

    def spy(model, cell, context_ids, question_ids, *rest):
        asked[cell.key] = question_ids
        return real_answer(model, cell, context_ids, question_ids, *rest)

    monkeypatch.setattr(runner, "_answer", spy)
    records = run_sweep(model, tokenizer, config, tmp_path, progress=False)
    assert len(records) == 4 and {r["prompt_layout"] for r in records} == {"newline"}
    for spec in runner.sample_specs(config):
        sample = spec.build(config, tokenizer)
        expected = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix, "newline")[1]
        for key, question_ids in asked.items():
            if f"|{spec.task}|" in key:
                assert torch.equal(question_ids, expected)
                assert not tokenizer.decode(question_ids[0]).startswith("\n\n")
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["config"]["prompt_layout"] == {"separator": "\n", "primed": False}
    assert "Prompt layout: newline." in write_summary(records, tmp_path)[1].read_text()


def test_a_results_folder_keeps_one_layout(tiny_model, tmp_path):
    model, tokenizer = tiny_model
    run_sweep(model, tokenizer, _config(tasks=["niah_single"]), tmp_path, progress=False)
    with pytest.raises(ValueError, match=f"prompt_layout 'blank_line' differs from '{DEFAULT_PROMPT_LAYOUT}'"):
        run_sweep(model, tokenizer, _config(tasks=["niah_single"], prompt_layout="blank_line"), tmp_path, progress=False)
    assert len(read_results(tmp_path / runner.RESULTS_FILE)) == 2
    # a folder written before layouts were recorded holds blank_line_primed records
    meta = json.loads((tmp_path / "config.json").read_text())
    del meta["config"]["prompt_layout"]
    (tmp_path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="differs from 'blank_line_primed'"):
        run_sweep(model, tokenizer, _config(tasks=["niah_single"], prompt_layout="newline_primed"), tmp_path, progress=False)
    run_sweep(model, tokenizer, _config(tasks=["niah_single"], prompt_layout="blank_line_primed"), tmp_path, progress=False)


def test_generate_builds_its_prompt_in_the_given_layout(tiny_model):
    import kvcompress as kvc

    model, tokenizer = tiny_model
    settings = dict(method="knorm", compression_ratio=0.5, sink=2, window=4, max_new_tokens=2, stop_at_eos=False, progress=False)
    blank = kvc.generate(model, tokenizer, CONTEXT, QUESTION, **settings)
    newline = kvc.generate(model, tokenizer, CONTEXT, QUESTION, prompt_layout="newline", **settings)
    # the byte-level tokenizer spells the separator one byte a token: the blank line is one token longer
    assert blank.context_tokens == newline.context_tokens and blank.prompt_tokens == newline.prompt_tokens + 1
    with pytest.raises(ValueError, match="layout"):
        kvc.generate(model, tokenizer, CONTEXT, QUESTION, prompt_layout="newlines", **settings)
