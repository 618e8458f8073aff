"""Smoke tests: each feature that README.md or docs/cli.md shows a user doing, run once on the real default model.

The project's rule is that every public feature runs on SmolLM2-135M-Instruct in CI (`-m "not e2e or smoke"`), not
only on tiny random models. Short contexts (a three-digit magic number in a few sentences of filler), at most 8 new
tokens, the model loaded once (`default_model`); the commands run in-process through `kvcompress.cli.main` with the
model loader handing back that model (the entry point itself and a real load run in a subprocess in
tests/test_readme.py and tests/test_model.py). What other smoke tests already check is not repeated here: the README's
`model.generate` + `CompressedCache`, pipeline, batch and `res.report()` examples and the `kvcompress generate`
example (tests/test_readme.py), every method and the default at ratio 0 in every mode (tests/test_conformance.py),
`kvc.calibrate` (tests/test_hardening.py), the bench's prefill rows (tests/test_bench.py) and a RULER sweep through
`run_sweep` (tests/test_benchmarks.py).
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

import kvcompress as kvc
from kvcompress.options import DEFAULT_METHODS
from kvcompress.cli import main

pytestmark = pytest.mark.e2e  # and each test, or case, that runs in CI: smoke

FILLER = "Grass is green. The sky is blue. "
CONTEXT = FILLER * 10 + "The magic number is 731. " + FILLER * 10  # ~215 prompt tokens, the needle in the middle
QUESTION = "What is the magic number?"
SECOND = "What colour is grass?"
NEEDLE = "731"
NEW = 8  # "The magic number is 731": 8 tokens, one per digit
MODES = ("prefill", "chunked", "decode")


@pytest.fixture
def cli(default_model, monkeypatch, capsys):
    """run(*argv) -> stdout of `kvcompress argv` in-process (exit status 0 asserted), the default model not reloaded."""
    from kvcompress.integration import model as model_module

    model = default_model[0]

    def loaded(path=None, device=None, dtype=None):
        # what no --model, --device or --dtype asks for: the default model, on load_model's default device and dtype
        dev = model_module.parse_device(device)
        assert path is None and dev.type == model.device.type and model_module.parse_dtype(dtype, dev) == model.dtype, (path, device, dtype)
        return default_model

    monkeypatch.setattr(model_module, "load_model", loaded)

    def run(*argv) -> str:
        capsys.readouterr()
        status = main([str(a) for a in argv])
        done = capsys.readouterr()
        assert status == 0, f"kvcompress {' '.join(map(str, argv))}: exit {status}\n{done.err[-3000:]}"
        return done.out

    return run


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text(CONTEXT)
    return path


def answer_and_kept(out: str) -> tuple[str, str]:
    """The answer (first line) and the 'tokens kept/layer' line of `kvcompress generate`'s output."""
    kept = [line for line in out.splitlines() if line.startswith("tokens kept/layer")]
    assert len(kept) == 1, out
    return out.splitlines()[0], kept[0]


# ---------------------------------------------------------------------------------------------------------------
# Compress once, ask later (README "Compress once, ask later"; docs/cli.md "`compress`, then `generate --cache`")

# Other compression flags `compress` takes: (method, mode, kv bits) -> extra flags
EXTRA_FLAGS = {("keydiff", "chunked", 4): ["--kv-group-size", 16, "--sink", 2, "--window", 32, "--chunk-size", 64, "--param", "anchor=median"]}


def cli_case(method: str | None, mode: str, bits: int | None, *marks) -> object:
    return pytest.param(method, mode, bits, id=f"{method or 'default'}-{mode}-{bits or 32}bit", marks=marks)


# In CI (smoke): the default at full precision in prefill and decode mode, and KeyDiff quantized to 4 bits in chunked mode
# with every other flag; the other combinations with the e2e tests.
CLI_CASES = [cli_case(None, "prefill", None, pytest.mark.smoke), cli_case(None, "decode", None, pytest.mark.smoke),
             cli_case("keydiff", "chunked", 4, pytest.mark.smoke),
             cli_case(None, "chunked", None), cli_case("keydiff", "prefill", 4), cli_case("keydiff", "decode", 4)]


