"""Saved caches (issue 37): a compressed context written to one file, loaded in a fresh process, answering token for
token as the cache that was saved, for every method in every mode (a decode-mode cache with its live streams), at full
precision and quantized, in float32 and bfloat16; and a clear error for every file or model that cannot be used."""

import copy
import json
import subprocess
import sys

import pytest
import safetensors.torch
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvcompress as kvc
from registered import SHARED
from kvcompress import cache_file
from kvcompress.cache import CompressedCache
from kvcompress.cache_file import CacheFileError
from kvcompress.integration import answer_from_cache_ids, compress_context_ids, generate_ids
from kvcompress.methods.registry import build_method
from kvcompress.quantization import QuantizedSummary

from test_hf import tiny as tiny_family
from test_integration import blocks, tiny

NEW = 8
CASES = [(method, mode, bits) for method in SHARED for mode in ("prefill", "chunked", "decode") for bits in (None, 4)
         if mode in build_method(method).requirements.modes]  # KVzip runs in prefill mode only
CASES += [("snapkv", "prefill", 8), ("balancekv", "chunked", 2), ("hybrid", "prefill", 2), ("express", "chunked", 8)]

# Runs in a fresh interpreter: loads the checkpoint and every saved cache, answers each question, prints JSON.
_FRESH = """
import json, sys, torch
torch.set_num_threads(1)
import kvcompress as kvc
from kvcompress.integration import answer_from_cache_ids
checkpoint, dtype, jobs = sys.argv[1], sys.argv[2], json.loads(open(sys.argv[3]).read())
model, _ = kvc.load_model(checkpoint, device="cpu", dtype=dtype)
out = {}
for name, job in jobs.items():
    cache = kvc.load_cache(job["file"], model)
    (res,) = answer_from_cache_ids(model, cache, [torch.tensor([job["question"]])], max_new_tokens=job["new"], stop_at_eos=False)
    out[name] = {"tokens": res.token_ids, "kv_bytes": res.kv_bytes, "slots": res.slots_per_layer}
print(json.dumps(out))
"""


def _options(method: str, mode: str, bits: int | None) -> dict:
    return dict(method=method, mode=mode, budget=24, sink=2, window=0 if method == "compactor" else 8, kv_bits=bits, **blocks(mode))


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype, quantized", [("float32", False), pytest.param("float32", True, marks=pytest.mark.e2e),
                                               pytest.param("bfloat16", None, marks=pytest.mark.e2e)])  # bfloat16 loading: below
