"""Bad token ids, lists, flags, paths and settings at the integration's entry points: each refused by name, with what was
received and what is accepted, before any work (nothing silently changed, nothing dropped)."""

import pytest
import torch

import kvcompress as kvc
from kvcompress.cache_file import CacheFileError, CacheFileMissing
from kvcompress.integration import (answer_from_cache_ids, answer_log_probs_ids, answer_questions_ids, compress_context_ids,
                                    generate_batch_ids, generate_ids)
from kvcompress.options import CompressionOptions

from test_integration import _prompt, tiny

RUN = dict(method="knorm", budget=8, max_new_tokens=2)
VOCAB = r"from 0 to 95 \(the model's vocabulary of 96\)"


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.mark.parametrize("bad, match", [
    (lambda ids: ids + 1000, f"context_ids must hold token ids {VOCAB}, got ids from 10"),
    (lambda ids: ids - 1000, f"context_ids must hold token ids {VOCAB}, got ids from -"),
    (lambda ids: ids > 50, r"context_ids must be an integer tensor \[B, n\] with n >= 1, got tensor \[1, 60\] bool"),
    (lambda ids: ids.to(torch.uint8), r"context_ids must hold its token ids as int64 or int32 .* got tensor \[1, 60\] uint8"),
])
def test_context_ids_outside_the_vocabulary_or_of_another_dtype_are_refused_by_name(model, bad, match):
    ids, q = _prompt(60)
    with pytest.raises(ValueError, match=match):
        generate_ids(model, bad(ids), q, **RUN)
    with pytest.raises(ValueError, match=match):
        compress_context_ids(model, bad(ids), method="knorm", budget=8)
    with pytest.raises(ValueError, match=match):
        answer_questions_ids(model, bad(ids), [q], **RUN)


def test_int32_ids_are_taken_as_they_are(model):
    ids, q = _prompt(60)
    assert generate_ids(model, ids.int(), q.int(), **RUN).token_ids == generate_ids(model, ids, q, **RUN).token_ids


def test_question_and_answer_ids_are_checked_against_the_vocabulary(model):
    ids, q = _prompt(60)
    with pytest.raises(ValueError, match=f"question_ids must hold token ids {VOCAB}, got ids from 10"):
        generate_ids(model, ids, q + 1000, **RUN)
    with pytest.raises(ValueError, match=r"question_ids must be an integer tensor \[1, m\] or None, got tensor \[1, 8\] bool"):
        generate_ids(model, ids, q > 5, **RUN)
    with pytest.raises(ValueError, match=f"answer_ids must hold token ids {VOCAB}"):
        answer_log_probs_ids(model, ids, q, q + 1000, method="knorm", budget=8)
    with pytest.raises(ValueError, match=r"answer_ids must be an integer tensor \[1, m\] with m >= 1, got tensor \[1, 8\] bool"):
        answer_log_probs_ids(model, ids, q, q > 5, method="knorm", budget=8)  # was read as the ids 0 and 1
    with pytest.raises(ValueError, match=f"questions_ids\\[1\\] must hold token ids {VOCAB}"):
        answer_questions_ids(model, ids, [q, q + 1000], **RUN)
    cache = compress_context_ids(model, ids, method="knorm", budget=8)
    with pytest.raises(ValueError, match=r"questions_ids\[0\] must be an integer tensor \[1, m\] with m >= 1, got tensor \[1, 8\] bool"):
        answer_from_cache_ids(model, cache, [q > 5], max_new_tokens=2)


def test_a_batch_takes_a_list_of_one_row_contexts_and_a_pad_token_in_the_vocabulary(model):
    a, q = _prompt(60)
    b = _prompt(60, seed=2)[0]
    one = r"must be an integer tensor \[1, n\] with n >= 1 \(one context; a batch is a list of them\), got"
    with pytest.raises(ValueError, match=rf"contexts_ids\[0\] {one} tensor \[2, 60\]"):  # row b was dropped
        generate_batch_ids(model, [torch.cat([a, b])], q, **RUN)
    with pytest.raises(ValueError, match=rf"contexts_ids\[1\] {one} tensor \[60\]"):
        generate_batch_ids(model, [a, a[0]], q, **RUN)
    with pytest.raises(ValueError, match=rf"contexts_ids\[0\] {one} a list"):
        generate_batch_ids(model, [a[0].tolist()], q, **RUN)
    with pytest.raises(ValueError, match=r"contexts_ids must be a non-empty list of \[1, n\] token id tensors, got tensor \[1, 60\]"):
        generate_batch_ids(model, a, q, **RUN)
    with pytest.raises(ValueError, match=f"contexts_ids\\[1\\] must hold token ids {VOCAB}"):
        generate_batch_ids(model, [a, b + 1000], q, **RUN)
    with pytest.raises(ValueError, match=f"question_ids must hold token ids {VOCAB}"):
        generate_batch_ids(model, [a, b], q + 1000, **RUN)
    for pad in (-5, 1.5, True):
        with pytest.raises(ValueError, match=f"pad_token_id must be None or an integer >= 0, got {pad}"):
            generate_batch_ids(model, [a, a[:, :40]], q, pad_token_id=pad, **RUN)
    with pytest.raises(ValueError, match=r"pad_token_id must be None or a token id from 0 to 95 .* got 96"):
        generate_batch_ids(model, [a, a[:, :40]], q, pad_token_id=96, **RUN)
    assert len(generate_batch_ids(model, [a, a[:, :40]], q, pad_token_id=95, **RUN)) == 2