@pytest.mark.parametrize("method, mode, bits", CLI_CASES)
def test_cli_compress_then_generate_from_the_cache_answers_as_generate_on_the_context(cli, doc, tmp_path, method, mode, bits):
    """`kvcompress compress --context-file doc.txt ... --out doc.kvc`, then `kvcompress generate --cache doc.kvc --question`:
    the answer and the tokens kept of `kvcompress generate --context-file doc.txt` with the same flags (no --method: the
    default method; KeyDiff in chunked mode adds --kv-group-size, --sink/--window/--chunk-size and --param). Decode mode takes --budget:
    a ratio is resolved there against the tokens the stream will see, the context alone for `compress` but context,
    question and --max-new-tokens for `generate --context-file`. The default shares its budget among the layers by the
    fraction of the stream kept (`AdaKV.layer_budget`), which differs between the two in decode mode for the same
    reason: there the answers agree, the tokens kept per layer may not."""
    flags = ["--mode", mode, *(["--compression-ratio", "0.5"] if mode != "decode" else ["--budget", 64])]
    flags += ["--method", method] if method else []
    flags += ["--kv-bits", bits] if bits else []
    flags += EXTRA_FLAGS.get((method, mode, bits), [])
    saved = cli("compress", "--context-file", doc, "--out", tmp_path / "doc.kvc", *flags)
    assert (tmp_path / "doc.kvc").is_file() and saved.startswith(f"saved {tmp_path / 'doc.kvc'}: ")
    assert (f", {bits}-bit)" in saved) == bool(bits), saved
    ask = ["--question", QUESTION, "--max-new-tokens", NEW]
    from_cache = cli("generate", "--cache", tmp_path / "doc.kvc", *ask)
    direct = cli("generate", "--context-file", doc, *flags, *ask)
    same = 1 if (method, mode) == (None, "decode") else 2  # the answer; and the tokens kept per layer
    assert answer_and_kept(from_cache)[:same] == answer_and_kept(direct)[:same], (from_cache, direct)
    assert NEEDLE in answer_and_kept(direct)[0], direct
    assert f"mode={mode}" in from_cache and (f"{bits}-bit storage" in from_cache) == bool(bits), from_cache
    assert f"method            {method or 'adakv'} " in from_cache, from_cache  # the default: AdaKV over KVzap's scores
    if (method, mode) == (None, "prefill"):  # several questions from the one saved context (docs/cli.md), as JSON lines
        lines = cli("generate", "--cache", tmp_path / "doc.kvc", "--question", QUESTION, "--question", SECOND, "--max-new-tokens", NEW,
                    "--json").splitlines()
        answers = [json.loads(line) for line in lines]
        assert [a["question"] for a in answers] == [QUESTION, SECOND] and answers[0]["text"] == answer_and_kept(from_cache)[0], answers
        alone = cli("generate", "--cache", tmp_path / "doc.kvc", "--question", SECOND, "--max-new-tokens", NEW, "--json")
        assert answers[1]["token_ids"] == json.loads(alone)["token_ids"], (answers, alone)


# ---------------------------------------------------------------------------------------------------------------
# The same in Python: kvc.compress_context, cache.save, kvc.load_cache / kvc.generate(cache=path, questions=[...])

@pytest.mark.smoke
@pytest.mark.parametrize("mode", MODES)
def test_python_compress_save_load_answers_as_generate_on_the_context(default_model, tmp_path, mode):
    """The README's `kvc.compress_context(model, tokenizer, document, method="keydiff", compression_ratio=0.75, kv_bits=4)`,
    `cache.save("doc.kvc")`, `kvc.generate(model, tokenizer, cache="doc.kvc", questions=[...])` in every mode (decode mode:
    the budget the ratio gives in prefill mode, 54, as the CLI test explains): the answers to two questions are token for
    token those of `kvc.generate` on the context with the same settings, and `kvc.load_cache` gives back what was saved;
    in decode mode the cache itself answers the same, and saved again after answering, still does."""
    model, tokenizer = default_model
    settings = dict(method="keydiff", mode=mode, kv_bits=4, **({"compression_ratio": 0.75} if mode != "decode" else {"budget": 54}))
    questions = [QUESTION, SECOND]
    direct = kvc.generate(model, tokenizer, CONTEXT, questions=questions, max_new_tokens=NEW, progress=False, **settings)
    cache = kvc.compress_context(model, tokenizer, CONTEXT, progress=False, **settings)
    path = tmp_path / "doc.kvc"
    cache.save(path)
    loaded = kvc.load_cache(path, model)
    assert loaded.slots_per_layer() == cache.slots_per_layer() and torch.equal(loaded.token_ids, cache.token_ids)
    from_path = kvc.generate(model, tokenizer, cache=str(path), questions=questions, max_new_tokens=NEW)
    assert [r.token_ids for r in from_path] == [r.token_ids for r in direct], ([r.text for r in from_path], [r.text for r in direct])
    assert [r.slots_per_layer for r in from_path] == [r.slots_per_layer for r in direct]
    assert from_path[0].kv_bits == 4 == direct[0].kv_bits and from_path[0].mode == mode and "4-bit storage" in direct[0].report()
    assert direct[0].budget == 54 and from_path[0].kv_bytes < 0.25 * from_path[0].kv_bytes_full, direct[0].report()
    assert NEEDLE in direct[0].text, direct[0].text
    if mode == "decode":  # the cache in memory answers too, and saves again after answering: a live decode-mode stream is rolled
        # back by a copy (a stored context by a snapshot in the other modes, which tests/test_saved_cache.py covers on tiny models)
        answered = kvc.generate(model, tokenizer, cache=cache, questions=questions, max_new_tokens=NEW, progress=False)
        cache.save(tmp_path / "again.kvc")
        again = kvc.generate(model, tokenizer, cache=str(tmp_path / "again.kvc"), questions=questions, max_new_tokens=NEW, progress=False)
        assert [r.token_ids for r in answered] == [r.token_ids for r in again] == [r.token_ids for r in direct]