def test_every_method_round_trips_through_a_fresh_process(tiny_checkpoint, tmp_path, dtype, quantized):
    """compress -> save -> load in another process -> the same answer, token for token, as generating from the context
    here (and the same slots and stored bytes), for every method in every mode, full precision and quantized (quantized:
    False, True, or None for both; the quantized cases and bfloat16 with the e2e tests). A decode-mode cache is saved
    with its live streams, so the question and the answer go on through them after loading."""
    model, _ = kvc.load_model(tiny_checkpoint, device="cpu", dtype=dtype)
    ctx, question = _ids(300, 1), _ids(8, 2)
    jobs, expected = {}, {}
    for method, mode, bits in [c for c in CASES if quantized is None or (c[2] is not None) == quantized]:
        name = f"{method}-{mode}-{bits}"
        options = _options(method, mode, bits)
        reference = generate_ids(model, ctx, question, max_new_tokens=NEW, stop_at_eos=False, **options)
        cache = compress_context_ids(model, ctx, **options)
        path = tmp_path / f"{name}.kvc"
        cache.save(path)
        (here,) = answer_from_cache_ids(model, cache, [question], max_new_tokens=NEW, stop_at_eos=False)
        assert here.token_ids == reference.token_ids, name
        jobs[name] = {"file": str(path), "question": question[0].tolist(), "new": NEW}
        expected[name] = {"tokens": reference.token_ids, "kv_bytes": reference.kv_bytes, "slots": reference.slots_per_layer}
    spec = tmp_path / "jobs.json"
    spec.write_text(json.dumps(jobs))
    done = subprocess.run([sys.executable, "-c", _FRESH, str(tiny_checkpoint), dtype, str(spec)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    fresh = json.loads(done.stdout.strip().splitlines()[-1])
    for name, want in expected.items():
        got = fresh[name]
        assert (got["tokens"], got["slots"]) == (want["tokens"], want["slots"]), name
        # the same bytes, or fewer: a chunked stream's workspace (a method's state beyond its summary) is not saved
        assert got["kv_bytes"] <= want["kv_bytes"] and (got["kv_bytes"] == want["kv_bytes"] or "chunked-None" in name), name


@pytest.mark.parametrize("mode", ["prefill", "chunked", "decode"])
@pytest.mark.parametrize("bits", [None, 4])
def test_the_default_method_round_trips_in_every_mode(tiny_checkpoint, tiny_default_scorer, tmp_path, mode, bits):
    """The default (AdaKV over KVzap's entry scores, its streams packed, quantized with kv_bits) saved and loaded answers as
    generating from the context does, with the same slots; a stream's packed slots load checked against its buffer
    (quantized slots with a quantized buffer of the same bits, group size and dims)."""
    model, _ = kvc.load_model(tiny_checkpoint, device="cpu", dtype="float32")
    ctx, question = _ids(300, 1), _ids(8, 2)
    options = dict(method="default", mode=mode, budget=24, sink=2, window=8, kv_bits=bits, **blocks(mode))
    cache = compress_context_ids(model, ctx, **options)
    cache.save(tmp_path / "default.kvc")
    # the same cache saves to the same bytes (safetensors kept its metadata in a hash map's order, new at each call)
    for again in range(3):
        cache.save(tmp_path / f"again{again}.kvc")
        assert (tmp_path / f"again{again}.kvc").read_bytes() == (tmp_path / "default.kvc").read_bytes()
    (reference,) = answer_from_cache_ids(model, cache, [question], max_new_tokens=NEW, stop_at_eos=False)
    if mode != "decode":  # decode: each layer's share of the budget follows the stream's length, here the context's alone
        generated = generate_ids(model, ctx, question, max_new_tokens=NEW, stop_at_eos=False, **options)
        assert (generated.token_ids, generated.slots_per_layer) == (reference.token_ids, reference.slots_per_layer)
    (loaded,) = answer_from_cache_ids(model, kvc.load_cache(tmp_path / "default.kvc", model), [question], max_new_tokens=NEW,
                                      stop_at_eos=False)
    assert (loaded.token_ids, loaded.slots_per_layer) == (reference.token_ids, reference.slots_per_layer)
    # the same bytes, or fewer in decode mode: a loaded stream's buffer allocates its room with the next token it admits
    assert loaded.kv_bytes == reference.kv_bytes or (mode == "decode" and loaded.kv_bytes < reference.kv_bytes)


def test_a_stream_whose_kept_slots_do_not_match_its_buffer_is_refused():
    """AdaKV's stream state read from a file: kept slots at full precision beside a quantized buffer, or quantized in
    other bits than the buffer's, are refused by name instead of failing at the next step."""
    from kvcompress.methods.adakv import AdaKV
    from kvcompress.methods.tokens import Tokens

    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 120, 16, generator=g), torch.randn(1, 2, 120, 16, generator=g)
    states = {}
    for bits in (None, 4, 8):
        state = AdaKV(scorer=build_method("knorm")).new_stream(24, torch.Generator(), 0.5)
        state = state.quantized(bits, 8) if bits else state
        for start in range(0, 120, 20):
            state.absorb(Tokens(keys[:, :, start : start + 20], values[:, :, start : start + 20], torch.arange(start, start + 20).expand(1, 2, -1)))
        state.check_saved()
        states[bits] = state
    for into, source, why in ((4, None, "at full precision"), (None, 4, "expected a ragged_summary"), (4, 8, r"\(8, 8")):
        state = copy.copy(states[into])
        state.kept = states[source].kept
        with pytest.raises(ValueError, match=why):
            state.check_saved()


@pytest.mark.parametrize("method", ["keydiff", "hybrid", "compactor", "express"])
def test_a_decode_mode_cache_that_has_answered_saves_and_answers_on(tiny_checkpoint, tmp_path, method):
    """Answering rolls a live stream back to its context by a copy of it; the copy still refers to the cache's own method
    (its parts) and rotary inverse, so the cache saves after answering (it was a SchemaError), and the loaded cache answers
    the next question as the one saved does."""
    model, _ = kvc.load_model(tiny_checkpoint, device="cpu", dtype="float32")
    cache = compress_context_ids(model, _ids(300, 1), **_options(method, "decode", None))
    first, second = _ids(8, 2), _ids(8, 3)
    answer_from_cache_ids(model, cache, [first], max_new_tokens=NEW, stop_at_eos=False)
    assert cache.layers[0].front.method is cache.options.compressor
    cache.save(tmp_path / "answered.kvc")
    (here,) = answer_from_cache_ids(model, cache, [second], max_new_tokens=NEW, stop_at_eos=False)
    (loaded,) = answer_from_cache_ids(model, kvc.load_cache(tmp_path / "answered.kvc", model), [second], max_new_tokens=NEW,
                                      stop_at_eos=False)
    assert loaded.token_ids == here.token_ids and loaded.slots_per_layer == here.slots_per_layer


@pytest.mark.parametrize("method, reads_queries", [("keydiff", False), ("kvzap", False), ("snapkv", True), ("compactor", True)])
def test_a_stream_holds_queries_only_for_a_method_that_reads_them(tiny_checkpoint, tiny_default_scorer, tmp_path, method,
                                                                   reads_queries):
    """A decode-mode stream's state keeps what scores its latest block between updates; the block's queries are
    handed to it only when the method's requirements name them, so a stream of KeyDiff or KVzap holds (and saves) none;
    the window keeps its tokens without them."""
    model, _ = kvc.load_model(tiny_checkpoint, device="cpu", dtype="float32")
    cache = compress_context_ids(model, _ids(300, 1), **_options(method, "decode", None))
    for layer in cache.layers:
        assert (layer.front.state.last.queries is not None) == reads_queries, method
        assert layer.front.recent.queries is None
    cache.save(tmp_path / "s.kvc")
    (res,) = answer_from_cache_ids(model, kvc.load_cache(tmp_path / "s.kvc", model), [_ids(8, 2)], max_new_tokens=NEW, stop_at_eos=False)
    assert len(res.token_ids) == NEW


def test_text_in_text_out_from_a_saved_document(tiny_checkpoint, tmp_path):
    """kvc.compress_context + save, then kvc.generate(cache=path, questions=...) answers as kvc.generate on the context."""
    model, tokenizer = kvc.load_model(tiny_checkpoint, device="cpu")
    document = "The magic number is 4217. " + "Grass is green and the sky is blue. " * 12
    questions = ["What is the magic number?", "What colour is grass?"]
    settings = dict(method="keydiff", compression_ratio=0.5, kv_bits=4)
    direct = kvc.generate(model, tokenizer, document, questions=questions, max_new_tokens=NEW, stop_at_eos=False, progress=False, **settings)
    cache = kvc.compress_context(model, tokenizer, document, progress=False, **settings)
    cache.save(tmp_path / "doc.kvc")
    loaded = kvc.generate(model, tokenizer, cache=str(tmp_path / "doc.kvc"), questions=questions, max_new_tokens=NEW, stop_at_eos=False)
    assert [r.token_ids for r in loaded] == [r.token_ids for r in direct]
    assert [r.text for r in loaded] == [r.text for r in direct]
    one = kvc.generate(model, tokenizer, cache=cache, question=questions[1], max_new_tokens=NEW, stop_at_eos=False)
    assert one.token_ids == direct[1].token_ids and one.kv_bits == 4 and "4-bit storage" in one.report()
    again = kvc.generate(model, tokenizer, cache=cache, question=questions[1], max_new_tokens=NEW, stop_at_eos=False)
    assert again.token_ids == one.token_ids  # the cache is rolled back to its context after answering


@pytest.mark.parametrize("bits", [None, 4])
def test_sliding_window_layers_are_saved_too(tmp_path, bits):
    """Gemma 2 alternates sliding-window and compressed layers: both come back, and the answer with them."""
    model = tiny_family("gemma2")
    ctx, question = _ids(150, 3) % 96, _ids(6, 4) % 96
    options = dict(method="snapkv", budget=20, sink=2, window=8, kv_bits=bits)
    reference = generate_ids(model, ctx, question, max_new_tokens=NEW, stop_at_eos=False, **options)
    compress_context_ids(model, ctx, **options).save(tmp_path / "g.kvc")
    loaded = kvc.load_cache(tmp_path / "g.kvc", model)
    assert loaded.layers[0].cumulative_length == 150 and loaded.layers[0].keys.shape[2] == 31
    (res,) = answer_from_cache_ids(model, loaded, [question], max_new_tokens=NEW, stop_at_eos=False)
    assert res.token_ids == reference.token_ids


def test_a_cache_moves_to_the_models_dtype(tiny_checkpoint, tmp_path):
    """Saved from the float32 model, loaded into the bfloat16 copy of the same checkpoint: state in bfloat16, answering."""
    model32, _ = kvc.load_model(tiny_checkpoint, device="cpu", dtype="float32")
    compress_context_ids(model32, _ids(200, 5), method="snapkv", budget=24, kv_bits=4).save(tmp_path / "c.kvc")
    compress_context_ids(model32, _ids(200, 5), method="balancekv", budget=24).save(tmp_path / "f.kvc")
    model16, _ = kvc.load_model(tiny_checkpoint, device="cpu", dtype="bfloat16")
    quantized, full = kvc.load_cache(tmp_path / "c.kvc", model16), kvc.load_cache(tmp_path / "f.kvc", model16)
    assert isinstance(quantized.layers[0].front, QuantizedSummary) and quantized.layers[0].front.keys.scale.dtype == torch.bfloat16
    assert quantized.layers[0].tail.keys.dtype == torch.bfloat16 and full.layers[0].stored().keys.dtype == torch.bfloat16
    for cache in (quantized, full):
        (res,) = answer_from_cache_ids(model16, cache, [_ids(5, 6)], max_new_tokens=4, stop_at_eos=False)
        assert len(res.token_ids) == 4
    # live decode-mode streams go on in the dtype they were saved in
    compress_context_ids(model32, _ids(200, 5), method="keydiff", budget=24, mode="decode").save(tmp_path / "d.kvc")
    with pytest.raises(CacheFileError, match="d.kvc': this cache holds live decode-mode streams in float32.*in float32, not bfloat16"):
        kvc.load_cache(tmp_path / "d.kvc", model16)
    # a chunked cache's prompt has ended: its streams' summaries are saved and cast like any summary
    for method in ("keydiff", "express"):
        chunked = compress_context_ids(model32, _ids(200, 5), method=method, budget=24, mode="chunked", chunk_size=64)
        chunked.save(tmp_path / "ch.kvc")
        loaded = kvc.load_cache(tmp_path / "ch.kvc", model16)
        torch.testing.assert_close(loaded.layers[0].stored().keys, chunked.layers[0].stored().keys.bfloat16())
        (res,) = answer_from_cache_ids(model16, loaded, [_ids(5, 6)], max_new_tokens=4, stop_at_eos=False)
        assert len(res.token_ids) == 4


def test_a_chunked_cache_saved_with_its_streams_loads_as_their_summaries(tiny_checkpoint, tmp_path, monkeypatch):
    """A chunked cache file that holds its compacted streams (as an earlier version of the format wrote them, and a
    version-2 file still may) loads in any dtype as the streams' summaries."""
    from kvcompress import cache as cache_module
    from kvcompress.methods.stream import Stream

    model32, _ = kvc.load_model(tiny_checkpoint, device="cpu", dtype="float32")
    with monkeypatch.context() as patch:  # the prompt's end compacting the streams in place, as that version did
        patch.setattr(cache_module.CompressedLayer, "compact", lambda layer: layer.front.compact())
        chunked = compress_context_ids(model32, _ids(200, 5), method="express", budget=24, mode="chunked", chunk_size=64)
    assert isinstance(chunked.layers[0].front, Stream)

    def with_streams(layer, prefix):
        tensors, described = cache_file.state_tensors(f"{prefix}.stream", cache_module._SAVED_STREAM, layer.front, layer.cache.stream_links())
        return tensors, {"kind": "compressed", "seen": layer.seen, "budgets": layer.budgets, "stream": described, "dtype": "float32"}

    with monkeypatch.context() as patch:
        patch.setattr(cache_module.CompressedLayer, "export_state", with_streams)
        chunked.save(tmp_path / "streams.kvc")
    model16, _ = kvc.load_model(tiny_checkpoint, device="cpu", dtype="bfloat16")
    loaded = kvc.load_cache(tmp_path / "streams.kvc", model16)
    torch.testing.assert_close(loaded.layers[0].stored().keys, chunked.layers[0].stored().keys.bfloat16())
    (res,) = answer_from_cache_ids(model16, loaded, [_ids(5, 6)], max_new_tokens=4, stop_at_eos=False)
    assert len(res.token_ids) == 4


def test_the_same_state_saves_to_the_same_tensors(tiny_checkpoint, tmp_path, monkeypatch):
    """A decode-mode stream's buffers have room beyond their slots, allocated uninitialised: only the filled slots are
    written, so two caches of the same context save the same tensors and metadata (safetensors orders the metadata's
    keys as it likes, so the bytes may differ)."""
    model, _ = kvc.load_model(tiny_checkpoint, device="cpu", dtype="float32")
    for name in ("a.kvc", "b.kvc"):
        compress_context_ids(model, _ids(400, 5), method="keydiff", budget=150, mode="decode", chunk_size=48).save(tmp_path / name)
        # the second cache's uninitialised memory holds 7s: what it held must not reach the file
        monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *size, **kwargs: self.new_full(tuple(size[0]) if len(size) == 1 and
                                                                                               not isinstance(size[0], int) else size, 7))
    (a, about_a), (b, about_b) = (cache_file.read(tmp_path / name) for name in ("a.kvc", "b.kvc"))
    assert about_a == about_b and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_saved_stream_builds_only_registered_classes_and_keeps_what_it_shares():
    """A live stream written by schema: shared generators stay shared, the cache's own objects come back by link name,
    an object of no registered class is refused on the way out, and a class name the schema does not list (a class path
    included) on the way in."""
    from kvcompress.methods.base import make_generator
    from kvcompress.methods.registry import build_method
    from kvcompress.methods.stream import Stream
    from kvcompress.saved_state import Instance

    method = build_method("hybrid")
    stream = Stream(method, 16, 2, 4, make_generator(3))
    keys = torch.randn(1, 2, 60, 8)
    stream.update(keys, torch.randn(1, 2, 60, 8), torch.randn(1, 4, 60, 8), pre_rope_keys=keys)
    links = {"method": method, **method.parts(), "unrotate": None}
    tensors, described = cache_file.state_tensors("s", Instance(Stream), stream, links)
    assert described["class"] == "stream" and described["fields"]["method"] == "method"
    read = dict(dims={"B": 1, "H": 2, "Q": 4, "D": 8, "V": 8}, links=links, device="cpu", where="s", path="f.kvc")
    back = cache_file.state_from(tensors, Instance(Stream), json.loads(json.dumps(described)), **read)
    assert back.method is method and back.state.method is method
    assert back.state.generator is back.state.coreset.generator is back.generator  # one generator, as in the stream saved
    assert torch.equal(back.summary().keys, stream.summary().keys)
    more = torch.randn(1, 2, 30, 8)
    for s in (stream, back):
        s.update(more, more, torch.randn(1, 4, 30, 8, generator=torch.Generator().manual_seed(0)), pre_rope_keys=more)
    assert torch.equal(back.summary().positions, stream.summary().positions)
    from kvcompress.saved_state import SchemaError
    with pytest.raises(SchemaError, match=r"expected an instance of \['stream'\], got 'list'"):
        cache_file.state_tensors("s", Instance(Stream), [len], {})
    for name in ("os:system", "kvcompress.methods.stream:Stream", "tokens"):
        edited = json.loads(json.dumps(described))
        edited["class"] = name
        with pytest.raises(CacheFileError, match=rf"at s.class: expected one of \['stream'\], got '{name}'"):
            cache_file.state_from(tensors, Instance(Stream), edited, **read)