def test_many_questions_are_a_list(model):
    ids, q = _prompt(60)
    match = r"questions_ids must be a non-empty list of \[1, m\] token id tensors, got tensor \[1, 8\]"
    with pytest.raises(ValueError, match=match):
        answer_questions_ids(model, ids, q, **RUN)
    cache = compress_context_ids(model, ids, method="knorm", budget=8)
    with pytest.raises(ValueError, match=match):
        answer_from_cache_ids(model, cache, q, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"questions_ids must be a non-empty list .* got a list \[\]"):
        answer_questions_ids(model, ids, [], **RUN)


@pytest.mark.parametrize("progress", ["no", None, 1])
def test_progress_is_true_or_false(model, tiny_checkpoint, progress):
    ids, q = _prompt(60)
    match = f"progress must be True or False, got {progress!r}"
    for run in (lambda: generate_ids(model, ids, q, progress=progress, **RUN),
                lambda: answer_questions_ids(model, ids, [q], progress=progress, **RUN),
                lambda: generate_batch_ids(model, [ids, ids], q, progress=progress, **RUN),
                lambda: compress_context_ids(model, ids, progress=progress, method="knorm", budget=8)):
        with pytest.raises(ValueError, match=match):
            run()
    hf_model, tokenizer = kvc.load_model(tiny_checkpoint, device="cpu")
    with pytest.raises(ValueError, match=match):
        kvc.generate(hf_model, tokenizer, "some context", "Why?", progress=progress, method="knorm", budget=8)
    with pytest.raises(ValueError, match=match):
        kvc.compress_context(hf_model, tokenizer, "some context", progress=progress, method="knorm", budget=8)


def test_a_missing_cache_file_is_named_with_its_parameter(tiny_checkpoint, tmp_path):
    model, tokenizer = kvc.load_model(tiny_checkpoint, device="cpu")
    missing = str(tmp_path / "missing.kvc")
    with pytest.raises(CacheFileMissing, match=f"cache='{missing}': no such file") as err:
        kvc.generate(model, tokenizer, cache=missing, question="q?")
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, CacheFileError)  # caught as either
    with pytest.raises(FileNotFoundError, match=f"path='{missing}': no such file"):
        kvc.load_cache(missing, model)
    with pytest.raises(CacheFileMissing, match=f"path='{tmp_path}': a folder, not a file"):
        kvc.load_cache(tmp_path, model)
    with pytest.raises(CacheFileMissing, match=f"cache='{tmp_path}': a folder, not a file"):
        kvc.generate(model, tokenizer, cache=tmp_path, question="q?")


def test_an_answer_from_a_cache_needs_question_tokens(tiny_checkpoint, tmp_path):
    model, tokenizer = kvc.load_model(tiny_checkpoint, device="cpu")
    assert not getattr(tokenizer, "chat_template", None)  # question=None then adds no tokens after the context
    cache = kvc.compress_context(model, tokenizer, "The cat sat on the mat. " * 4, progress=False, method="knorm", budget=8)
    cache.save(tmp_path / "doc.kvc")
    for given in (cache, tmp_path / "doc.kvc"):
        with pytest.raises(ValueError, match=r"question=None adds no tokens after the context with this tokenizer.*pass a question"):
            kvc.generate(model, tokenizer, cache=given, max_new_tokens=2)
        assert kvc.generate(model, tokenizer, cache=given, question="Who?", max_new_tokens=2).token_ids


def test_a_saved_cache_refuses_token_ids_it_would_change_or_could_not_load(model, tmp_path):
    ids, _ = _prompt(60)
    cache = compress_context_ids(model, ids, method="knorm", budget=8)
    path = tmp_path / "doc.kvc"
    with pytest.raises(ValueError, match=f"token_ids must hold token ids {VOCAB}, got ids from 4294967301 to 4294967301"):
        cache.save(path, token_ids=torch.full((1, 60), 2**32 + 5))  # was cast to int32 and saved as 5
    with pytest.raises(ValueError, match=r"token_ids must be an integer tensor \[1, 60\] \(one context, the tokens the cache holds\), got tensor \[1, 60\] bool"):
        cache.save(path, token_ids=ids > 5)
    with pytest.raises(ValueError, match=f"token_ids must hold token ids {VOCAB}, got ids from 10"):
        cache.save(path, token_ids=ids + 1000)
    assert not path.exists()
    cache.save(path, token_ids=ids.int())
    assert torch.equal(kvc.load_cache(path, model).token_ids, ids)


def test_options_name_a_method_that_is_no_str():
    with pytest.raises(ValueError, match=r"method must be a method's name \(a str.* or None for the full cache, got \['knorm'\]"):
        CompressionOptions(method=["knorm"], budget=8)  # was "unhashable type: 'list'"


def test_options_refuse_a_repeat_prompt_in_no_order():
    for ids in ({3, 1, 2}, {3: 0, 1: 0}):
        with pytest.raises(ValueError, match=r"repeat_prompt_ids must be a non-empty sequence \(list or tuple\) of token ids"):
            CompressionOptions(method="kvzip", budget=8, repeat_prompt_ids=ids)
    assert CompressionOptions(method="kvzip", budget=8, repeat_prompt_ids=[3, 1, 2]).repeat_prompt_ids == (3, 1, 2)