@pytest.mark.smoke
@pytest.mark.parametrize("mode", MODES)
def test_python_generate_with_the_default_method_finds_the_needle_at_half_the_cache(default_model, mode):
    """`kvc.generate` with no method named, in every mode: the default (AdaKV over KVzap's scores, one budget across every
    layer's heads) keeps the needle at compression_ratio=0.5: more tokens in 8 bits (in prefill mode kv_bits="auto") than
    its method keeps at full precision, within the bytes it keeps in prefill mode."""
    model, tokenizer = default_model
    res = kvc.generate(model, tokenizer, CONTEXT, QUESTION, compression_ratio=0.5, mode=mode, max_new_tokens=NEW, progress=False)
    assert NEEDLE in res.text, res.report()
    assert res.method == "adakv" and res.mode == mode, res.report()
    at_full_precision = kvc.generate(model, tokenizer, CONTEXT, QUESTION, compression_ratio=0.5, mode=mode, max_new_tokens=NEW,
                                     progress=False, method="adakv", method_params=DEFAULT_METHODS[mode][1],
                                     slack=DEFAULT_METHODS[mode][2].get("slack"))
    assert res.kv_bits == 8 and res.realised_compression_ratio < at_full_precision.realised_compression_ratio, res.report()
    if mode == "prefill":  # a stream compacted below its budget may keep fewer (test_kvzap.py's default test bounds the streams)
        assert res.kv_bytes <= at_full_precision.kv_bytes < res.kv_bytes_full, (res.report(), at_full_precision.report())
    else:
        assert res.kv_bytes < res.kv_bytes_full, res.report()