@pytest.fixture
def saved(tmp_path):
    """(model, path) of a small saved cache."""
    model = tiny()
    path = tmp_path / "doc.kvc"
    compress_context_ids(model, _ids(120, 7) % 96, method="snapkv", budget=16, sink=2, window=8, kv_bits=4).save(path)
    return model, path


def test_a_truncated_file_is_refused(saved, tmp_path):
    model, path = saved
    data = path.read_bytes()
    for cut, message in ((len(data) - 100, "truncated or corrupted"), (len(data) // 2, "truncated or corrupted"), (100, "truncated"),
                         (5, "too short")):
        short = tmp_path / f"cut{cut}.kvc"
        short.write_bytes(data[:cut])
        with pytest.raises(CacheFileError, match=message):
            kvc.load_cache(short, model)


def test_a_corrupted_file_is_refused(saved, tmp_path):
    model, path = saved
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x40  # one bit of one stored value
    bad = tmp_path / "bad.kvc"
    bad.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="is corrupted: its contents do not match the checksum"):
        kvc.load_cache(bad, model)
    # settings edited by hand, checksum left as it was
    tensors = safetensors.torch.load_file(path)
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    metadata = header["__metadata__"]
    metadata["kvcompress"] = metadata["kvcompress"].replace('"budget": 16', '"budget": 17')
    safetensors.torch.save_file(tensors, bad, metadata)
    with pytest.raises(CacheFileError, match="is corrupted"):
        kvc.load_cache(bad, model)


def test_a_foreign_file_is_refused(saved, tiny_checkpoint, tmp_path):
    model, _ = saved
    with pytest.raises(CacheFileError, match="is not a kvcompress cache file .*e.g. model weights"):
        kvc.load_cache(tiny_checkpoint / "model.safetensors", model)
    text = tmp_path / "notes.txt"
    text.write_text("just some text, long enough to have a header length " * 4)
    with pytest.raises(CacheFileError, match=r"is not a kvcompress cache file: it does not start as a safetensors file does .*; "
                                             r"it starts with b'just some te'$"):
        kvc.load_cache(text, model)  # it said "its header announces 8387229874382703227 bytes"
    whole = (tiny_checkpoint / "model.safetensors").read_bytes()
    (tmp_path / "cut.kvc").write_bytes(whole[:200])
    with pytest.raises(CacheFileError, match="truncated or not a safetensors file"):
        kvc.load_cache(tmp_path / "cut.kvc", model)


def test_another_format_version_is_refused(tmp_path, monkeypatch):
    """A file of another format (the object-graph format 1 before the explicit schema, say) is refused before anything
    is read, with how to remake it."""
    model = tiny()
    current = cache_file.VERSION
    monkeypatch.setattr(cache_file, "VERSION", 1)
    compress_context_ids(model, _ids(100, 8) % 96, method="knorm", budget=16).save(tmp_path / "v1.kvc")
    monkeypatch.setattr(cache_file, "VERSION", current)
    with pytest.raises(CacheFileError, match=f"format version '1'; this kvcompress reads version {current}: compress the context again"):
        kvc.load_cache(tmp_path / "v1.kvc", model)