@pytest.mark.smoke
def test_python_generate_with_the_learned_layer_split_in_prefill_mode(default_model):
    """The prefill default with `layer_split="learned"` (each layer its learned share of the budget, in one shot): the
    needle kept at compression_ratio=0.5, and the layers keep different numbers of slots within the budget."""
    model, tokenizer = default_model
    res = kvc.generate(model, tokenizer, CONTEXT, QUESTION, method="adakv", compression_ratio=0.5, max_new_tokens=NEW, progress=False,
                       method_params={"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05, "layer_split": "learned"})
    assert NEEDLE in res.text, res.report()
    assert len(set(res.slots_per_layer)) > 1 and res.kv_bytes < 0.6 * res.kv_bytes_full, res.report()


@pytest.mark.smoke
def test_python_generate_with_kvzaps_threshold_in_every_mode(default_model):
    """`method="kvzap", method_params={"threshold": -6.0}` with no budget (ratio 0): the shipped scorer's rule alone decides,
    in every mode (a stream decides each token as it leaves the window); about half the context goes, the needle stays,
    and the prefill and chunked modes drop nearly the same share."""
    model, tokenizer = default_model
    runs = {mode: kvc.generate(model, tokenizer, CONTEXT, QUESTION, method="kvzap", method_params={"threshold": -6.0},
                               compression_ratio=0.0, mode=mode, max_new_tokens=NEW, progress=False) for mode in MODES}
    for mode, res in runs.items():
        assert NEEDLE in res.text and 0.3 < res.realised_compression_ratio < 0.8, (mode, res.report())
    assert abs(runs["prefill"].realised_compression_ratio - runs["chunked"].realised_compression_ratio) < 0.05


@pytest.mark.smoke
def test_a_saved_cache_of_the_default_model_is_refused_by_another_model_and_when_truncated(default_model, tiny_checkpoint, tmp_path):
    """'a file made for another model, truncated or corrupted is refused' (the fingerprint of the real model's
    28M-element embedding is what once crashed the save)."""
    from kvcompress.cache_file import CacheFileError

    model, tokenizer = default_model
    path = tmp_path / "doc.kvc"
    kvc.compress_context(model, tokenizer, CONTEXT, method="knorm", compression_ratio=0.5, progress=False).save(path)
    other, _ = kvc.load_model(tiny_checkpoint, device="cpu")
    with pytest.raises(CacheFileError, match="model"):
        kvc.load_cache(path, other)
    cut = tmp_path / "cut.kvc"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CacheFileError, match=r"cut.kvc' is truncated"):
        kvc.load_cache(cut, model)
    assert kvc.load_cache(path, model).token_ids.shape[1] > 200


# ---------------------------------------------------------------------------------------------------------------
# kv_bits, and model.generate with a CompressedCache



@pytest.mark.smoke
def test_a_special_tokens_text_in_a_document_or_question_is_refused_not_read_as_the_token(default_model):
    """SmolLM2's tokenizer read "<|im_end|>" in a document as its special token 2 (the end of the user's turn, and its
    EOS) and "<filename>" as token 6, without a word: the prompt's turns changed under the user."""
    model, tokenizer = default_model
    for field, text, token, at in [("context", "A note: see <|im_end|> here.", "<|im_end|>", 12),
                                   ("question", "What does <filename> hold?", "<filename>", 10)]:
        given = {"context": "A short note.", "question": "What is it?"} | {field: text}
        with pytest.raises(ValueError, match=rf"^{field} holds '{re.escape(token)}' \(at character {at}\), which the tokenizer reads as "
                                             rf"its special token {tokenizer.convert_tokens_to_ids(token)}, not as text"):
            kvc.generate(model, tokenizer, given["context"], given["question"], compression_ratio=0.5, max_new_tokens=1)
    assert kvc.generate(model, tokenizer, "A note: see <|im_end here.", "What is it?", method=None, max_new_tokens=1).text

@pytest.mark.smoke
def test_kv_bits_store_the_compressed_context_in_fewer_bytes(default_model):
    """`kv_bits=8|4|2` through `kvc.generate`: the same slots stored in fewer bytes as the bits fall; 8 bits keep the answer."""
    model, tokenizer = default_model
    runs = {bits: kvc.generate(model, tokenizer, CONTEXT, QUESTION, method="keydiff", compression_ratio=0.5, kv_bits=bits,
                               max_new_tokens=NEW, progress=False) for bits in (8, 2)}  # 4 bits: the tests above
    assert NEEDLE in runs[8].text and runs[8].kv_bits == 8 and "8-bit storage" in runs[8].report(), runs[8].text
    assert runs[2].kv_bits == 2 and "2-bit storage" in runs[2].report() and runs[2].slots_per_layer == runs[8].slots_per_layer
    # the same slots in fewer bytes: 8 bits under half the full cache's bytes at half the tokens, 2 bits under 8 bits
    assert runs[2].kv_bytes < runs[8].kv_bytes < 0.5 * runs[8].kv_bytes_full, (runs[8].report(), runs[2].report())


@pytest.mark.smoke
def test_kv_bits_on_a_native_stream_in_decode_mode(default_model):
    """`kv_bits=4` with a method whose stream is its own (the hybrid's Express coreset) in decode mode, the prompt arriving
    as one block longer than the budget: the answer runs, in fewer bytes than at full precision."""
    model, tokenizer = default_model
    runs = {bits: kvc.generate(model, tokenizer, CONTEXT, QUESTION, method="hybrid", mode="decode", budget=64, kv_bits=bits,
                               max_new_tokens=NEW, progress=False) for bits in (None, 4)}
    assert runs[4].kv_bits == 4 and runs[4].kv_bytes < runs[None].kv_bytes, (runs[None].report(), runs[4].report())
    assert runs[4].text.strip(), runs[4].text


@pytest.mark.smoke
def test_model_generate_with_a_compressed_cache_streams_and_beam_searches(default_model):
    """'model.generate(**inputs, past_key_values=cache, ...)   # sampling, eos, streamers as usual'; 'beam search
    run[s] in prefill mode': a streamer sees the answer generate returns; beams find the needle."""
    from transformers.generation.streamers import BaseStreamer

    model, tokenizer = default_model
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": CONTEXT + "\n\n" + QUESTION}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    n = inputs["input_ids"].shape[1]

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    cache = kvc.CompressedCache(model, "keydiff", compression_ratio=0.5)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=NEW, do_sample=False, streamer=streamer)
    assert streamer.ended and [t for chunk in streamer.chunks[1:] for t in chunk] == out[0, n:].tolist()
    assert NEEDLE in tokenizer.decode(out[0, n:], skip_special_tokens=True)
    assert max(cache.slots_per_layer()) < n  # compressed
    cache = kvc.CompressedCache(model, "keydiff", compression_ratio=0.5)
    beams = model.generate(**inputs, past_key_values=cache, max_new_tokens=NEW, num_beams=2, do_sample=False)
    assert NEEDLE in tokenizer.decode(beams[0, n:], skip_special_tokens=True)