def test_another_model_is_refused(saved):
    _, path = saved
    with pytest.raises(CacheFileError, match=r"its weights differ from this model's \(model.embed_tokens.weight"):
        kvc.load_cache(path, tiny(seed=1))  # same architecture and config, other weights
    nudged = tiny()  # the same checkpoint moved by 2% (a fine-tune, say): refused; by a bfloat16 rounding: the same model
    with torch.no_grad():
        for p in nudged.parameters():
            p.mul_(1.02)
    with pytest.raises(CacheFileError, match="its weights differ from this model's"):
        kvc.load_cache(path, nudged)
    rounded = tiny()
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.bfloat16().float())
    kvc.load_cache(path, rounded)
    from test_integration import SMALL

    torch.manual_seed(0)
    wider = LlamaForCausalLM(LlamaConfig(**{**SMALL, "num_key_value_heads": 4})).eval()
    with pytest.raises(CacheFileError, match="its num_key_value_heads is 2, this model's is 4"):
        kvc.load_cache(path, wider)
    with pytest.raises(CacheFileError, match="its class is 'LlamaForCausalLM', this model's is 'Qwen2ForCausalLM'"):
        kvc.load_cache(path, tiny("qwen2"))


def test_a_cache_extended_since_it_was_compressed_is_refused_until_rolled_back():
    """answer_from_cache_ids (`kvc.generate(cache=...)`) appends each question right after the context's token_ids: a
    cache that later forwards extended (model.generate on it) is refused, and answers again once restored."""
    model = tiny()
    ctx, question = _ids(100, 9) % 96, _ids(6, 10) % 96
    cache = compress_context_ids(model, ctx, method="snapkv", budget=16)
    snapshot = cache.snapshot()
    (before,) = answer_from_cache_ids(model, cache, [question], max_new_tokens=3, stop_at_eos=False)
    with torch.inference_mode(), kvc.integration.use_compressed_attention(model):
        model(question, past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="cache holds 106 tokens, but its token_ids are the context's 100: .*cache.restore"):
        answer_from_cache_ids(model, cache, [question], max_new_tokens=3, stop_at_eos=False)
    cache.restore(snapshot)
    (after,) = answer_from_cache_ids(model, cache, [question], max_new_tokens=3, stop_at_eos=False)
    assert after.token_ids == before.token_ids


def test_what_cannot_be_saved_is_refused(tmp_path):
    model = tiny()
    ctx = _ids(100, 9) % 96
    with torch.inference_mode(), kvc.integration.use_compressed_attention(model):
        empty = CompressedCache(model, "snapkv", budget=16)
        with pytest.raises(ValueError, match="the cache holds no tokens yet"):
            empty.save(tmp_path / "x.kvc")
        live = CompressedCache(model, "snapkv", budget=16, mode="chunked")
        model(ctx, past_key_values=live, use_cache=True)
        with pytest.raises(ValueError, match="holds live streams that keep absorbing its prompt"):
            live.save(tmp_path / "x.kvc", token_ids=ctx)
        plain = CompressedCache(model, "snapkv", budget=16)
        model(ctx, past_key_values=plain, use_cache=True)
        with pytest.raises(ValueError, match="does not know the ids of the 100 tokens it holds: pass token_ids"):
            plain.save(tmp_path / "x.kvc")
        with pytest.raises(ValueError, match=r"token_ids must be an integer tensor \[1, 100\]"):
            plain.save(tmp_path / "x.kvc", token_ids=ctx[:, :50])
        batch = CompressedCache(model, "snapkv", budget=16)
        model(ctx.expand(2, -1), past_key_values=batch, use_cache=True)
        with pytest.raises(ValueError, match="holds one context \\(batch size 1\\), this cache holds a batch of 2"):
            batch.save(tmp_path / "x.kvc", token_ids=ctx)
    plain.save(tmp_path / "ok.kvc", token_ids=ctx)  # with its ids, a cache built by hand saves
    assert not (tmp_path / "x.kvc").exists()
    with pytest.raises(ValueError, match="the prompt has ended"):
        compress_context_ids(model, ctx, method="snapkv", budget=16, mode="chunked").absorbing = True
    with pytest.raises(ValueError, match="compress_context compresses a context once for later questions"):
        compress_context_ids(model, ctx, method=None)