@pytest.mark.smoke
@pytest.mark.parametrize("bits", [None, 4])
def test_beams_from_a_compressed_context_of_the_default(default_model, bits):
    """`kvc.compress_context` with the default (packed heads; with kv_bits, quantized), then a plain `model.generate`
    with beam search from it: every beam goes on from a copy of the context's one row."""
    model, tokenizer = default_model
    shared, expanded = (kvc.compress_context(model, tokenizer, CONTEXT, compression_ratio=0.5, kv_bits=bits, progress=False)
                        for _ in range(2))
    expanded.batch_select_indices(torch.zeros(2, dtype=torch.long))  # the context copied to both beams by hand
    question = tokenizer("\n" + QUESTION, add_special_tokens=False, return_tensors="pt").input_ids
    prompt = torch.cat([shared.token_ids, question], 1)
    beams = [model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache, max_new_tokens=NEW,
                            min_new_tokens=NEW, num_beams=2, do_sample=False) for cache in (shared, expanded)]
    assert beams[0].shape == (1, prompt.shape[1] + NEW) and torch.equal(beams[0], beams[1])


@pytest.mark.smoke
def test_model_generate_with_the_default_method_in_a_compressed_cache(default_model):
    """`kvc.CompressedCache(model, compression_ratio=...)` (no method named: the default) inside a plain
    `model.generate`: the default (AdaKV over KVzap) reads each layer's hidden states, which the cache has the model
    keep while it lives; it finds the needle in 8-bit slots, storing less than the full cache, another method's answer
    beside it stores what it stores alone, and once the cache is gone the model carries no hook of it."""
    import gc

    model, tokenizer = default_model
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": CONTEXT + "\n\n" + QUESTION}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    n = inputs["input_ids"].shape[1]
    other = dict(method="compactor", mode="chunked", compression_ratio=0.5, max_new_tokens=2, progress=False)
    alone = kvc.generate(model, tokenizer, CONTEXT, QUESTION, **other)
    cache = kvc.CompressedCache(model, compression_ratio=0.5)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=NEW, do_sample=False)
    config = model.config
    full_bytes = config.num_hidden_layers * 2 * config.num_key_value_heads * out.shape[1] * config.head_dim * model.dtype.itemsize
    assert NEEDLE in tokenizer.decode(out[0, n:], skip_special_tokens=True) and cache.kv_bits == 8 and cache.nbytes() < full_bytes
    beside = kvc.generate(model, tokenizer, CONTEXT, QUESTION, **other)
    assert (beside.token_ids, beside.kv_bytes, beside.peak_kv_bytes) == (alone.token_ids, alone.kv_bytes, alone.peak_kv_bytes)
    del cache, out
    gc.collect()
    assert not any(m._forward_pre_hooks for m in model.modules())