def test_generate_from_a_cache_takes_its_settings_and_no_context(saved, tiny_checkpoint):
    _, path = saved
    model, tokenizer = kvc.load_model(tiny_checkpoint, device="cpu")
    with pytest.raises(ValueError, match="cache=... answers from a compressed context with its own settings"):
        kvc.generate(model, tokenizer, cache=path, question="Why?", method="snapkv")
    with pytest.raises(ValueError, match="cache=... answers from a compressed context with its own settings"):
        kvc.generate(model, tokenizer, "some context", "Why?", cache=path)
    with pytest.raises(ValueError, match="context must be a str, got NoneType; .* cache= answers from a compressed context"):
        kvc.generate(model, tokenizer, question="Why?")
    with pytest.raises(ValueError, match="cache must be a CompressedCache"):
        answer_from_cache_ids(model, 42, [_ids(3, 0)])


@pytest.mark.parametrize("numel", [1, 3, 4, 10, 2**24 + 1, 28311552, 2**40 + 5])
def test_the_fingerprint_samples_exact_indices_of_any_size(numel):
    """Evenly spaced sample indices in exact integer arithmetic: the first and last element, in order, for any size (a
    float32 linspace rounds indices past 2^24 and stepped past the end of the default model's 28,311,552-element embedding)."""
    index = cache_file.sample_indices(numel, cache_file.SAMPLES_PER_PARAMETER)
    assert index.dtype == torch.int64 and len(index) == min(numel, cache_file.SAMPLES_PER_PARAMETER)
    assert int(index[0]) == 0 and int(index[-1]) == numel - 1 and bool((index[1:] > index[:-1]).all())
    if numel < 2**24:
        linspace = torch.linspace(0, numel - 1, len(index), dtype=torch.float64).round().long()
        assert torch.equal(index, linspace)  # small tensors sample what files already saved sampled
    if numel < 2**26:
        flat = torch.arange(numel, dtype=torch.int64)
        assert flat[index].tolist() == index.tolist()  # every index is inside the tensor