@pytest.mark.smoke
@pytest.mark.parametrize("method", ["default", "compactor"])
def test_a_forward_with_gradients_on_through_a_compressed_cache(default_model, method):
    """A plain `model(...)` outside torch.no_grad through a compressed cache of the default model: the logits are a
    no-grad forward's and carry gradients (Compactor's tensor code writes into preallocated outputs)."""
    model, tokenizer = default_model
    ids = tokenizer(CONTEXT, return_tensors="pt")["input_ids"]
    logits = []
    for grad in (False, True):
        cache = kvc.CompressedCache(model, method, compression_ratio=0.5)
        with torch.set_grad_enabled(grad):
            logits.append(model(ids, past_key_values=cache).logits[:, -1])
    assert logits[1].requires_grad
    torch.testing.assert_close(logits[1].detach(), logits[0], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# The other commands, at their smallest settings


@pytest.mark.smoke
def test_cli_generate_reads_the_ratio_as_memory(cli, doc, monkeypatch):
    """docs/cli.md's `--budget-unit memory` with `--kv-bits 4`: SnapKV keeps more tokens, in 4 bits, than at the same
    ratio in tokens; the default in prefill mode stores 8 bits at 0.5 with neither flag (`--kv-bits auto`), and finds the
    needle (its context piped in, `--context-file -`, and its result printed as JSON, `--json`)."""
    import io
    import re

    ask = ["--context-file", doc, "--question", QUESTION, "--max-new-tokens", NEW, "--compression-ratio", "0.5"]
    memory = cli("generate", *ask, "--method", "snapkv", "--kv-bits", 4, "--budget-unit", "memory")
    tokens = cli("generate", *ask, "--method", "snapkv", "--kv-bits", 4)
    kept = [int(re.search(r"\(mean (\d+)\)", answer_and_kept(out)[1]).group(1)) for out in (memory, tokens)]
    assert "4-bit storage" in memory and kept[0] > kept[1], (memory, tokens)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(doc.read_bytes())))
    default = json.loads(cli("generate", *ask[:1], "-", *ask[2:], "--json"))
    assert default["kv_bits"] == 8 and NEEDLE in default["text"] and default["method"] == "adakv", default


@pytest.mark.smoke
@pytest.mark.filterwarnings("ignore:the context's NLL .* lies outside the range")  # a one-sample fit: an extrapolation
def test_cli_calibrate_then_generate_with_calibration(cli, doc, tmp_path):
    """docs/cli.md: `kvcompress calibrate --method compactor --out compactor.json`, then `kvcompress generate --calibration
    compactor.json --quality 0.9 ...` (one sample of 128 tokens, two retentions here)."""
    out = cli("calibrate", "--method", "compactor", "--tasks", "niah_single", "--samples", 1, "--tokens", 128, "--retentions", "0.5,0.9",
              "--out", tmp_path / "compactor.json")
    assert re.search(r"alpha=\S+ beta=\S+ \(loss \S+, 2 triples\)", out), out
    fit = json.loads((tmp_path / "compactor.json").read_text())
    assert fit["method"] == "compactor" and math.isfinite(fit["alpha"]) and math.isfinite(fit["beta"])
    out = cli("generate", "--calibration", tmp_path / "compactor.json", "--quality", "0.9", "--context-file", doc, "--question", QUESTION,
              "--max-new-tokens", NEW)
    assert out.splitlines()[0].strip() and "method            compactor (mode=prefill" in out, out
    chosen = re.search(r"^calibration       NLL\(context\) (\S+) -> keep (\S+)% \(compression ratio (\S+)\) for quality 0.9(.*)$", out, re.M)
    assert chosen and 0 < float(chosen.group(2)) <= 100 and 0 <= float(chosen.group(3)) < 1, out
    low, high = fit["nll_context_range"]  # one sample: the doc's NLL is an extrapolation unless it is that sample's
    outside = not low <= float(chosen.group(1)) <= high
    assert chosen.group(4) == (" (extrapolated: outside the NLL range the calibration was fitted on)" if outside else ""), out
    out = cli("compress", "--calibration", tmp_path / "compactor.json", "--quality", "0.9", "--context-file", doc, "--out", tmp_path / "c.kvc")
    assert f"compression ratio {chosen.group(3)} chosen by the calibration for quality 0.9)" in out, out


@pytest.mark.smoke
def test_cli_train_scorer_then_generate_with_it(cli, doc, tmp_path):
    """docs/cli.md "train-scorer": `kvcompress train-scorer --out my-kvzap.safetensors`, then `kvcompress generate` with the
    default's method over that scorer (`--method adakv --param scorer=kvzap --param scorer_params.scorer=FILE ...`) and with
    `--method kvzap --param scorer=FILE` (one context of 64 tokens here)."""
    scorer = tmp_path / "my-kvzap.safetensors"
    out = cli("train-scorer", "--tokens", 64, "--contexts", 1, "--out", scorer)
    assert re.search(r"^linear surrogate of 30 layers, Spearman on tuning text: mean \S+, min \S+;", out, re.M), out
    common = ("--compression-ratio", "0.5", "--context-file", doc, "--question", QUESTION, "--max-new-tokens", NEW)
    out = cli("generate", "--method", "adakv", "--param", "scorer=kvzap", "--param", f"scorer_params.scorer={scorer}",
              "--param", "scope=model", "--param", "alpha_safeguard=0.05", *common)
    assert out.splitlines()[0].strip() and "method            adakv" in out, out
    out = cli("generate", "--method", "kvzap", "--param", f"scorer={scorer}", *common)
    assert out.splitlines()[0].strip() and "method            kvzap" in out, out


@pytest.mark.smoke
def test_cli_demo_at_a_short_context(cli, monkeypatch):
    """`kvcompress demo` (what `make demo` runs), at 256 tokens with one method named: the needle, and the table with the
    full cache's row (which finds it) and the method's; the rows answer after one untimed answer of the full cache."""
    import kvcompress as kvc

    calls, generate = [], kvc.generate
    monkeypatch.setattr(kvc, "generate", lambda *args, **kwargs: calls.append((kwargs.get("method", "default"), kwargs["max_new_tokens"]))
                        or generate(*args, **kwargs))
    out = cli("demo", "--tokens", 256, "--methods", "keydiff", "--compression-ratio", "0.5", "--threads", torch.get_num_threads())  # as it is: the flag parses and applies
    assert calls == [(None, 1), ("default", 16), (None, 16), ("keydiff", 16)], calls
    assert re.search(r"^context: \d+ tokens.*needle at depth \d+%", out, re.M), out
    assert re.search(r"^full\s+yes\s", out, re.M) and re.search(r"^keydiff\s+(yes|no)\s.*\d+%", out, re.M), out


@pytest.mark.smoke
@pytest.mark.usefixtures("cli")  # the default model, not reloaded
def test_cli_demo_refuses_a_context_too_short_for_the_ratio_before_its_table(capsys):
    """At 100 tokens the default ratio leaves no room beyond the exact sink and window: one line naming --tokens and
    --compression-ratio, before the demo prints anything."""
    from kvcompress.cli import main

    capsys.readouterr()
    assert main(["demo", "--tokens", "100"]) == 2
    out, err = capsys.readouterr()
    # the demo's prose is the running Python's language reference: its token count is this Python's (101 on CPython 3.11.7)
    assert out == "" and re.match(r"kvcompress demo: error: --tokens 100 \((\d+) tokens with the chat template\) is too short for "
                                  r"--compression-ratio 0\.75 with default: --compression-ratio 0\.75 keeps \d+ of n=\1", err), (out, err)
    assert main(["demo", "--tokens", "100", "--scorer", "no-such-scorer.safetensors"]) == 2  # the scorer's fault, not the length's
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("kvcompress demo: error: --scorer 'no-such-scorer.safetensors': KVzap scorer file "), (out, err)


@pytest.mark.smoke
def test_cli_eval_task_sweep_with_the_default_method(cli, tmp_path):
    """`kvcompress eval` task sweep with `--methods default,keydiff` (docs/cli.md "eval"): the record names what `default`
    ran (in prefill mode AdaKV over KVzap's scores), summary.md says it; the full cache finds the needle."""
    out_dir = tmp_path / "sweep"
    out = cli("eval", "--tasks", "niah_single", "--lengths", 256, "--samples", 1, "--methods", "default,keydiff", "--ratios", "0.5",
              "--no-progress", "--out", out_dir)
    records = {(r["method"], r["mode"]): r for r in map(json.loads, (out_dir / "results.jsonl").read_text().splitlines())}
    assert set(records) == {("full", "-"), ("default", "prefill"), ("keydiff", "prefill")}, list(records)
    assert records["full", "-"]["score"] == 1.0, records["full", "-"]
    assert all(r["error"] is None and 0.0 <= r["score"] <= 1.0 for r in records.values())
    default = records["default", "prefill"]
    assert default["resolved_method"] == "adakv" and default["method_params"].get("scorer") == "kvzap", default
    summary = (out_dir / "summary.md").read_text()
    assert "`default` is the library's default method" in summary and "scorer=kvzap" in summary and summary in out


@pytest.mark.smoke
def test_cli_eval_on_a_benchmarks_shipped_samples(cli, tmp_path):
    """`kvcompress eval --benchmark longbench --data tests/fixtures/longbench/ ...` (README "Standard benchmarks"): one
    sample, one method, the leaderboard written and printed. (RULER's runs through `run_sweep` in tests/test_benchmarks.py.)"""
    from pathlib import Path

    out_dir = tmp_path / "lb"
    out = cli("eval", "--benchmark", "longbench", "--data", Path(__file__).parent / "fixtures" / "longbench", "--tasks", "hotpotqa",
              "--samples", 1, "--methods", "keydiff", "--ratios", "0.5", "--max-new-tokens", NEW, "--no-progress", "--out", out_dir)
    board = out_dir / "leaderboard_longbench.md"
    assert board.is_file() and board.read_text() in out
    assert "| full cache |" in out and "| keydiff @ 0.5 |" in out and "hotpotqa" in out, out