# The saved format: every registered class, its version and its fields. A change here is a change of the file format:
# bump the class's version (`saved(name, version)`) and, for a change old files cannot be read with, cache_file.VERSION.
SAVED_FORMAT = {
    "adaptive_blockwise_state": (4, ['admission', 'budget', 'generator', 'kept', 'kept_extra', 'last', 'limit', 'log_weights', 'method', 'peak_slots', 'seen', 'slack_slots', 'slots']),
    "balancekv_stream": (2, ['budget', 'events', 'exact_count', 'fail_events', 'free', 'generator', 'held', 'key_count', 'key_sum', 'keys', 'method', 'outliers', 'pool', 'references', 'scale', 'shape', 'slack_slots', 'stored_rows', 'template', 'values']),
    "blockwise_state": (2, ['budget', 'generator', 'last', 'limit', 'log_weights', 'method', 'peak_slots', 'seen', 'slack_slots', 'slots']),
    "clustergen_state": (2, ['block_size', 'budget', 'ends', 'pending', 'runs', 'seen', 'slack_slots', 'waiting']),
    "compactor_state": (2, ['budget', 'generator', 'last', 'limit', 'log_weights', 'method', 'peak_slots', 'seen', 'slack_slots', 'slots']),
    "express_buffer": (1, ['parts', 'slots']),
    "express_state": (1, ['block_seen', 'cache', 'candidate', 'count', 'delta', 'depth', 'ell', 'g', 'generator', 'leaf', 'levels', 'm', 'max_group', 'open_leaf', 'scale', 'siblings', 'stratum']),
    "growing_slots": (1, ['length', 'tensors']),
    "hybrid_state": (2, ['budget', 'coreset', 'coreset_slots', 'counts', 'generator', 'last', 'limit', 'log_weights', 'method', 'peak_slots', 'seen', 'slack_slots', 'slots']),
    "kvzap_threshold_state": (1, ['budget', 'kept', 'kept_scores', 'method', 'seen']),
    "kv_summary": (1, ['eviction_only', 'keys', 'log_weights', 'normalizer', 'positions', 'values']),
    "normalizer": (1, ['keys', 'log_weights', 'positions']),
    "quantized_slots": (1, ['bits', 'dims', 'group_size', 'raw']),
    "quantized_state": (1, ['bits', 'exact_within_budget', 'group_size', 'other_bytes', 'shapes', 'state', 'stored']),
    "quantized_ragged_slots": (1, ['counts', 'keys', 'positions', 'values']),
    "quantized_ragged_summary": (1, ['bits', 'counts', 'group_size', 'key_codes', 'key_scale', 'key_zero', 'log_weights', 'positions', 'values']),
    "quantized_summary": (1, ['keys', 'log_weights', 'normalizer', 'positions', 'values']),
    "quantized_tensor": (1, ['axis', 'bits', 'dim', 'group_size', 'packed', 'scale', 'zero']),
    "ragged_summary": (1, ['counts', 'keys', 'log_weights', 'positions', 'values']),
    "stream": (1, ['budget', 'exact', 'exact_last', 'generator', 'head', 'layout', 'method', 'recent', 'scale', 'seen', 'sink', 'state', 'unrotate', 'window']),
    "subgen_state": (1, ['cap', 'centre_pos', 'centre_values', 'centres', 'cluster_weight', 'counts', 'delta', 'delta0', 'generator', 'live', 'mu', 'num_keys', 'num_pos', 'num_sq', 'num_values', 'r', 's', 'sample_cluster', 'sample_keys', 'sample_pos', 'sample_values', 'seen', 'shape']),
    "tokens": (2, ['attention_mass', 'entry_scores', 'exact_keys', 'exact_positions', 'extra_lse', 'hidden_states', 'keys', 'layer_idx', 'num_layers', 'positions', 'pre_rope_keys', 'queries', 'query_positions', 'scale', 'unrotate', 'values']),
}


def test_the_saved_format_is_the_declared_schema():
    """What a cache file holds is each registered class's declared fields, nothing an object merely has: renaming a
    private attribute leaves the format as it is unless the declaration changes, and then this listing shows it."""
    from kvcompress.saved_state import REGISTRY

    assert {name: (cls.saved_version, sorted(cls.saved_fields)) for name, cls in REGISTRY.items()} == SAVED_FORMAT