@pytest.mark.smoke
def test_cli_eval_perplexity(cli, tmp_path):
    """`kvcompress eval --tasks perplexity --methods keydiff --ratios 0.75 ...` (README "Language modelling under
    compression"): one 128-token document, prefill and decode modes, against the full cache."""
    out_dir = tmp_path / "ppl"
    out = cli("eval", "--tasks", "perplexity", "--methods", "keydiff", "--ratios", "0.75", "--samples", 1, "--lengths", 128,
              "--no-progress", "--out", out_dir)
    assert (out_dir / "leaderboard_perplexity.md").is_file()
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| (full cache|keydiff @ 0\.75 \((?:prefill|decode)\)) \| 128 \| 1 \| ([\d.]+)", out, re.M)}
    assert set(rows) == {"full cache", "keydiff @ 0.75 (prefill)", "keydiff @ 0.75 (decode)"}, out
    assert all(1.0 < p < 1000.0 for p in rows.values()), rows


@pytest.mark.smoke
def test_cli_eval_approx(cli, tmp_path):
    """`kvcompress eval approx --methods hybrid,balancekv ...` (docs/cli.md, docs/extending.md): one layer, one
    seed, 256 tokens of real prose."""
    out_dir = tmp_path / "approx"
    cli("eval", "approx", "--methods", "hybrid,balancekv", "--seeds", 1, "--layers", 1, "--tokens", 256, "--queries", 32, "--sink", 4,
        "--ratios", "0.5", "--no-progress", "--out", out_dir)
    from kvcompress.eval.tables import read_csv

    rows = read_csv(out_dir / "approx.csv")
    assert sorted(r["method"] for r in rows) == ["balancekv", "hybrid"] and all(r["layer"] == 1 and r["ratio"] == 0.5 for r in rows), rows
    assert all(0.0 < r["error_mean"] < 0.5 for r in rows), rows  # relative error of the attention output
    assert (out_dir / "approx.md").is_file()


@pytest.mark.smoke
def test_cli_bench_memory_on_the_model(cli, tmp_path):
    """`kvcompress bench --sections memory --memory-sizes ... --memory-budget ...` (docs/bench.md, memory), at 256
    prompt tokens."""
    out_dir = tmp_path / "bench"
    out = cli("bench", "--sections", "memory", "--memory-sizes", 256, "--memory-budget", 32, "--chunk-size", 64, "--out", out_dir)
    from kvcompress.eval.tables import read_csv

    from kvcompress.methods.budget import DEFAULT_SLACK, stream_split

    rows = {r["mode"]: r for r in read_csv(out_dir / "memory.csv")}
    assert set(rows) == {"chunked", "prefill"} and all(r["method"] == "keydiff" and r["n"] == 256 for r in rows.values()), rows
    per_slot = rows["prefill"]["kv_bytes_full"] // 256  # one token's keys and values over every layer and KV head
    # chunked mode's peak stays below the full context's, which prefill mode holds: the stream's budget (its slack and the
    # block it absorbs within it) and the block of 64 being forwarded (KeyDiff: no sink, no window)
    assert rows["chunked"]["peak_kv_bytes"] <= (32 + 64) * per_slot < rows["prefill"]["peak_kv_bytes"] == rows["prefill"]["kv_bytes_full"], rows
    # prefill keeps the budget; the compacted stream holds between its target and the budget (`stream_split`)
    target = stream_split(32, DEFAULT_SLACK)[0]
    assert rows["prefill"]["kv_bytes"] == 32 * per_slot < rows["prefill"]["kv_bytes_full"], rows
    assert target * per_slot <= rows["chunked"]["kv_bytes"] <= rows["prefill"]["kv_bytes"] and rows["chunked"]["kv_bytes"] % per_slot == 0, rows
    assert (out_dir / "bench.md").is_file() and "memory chunked n=256: peak KV" in out


@pytest.mark.smoke
def test_python_dash_m_runs_the_command_line():
    """'also `python -m kvcompress`, `python -m kvcompress.cli`' (docs/cli.md): both start the same parser, in a fresh process."""
    import subprocess
    import sys

    for module in ("kvcompress", "kvcompress.cli"):
        done = subprocess.run([sys.executable, "-m", module, "compress", "--help"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.startswith("usage: kvcompress compress") and "--kv-bits" in done.stdout, done.stderr
