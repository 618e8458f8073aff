"""Plain transformers use (issue 14): model.generate with a CompressedCache, many questions per context,
left-padded batches, the pipeline, Phi-3 and Gemma 2/3, on tiny randomly initialised models."""

import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import kvcompress as kvc
from kvcompress.cache import CompressedCache, SlidingWindowLayer
from kvcompress.model_support import SUPPORTED_MODEL_TYPES, check_supported
from kvcompress.options import CompressionOptions
from kvcompress.integration import answer_questions_ids, generate_batch_ids, generate_ids
from kvcompress.integration.generation import full_kv_bytes

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0)
# Gemma layers slide over 32 tokens, so prompts of 100+ tokens really slide.
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "phi3": (Phi3Config, Phi3ForCausalLM, {}),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {"head_dim": 16, "sliding_window": 32}),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {"head_dim": 16, "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]}),
}


def tiny(family="llama", dtype=torch.float32):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    return model_cls(config_cls(**SMALL, **extra)).eval().to(dtype)


def _ids(n, seed=1):
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, cache=None, new=10, **kw):
    out = model.generate(ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_ratio_zero_cache_reproduces_plain_generate(family, dtype):
    model = tiny(family, dtype)
    ids = _ids(100)
    plain = _greedy(model, ids)  # before the cache switches the attention implementation
    cache = CompressedCache(model, "knorm", compression_ratio=0.0)
    assert model.config._attn_implementation == "kvcompress"
    assert torch.equal(_greedy(model, ids, cache), plain)
    assert cache.get_seq_length() == 100 + 9
    sliding = [isinstance(layer, SlidingWindowLayer) for layer in cache.layers]
    assert sliding == ([True, False] if family.startswith("gemma") else [False, False])
    if family.startswith("gemma"):
        assert cache.layers[0].slots() == 31  # the window keeps its last sliding_window - 1 tokens exact
    # the model keeps working without the cache once switched (exact attention with the usual masks)
    assert torch.equal(_greedy(model, ids), plain)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3", "phi3"])
def test_compression_really_happens_and_generation_options_work(family):
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.tolist())

        def end(self):
            self.chunks.append("end")

    model = tiny(family)
    ids = _ids(300)
    cache = CompressedCache(model, "snapkv", compression_ratio=0.5, window=16, sink=4)
    streamer = Collect()
    out = model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=True, top_k=5, streamer=streamer, eos_token_id=95)
    compressed = [i for i, layer in enumerate(cache.layers) if not isinstance(layer, SlidingWindowLayer)]
    assert all(cache.layers[i].slots() == 150 + out.shape[1] - 300 - 1 for i in compressed)
    assert streamer.chunks[-1] == "end" and len(streamer.chunks) == out.shape[1] - 300 + 2
    again = CompressedCache(model, "snapkv", compression_ratio=0.5, window=16, sink=4)
    torch.manual_seed(5)
    a = model.generate(ids, past_key_values=again, max_new_tokens=6, do_sample=True, top_k=5)
    torch.manual_seed(5)
    b = model.generate(ids, past_key_values=CompressedCache(model, "snapkv", compression_ratio=0.5, window=16, sink=4), max_new_tokens=6, do_sample=True, top_k=5)
    assert torch.equal(a, b)


def _left_padded(prompts):
    width = max(p.shape[1] for p in prompts)
    ids = torch.cat([torch.cat([torch.zeros(1, width - p.shape[1], dtype=torch.long), p], 1) for p in prompts])
    mask = torch.stack([torch.arange(width) >= width - p.shape[1] for p in prompts]).long()
    return ids, mask


@pytest.mark.parametrize("method", ["keydiff", "balancekv", "compactor"])
@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_left_padded_batch_rows_equal_solo_runs(method, ratio):
    model = tiny("llama")
    prompts = [_ids(150, 1), _ids(24, 2), _ids(123, 3)]  # row 2: 14 middle tokens, fewer than the head dimension (16) (Compactor's leverage then sees keys of full row rank)
    ids, mask = _left_padded(prompts)
    cache = CompressedCache(model, method, compression_ratio=ratio, sink=2, window=8)
    batch = _greedy(model, ids, cache, attention_mask=mask)
    for row, prompt in enumerate(prompts):
        solo = _greedy(model, prompt, CompressedCache(model, method, compression_ratio=ratio, sink=2, window=8))
        assert torch.equal(batch[row], solo[0]), (method, ratio, row)
        stored = cache.layers[0].stored()
        kept = torch.isfinite(stored.log_weights[row]).sum(-1)
        assert (stored.positions[row][torch.isfinite(stored.log_weights[row])] >= ids.shape[1] - prompt.shape[1]).all()  # no padding kept
        assert (kept == cache.layers[0].slots(row)).all()


def test_a_padded_rows_pre_rope_keys_are_unrotated_at_the_positions_rope_used(monkeypatch):
    """model.generate counts a left-padded row's RoPE positions from its first real token (position_ids from the mask):
    the cache un-rotates that row's keys at those positions, so a method scoring pre-RoPE keys (Compactor) reads the
    row's solo pre-RoPE keys, not keys turned by the padding's length."""
    from kvcompress.methods.compactor import Compactor

    seen = []
    blend = Compactor.blend
    monkeypatch.setattr(Compactor, "blend", lambda self, attention, keys, generator: seen.append(keys) or blend(self, attention, keys, generator))
    model = tiny("llama")
    prompts = [_ids(150, 1), _ids(90, 2)]
    ids, mask = _left_padded(prompts)
    _greedy(model, ids, CompressedCache(model, "compactor", compression_ratio=0.5, sink=2, window=8), new=1, attention_mask=mask)
    padded = seen[1]  # layer 0, row 1 (60 padding tokens)
    seen.clear()
    _greedy(model, prompts[1], CompressedCache(model, "compactor", compression_ratio=0.5, sink=2, window=8), new=1)
    torch.testing.assert_close(padded, seen[0], rtol=1e-4, atol=1e-4)


def test_left_padded_batch_through_kvc_generate_ids_and_gemma():
    for family in ["llama", "gemma2"]:
        model = tiny(family)
        contexts = [_ids(140, 4), _ids(90, 5), _ids(111, 6)]
        question = _ids(7, 7)
        batch = generate_batch_ids(model, contexts, question, method="keydiff", compression_ratio=0.5, max_new_tokens=8, stop_at_eos=False, sink=2, window=8)
        for row, ctx in enumerate(contexts):
            solo = generate_ids(model, ctx, question, method="keydiff", compression_ratio=0.5, max_new_tokens=8, stop_at_eos=False, sink=2, window=8)
            assert batch[row].token_ids == solo.token_ids, (family, row)
            assert batch[row].slots_per_layer == solo.slots_per_layer and batch[row].budget == solo.budget
            assert batch[row].context_tokens == ctx.shape[1] and batch[row].extra["batch_run"] == "one_forward"
    kw = dict(method="keydiff", budget=16, mode="chunked", chunk_size=32, max_new_tokens=4, stop_at_eos=False)
    streamed = generate_batch_ids(model, contexts, question, **kw)  # a stream takes no padding: each context alone
    for ctx, res in zip(contexts, streamed):
        assert res.token_ids == generate_ids(model, ctx, question, **kw).token_ids and res.extra["batch_run"] == "one_by_one"


def test_many_questions_compress_once_and_match_single_runs():
    model = tiny("llama")
    ctx = _ids(200, 8)
    questions = [_ids(6, 9), _ids(11, 10), _ids(4, 11)]
    calls = []
    results = answer_questions_ids(model, ctx, questions, method="snapkv", compression_ratio=0.5, max_new_tokens=7, stop_at_eos=False, window=8)
    for q, res in zip(questions, results):
        single = generate_ids(model, ctx, q, method="snapkv", compression_ratio=0.5, max_new_tokens=7, stop_at_eos=False, window=8)
        assert res.token_ids == single.token_ids
        assert res.slots_per_layer == single.slots_per_layer
        assert res.extra["question_seconds"] <= res.decode_seconds
        calls.append(res.prefill_seconds)
    assert len(set(calls)) == 1  # one shared prefill
    for mode in ["chunked", "decode"]:  # a live stream is copied per question
        streamed = answer_questions_ids(model, ctx, questions, method="knorm", budget=40, mode=mode, chunk_size=32, max_new_tokens=7, stop_at_eos=False, window=8)
        for q, res in zip(questions, streamed):
            single = generate_ids(model, ctx, q, method="knorm", budget=40, mode=mode, chunk_size=32, max_new_tokens=7, stop_at_eos=False, window=8)
            assert (res.token_ids, res.slots_per_layer) == (single.token_ids, single.slots_per_layer), mode
    full = answer_questions_ids(model, ctx, questions, method=None, max_new_tokens=7, stop_at_eos=False)
    for q, res in zip(questions, full):
        assert res.token_ids == generate_ids(model, ctx, q, method=None, max_new_tokens=7, stop_at_eos=False).token_ids
    # decode mode at ratio 0: the ratio is of the context, the longest question and the answer, so nothing is compressed
    # (the questions are streamed, so they count in the length a ratio is of)
    for res, full_res in zip(answer_questions_ids(model, ctx, questions, method="snapkv", compression_ratio=0.0, mode="decode",
                                                  chunk_size=32, max_new_tokens=7, stop_at_eos=False, window=8), full):
        assert res.realised_compression_ratio == 0.0 and res.token_ids == full_res.token_ids
    with pytest.raises(ValueError, match="compress_question"):
        answer_questions_ids(model, ctx, questions, method="snapkv", budget=8, compress_question=True)


def test_many_questions_do_not_recompress(monkeypatch):
    from kvcompress.cache import CompressedLayer

    model = tiny("gemma3")
    count = []
    original = CompressedLayer._compress_once
    monkeypatch.setattr(CompressedLayer, "_compress_once", lambda self, *a: count.append(1) or original(self, *a))
    answer_questions_ids(model, _ids(120), [_ids(5, s) for s in range(4)], method="knorm", compression_ratio=0.5, window=8, max_new_tokens=3)
    assert len(count) == 1  # one full-attention layer, compressed once for four questions


def test_unsupported_architecture_names_the_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).eval()
    with pytest.raises(ValueError, match="gemma2, gemma3_text") as err:
        CompressedCache(gpt2, "knorm", budget=4)
    assert all(name in str(err.value) for name in SUPPORTED_MODEL_TYPES)
    model = tiny()
    CompressedCache(model, CompressionOptions(method="knorm", budget=4))
    assert model.config._attn_implementation == "sdpa"  # library use: the model is left as is
    with pytest.raises(ValueError, match="not both"):
        CompressedCache(tiny(), CompressionOptions(method="knorm", budget=4), budget=3)
    with pytest.raises(ValueError, match="method must be a method name"):
        CompressedCache(tiny(), 3)


def test_transformers_internals_we_rely_on_have_not_moved():
    """Fails loudly when transformers moves the internal APIs the integration is built on (tested: 5.23)."""
    import inspect

    import transformers
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer, get_layer_types_and_kwargs
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from kvcompress.integration.attention import ATTENTION_NAME

    assert transformers.__version__.startswith("5.23."), f"kvcompress is tested with transformers 5.23, found {transformers.__version__}"
    assert ALL_MASK_ATTENTION_FUNCTIONS[ATTENTION_NAME] is sdpa_mask
    assert {"batch_size", "q_length", "kv_length", "kv_offset", "mask_function", "attention_mask", "allow_is_causal_skip"} <= set(inspect.signature(sdpa_mask).parameters)
    assert {"module", "query", "key", "value", "attention_mask", "scaling"} <= set(inspect.signature(sdpa_attention_forward).parameters)
    assert {"lazy_initialization", "update", "get_mask_sizes", "get_seq_length", "get_max_length", "reset"} <= set(dir(CacheLayerMixin))
    assert {"is_sliding", "is_linear", "is_dummy", "get_mask_sizes", "get_seq_length", "crop"} <= set(dir(Cache))
    layer = DynamicSlidingWindowLayer(sliding_window=4)
    layer.update(torch.zeros(1, 1, 6, 2), torch.zeros(1, 1, 6, 2))
    assert (layer.keys.shape[2], layer.cumulative_length, layer.get_mask_sizes(1)) == (3, 6, (4, 3))
    types, kwargs = get_layer_types_and_kwargs(tiny("gemma3").config)
    assert types == ["sliding_attention", "full_attention"] and kwargs[0] == {"sliding_window": 32}


@pytest.mark.parametrize("taken", ["before the prompt", "after the prompt's forward"])
def test_restore_brings_a_chunked_prompt_back_to_streaming(taken):
    """restore() brought back the layers but not `absorbing`: a chunked cache whose prompt had ended stayed ended, so
    the next prompt (or question) went in whole beside the streams, stored the full cache and answered otherwise."""
    model = tiny("llama")
    ids = _ids(120, 3)
    cache = CompressedCache(model, "keydiff", compression_ratio=0.75, mode="chunked", stream_length=130)
    if taken != "before the prompt":
        with torch.no_grad():
            model(ids, past_key_values=cache)
        ids = torch.cat([ids, _ids(6, 4)], 1)  # model.generate takes the whole sequence, the cached part included
    snap = cache.snapshot()
    first = model.generate(ids, past_key_values=cache, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    stored = cache.nbytes()
    cache.restore(snap)
    assert cache.absorbing
    again = model.generate(ids, past_key_values=cache, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert torch.equal(first, again) and cache.nbytes() == stored
    with pytest.raises(ValueError, match="snapshot must be what cache.snapshot\\(\\) returned, got list"):
        cache.restore([])


def test_layer_snapshot_restore_and_sliding_window_state():
    model = tiny("gemma2")
    cache = CompressedCache(model, "knorm", budget=16, sink=2, window=4)
    with torch.no_grad():
        model(_ids(80), past_key_values=cache)
        state = cache.snapshot()
        before = [(layer.slots(), layer.get_seq_length()) for layer in cache.layers]
        model(_ids(40, 2), past_key_values=cache)
        assert cache.get_seq_length() == 120
        cache.restore(state)
    assert [(layer.slots(), layer.get_seq_length()) for layer in cache.layers] == before == [(31, 80), (22, 80)]


@pytest.mark.e2e  # the same blocks run, and their printed output is checked, in tests/test_readme.py (smoke)
def test_readme_use_snippets_run(default_model):
    """Every python block of the README's Use section runs, in order, in one namespace.

    The tensor-level snippet works on the reader's own tensors: the namespace starts with random
    keys/values/queries [1, 3, 1024, 64] and blocks of 256 of them."""
    import re
    from pathlib import Path

    torch.set_num_threads(1)
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    use = readme.split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", use, flags=re.S)
    assert len(blocks) >= 5
    g = torch.Generator().manual_seed(0)
    keys, values, queries = (torch.randn(1, 3, 1024, 64, generator=g) for _ in range(3))
    blocks_of_tensors = list(zip(keys.split(256, dim=2), values.split(256, dim=2)))
    namespace = {"keys": keys, "values": values, "queries": queries, "blocks": blocks_of_tensors, "_loaded": default_model}
    for code in blocks:
        exec(compile(code.replace("kvc.load_model()", "_loaded"), "README.md", "exec"), namespace)
    model, tokenizer = default_model
    assert namespace["batch"]["input_ids"].shape[0] == len(namespace["results"]) == 2
    solo = kvc.generate(model, tokenizer, namespace["contexts"][1], namespace["question"], method="keydiff", compression_ratio=0.5, max_new_tokens=16)
    assert namespace["results"][1].token_ids == solo.token_ids and solo.text
    assert namespace["s"].total_weight().shape == namespace["keys"].shape[:2]  # one total per batch row and KV head


def _word_tokenizer():
    """A word-level tokenizer over the tiny models' 96 ids ("w0".."w92" plus [UNK], [PAD], [EOS]), no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "[EOS]"] + [f"w{i}" for i in range(93)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")


def test_pipeline_answers_like_kvc_generate():
    from transformers import pipeline

    from kvcompress.integration import PIPELINE_TASK

    model, tokenizer = tiny("qwen2"), _word_tokenizer()
    g = torch.Generator().manual_seed(3)
    context = " ".join(f"w{int(i)}" for i in torch.randint(0, 93, (160,), generator=g))
    questions = ["w5 w7 w9", "w1 w2 w3 w4 w8"]
    options = dict(method="snapkv", compression_ratio=0.5, window=8, max_new_tokens=5, stop_at_eos=False)
    pipe = pipeline(PIPELINE_TASK, model=model, tokenizer=tokenizer)
    out = pipe(context, questions=questions, **options)
    direct = kvc.generate(model, tokenizer, context, questions=questions, progress=False, **options)
    assert out["answers"] == [r.text for r in direct] and all(out["answers"])
    assert [r.token_ids for r in out["results"]] == [r.token_ids for r in direct]
    one = pipe(context, question=questions[1], **options)
    assert one["answer"] == direct[1].text and one["result"].slots_per_layer == direct[1].slots_per_layer
    model = tiny()
    CompressedCache(model, CompressionOptions(method="knorm", budget=4))
    assert model.config._attn_implementation == "sdpa"  # library use: the model is left as is
    with pytest.raises(ValueError, match="not both"):
        pipe(context, question="w1", questions=["w2"], **options)
    with pytest.raises(ValueError, match="context must be a non-empty string, got ' '"):
        pipe(" ", question="w1", **options)
    listed = pipe([context, context], question=questions[1], **options)  # a list of contexts: one after the other
    assert [o["answer"] for o in listed] == [direct[1].text] * 2
    for batched in (lambda: pipe([context, context], question="w1", batch_size=2, **options),
                    lambda: pipeline(PIPELINE_TASK, model=model, tokenizer=tokenizer, batch_size=2)(context, question="w1", **options)):
        with pytest.raises(ValueError, match="batch_size=2: the kvcompress pipeline compresses one context per call"):
            batched()
    short = " ".join(f"w{i}" for i in range(3, 43))  # long enough for ratio 0.5 beyond sink + window
    batch = kvc.generate(model, tokenizer, [context, short], "w6", progress=False, **options)
    assert [r.token_ids for r in batch] == [kvc.generate(model, tokenizer, c, "w6", progress=False, **options).token_ids for c in (context, short)]


def test_pipeline_settings_given_when_built_hold_and_reconstruction_gets_the_repeat_instruction():
    """Settings given to `pipeline(...)` were dropped: transformers took max_new_tokens for a generate call the pipeline
    does not make, and every call reset question, questions, answer_prefix and prompt_layout to their defaults. KVzip's
    reconstruction lacked the repeat instruction kvc.generate gives it (other answers than kvc.generate's)."""
    from transformers import pipeline

    from kvcompress.integration import PIPELINE_TASK

    model, tokenizer = tiny("qwen2"), _word_tokenizer()
    g = torch.Generator().manual_seed(5)
    context = " ".join(f"w{int(i)}" for i in torch.randint(0, 93, (120,), generator=g))
    options = dict(method="snapkv", compression_ratio=0.5, window=8, stop_at_eos=False)
    built = pipeline(PIPELINE_TASK, model=model, tokenizer=tokenizer, questions=["w5 w7", "w1 w2"], prompt_layout="newline",
                     max_new_tokens=3, **options)
    out = built(context)
    direct = kvc.generate(model, tokenizer, context, questions=["w5 w7", "w1 w2"], prompt_layout="newline", max_new_tokens=3,
                          progress=False, **options)
    assert [r.token_ids for r in out["results"]] == [r.token_ids for r in direct] and all(len(r.token_ids) == 3 for r in direct)
    called = built(context, question="w1 w2", max_new_tokens=2)  # a call's setting replaces the built one (question: questions too)
    assert called["result"].token_ids == direct[1].token_ids[:2]
    primed = pipeline(PIPELINE_TASK, model=model, tokenizer=tokenizer, question="w5", answer_prefix="w9 w8", max_new_tokens=2, **options)
    unprimed = pipeline(PIPELINE_TASK, model=model, tokenizer=tokenizer, question="w5", max_new_tokens=2, **options)
    from kvcompress.integration.model import build_prompt

    prefixed = sum(t.shape[1] for t in build_prompt(tokenizer, context, "w5", "w9 w8"))
    assert primed(context)["result"].prompt_tokens == prefixed > unprimed(context)["result"].prompt_tokens
    with pytest.raises(ValueError, match="answer_prefix='w9' starts the answer in a primed prompt layout only; prompt_layout='newline'"):
        built(context, answer_prefix="w9")
    with pytest.raises(ValueError, match="answer_prefix must be a str"):
        unprimed(context, answer_prefix=5)
    with pytest.raises(ValueError, match="inputs must be a context string or a non-empty list of them, got"):
        unprimed([])
    for size, message in (("1", "batch_size must be an integer >= 1, got '1'"), (0, "batch_size must be an integer >= 1, got 0")):
        with pytest.raises(ValueError, match=message):
            unprimed(context, batch_size=size)
    with pytest.raises(ValueError, match="do_sample"):
        pipeline(PIPELINE_TASK, model=model, tokenizer=tokenizer, do_sample=True)(context, **options)
    kvzip = dict(method="kvzip", compression_ratio=0.5, max_new_tokens=3, stop_at_eos=False)
    via_pipe = unprimed(context, **kvzip)["result"]
    alone = kvc.generate(model, tokenizer, context, "w5", progress=False, window=8, **kvzip)  # the built window holds
    assert via_pipe.extra["reconstruction"]["tokens"] == alone.extra["reconstruction"]["tokens"]
    assert via_pipe.token_ids == alone.token_ids


@pytest.mark.parametrize("family", ["phi3", "gemma3"])
def test_pre_rope_keys_are_recovered_for_partial_and_per_layer_type_rope(family):
    """Compactor scores pre-RoPE keys: Phi-3 rotates a prefix of each head (partial_rotary_factor), Gemma 3 has global and local RoPE."""
    import importlib

    config_cls, model_cls, extra = FAMILIES[family]
    extra = {**extra, "partial_rotary_factor": 0.5} if family == "phi3" else extra
    torch.manual_seed(0)
    model = model_cls(config_cls(**SMALL, **extra)).eval()
    modeling = importlib.import_module(type(model).__module__)
    ids = _ids(120)
    plain = _greedy(model, ids)
    cache = CompressedCache(model, "compactor", budget=4)
    k = torch.randn(1, 2, 10, model.config.head_dim if family == "gemma3" else 16)
    pos = torch.arange(5, 15)
    rope = model.model.rotary_emb
    cos, sin = rope(k, pos[None], "full_attention") if family == "gemma3" else rope(k, pos[None])
    if family == "phi3":
        assert cos.shape[-1] == 8
    _, rotated = modeling.apply_rotary_pos_emb(k, k, cos, sin)
    torch.testing.assert_close(cache.pre_rope_keys(rotated, pos), k, atol=1e-5, rtol=1e-5)
    assert torch.equal(_greedy(model, ids, CompressedCache(model, "compactor", compression_ratio=0.0)), plain)


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512},
                                  {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}])
def test_pre_rope_keys_are_recovered_under_a_scaled_rope(rope):
    """YaRN (and LongRoPE) multiply cos and sin by an attention scaling s: the inverse returned s² times the keys."""
    model = LlamaForCausalLM(LlamaConfig(**SMALL, rope_parameters=rope)).eval()
    k = torch.randn(1, 2, 10, 16, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(100, 110)
    cos, sin = model.model.rotary_emb(k, pos[None])
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    _, rotated = apply_rotary_pos_emb(k, k, cos, sin)
    torch.testing.assert_close(CompressedCache(model, "compactor", budget=4).pre_rope_keys(rotated, pos), k, atol=1e-5, rtol=1e-5)


def test_pre_rope_keys_of_local_rope_layers_compressed_as_full_attention_are_refused():
    """A Gemma 3 whose window is as long as its positions compresses its sliding layers as full attention, but they rotate
    with the local RoPE: un-rotated with the global one, their pre-RoPE keys were wrong (relative error 0.94)."""
    config_cls, model_cls, extra = FAMILIES["gemma3"]
    model = model_cls(config_cls(**SMALL, **{**extra, "sliding_window": SMALL["max_position_embeddings"]})).eval()
    with pytest.raises(ValueError, match=r"layers \[0\] slide over a window as long as the model's positions"):
        CompressedCache(model, "compactor", budget=4)
    CompressedCache(model, "knorm", budget=4)  # a method that reads no pre-RoPE keys runs


def test_scoring_pairs_are_recorded_for_a_fused_qkv_projection():
    """train-scorer found a layer's inputs by a `k_proj` attribute, which Phi-3's fused qkv_proj lacks: it recorded no
    layer and failed ("hidden and targets must cover the same layers, got [] and []")."""
    from kvcompress.integration.scorer_training import record_scoring_pairs

    model, tokenizer = tiny("phi3"), _word_tokenizer()
    pairs = record_scoring_pairs(model, tokenizer, _ids(60))
    assert sorted(pairs.hidden) == sorted(pairs.targets) == [0, 1]
    assert all(pairs.hidden[i].shape == (60 - 4, SMALL["hidden_size"]) for i in pairs.hidden)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_a_recorded_prefill_is_the_models_own_on_sliding_and_soft_capped_layers(family):
    """capture_qkv (the eval runner's shared prefill) gave sliding layers no window (no mask function was registered for
    its attention), so a full layer after one saw other keys (3.36 off on a tiny Gemma 3); on Gemma 2 it failed, SDPA
    taking no soft-capping. Its keys and values are now the plain forward's."""
    from kvcompress.eval.capture import capture_qkv

    model, ids = tiny(family), _ids(150)
    plain = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=plain, use_cache=True)
    captured = capture_qkv(model, ids)
    for i, layer in enumerate(plain.layers):
        n = layer.keys.shape[2]  # a sliding layer stores its window's last tokens
        torch.testing.assert_close(captured[i][1][:, :, -n:], layer.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(captured[i][2][:, :, -n:], layer.values, atol=1e-5, rtol=1e-5)


def test_a_sliding_layers_peak_is_what_it_stores():
    """In prefill mode a sliding-window layer counted the whole prompt block it hands attention in its peak, where the full
    cache's figure counts the window it stores: the peak read above the full cache's."""
    for family in ("gemma2", "gemma3"):
        model = tiny(family)
        ids = _ids(130)
        res = generate_ids(model, ids[:, :120], ids[:, 120:], method="snapkv", compression_ratio=0.5, window=8, max_new_tokens=2,
                           stop_at_eos=False)
        assert res.kv_bytes < res.peak_kv_bytes <= res.kv_bytes_full


def test_the_peak_counts_the_headroom_a_growing_buffer_takes():
    """A compressed context stores later tokens in place, in a buffer grown with headroom; the peak was taken before the
    growth, so a cache keeping almost every token reported a peak below what it stored after the answer."""
    model = tiny("llama")
    for n, ratio in ((150, 0.03), (300, 0.006), (300, 0.03)):
        cache = CompressedCache(model, "compactor", compression_ratio=ratio)
        _greedy(model, _ids(n), cache, new=22)
        assert cache.nbytes() <= cache.peak_bytes(), (n, ratio)
        assert all(layer.nbytes() <= layer.stats.peak_bytes for layer in cache.layers), (n, ratio)


def test_beam_search_with_a_ratio_zero_cache_equals_plain_beam_search():
    model = tiny("qwen2")
    ids = _ids(90)
    plain = _greedy(model, ids, num_beams=3)
    assert torch.equal(_greedy(model, ids, CompressedCache(model, "balancekv", compression_ratio=0.0), num_beams=3), plain)
    half = CompressedCache(model, "balancekv", compression_ratio=0.5, sink=4, window=8)
    assert _greedy(model, ids, half, num_beams=3).shape == (1, 10)
    assert half.layers[0].slots() == 45 + 9  # half of the 90 prompt tokens, then the 9 decoded ones exact, in every beam
    with pytest.raises(ValueError, match="beam search"):
        _greedy(model, ids, CompressedCache(model, "knorm", budget=16, mode="decode"), num_beams=3)


def test_softcapped_attention_chunks_agree_with_one_pass(monkeypatch):
    from kvcompress.integration import attention

    model = tiny("gemma2")
    ids = _ids(100)
    whole = _greedy(model, ids, CompressedCache(model, "balancekv", compression_ratio=0.5, sink=4, window=8))
    monkeypatch.setattr(attention, "_query_chunks", lambda query, n_keys: [(s, s + 7) for s in range(0, query.shape[2], 7)])
    assert torch.equal(_greedy(model, ids, CompressedCache(model, "balancekv", compression_ratio=0.5, sink=4, window=8)), whole)


@pytest.mark.parametrize("family", ["phi3", "mistral"])
def test_a_model_whose_every_layer_slides_is_refused_a_compressed_cache(family):
    """Every layer sliding (Mistral-7B-v0.1, Phi-3-mini-4k: a window below the positions), a CompressedCache compressed
    nothing and said nothing, and generate_ids failed dividing by zero: both now refuse, naming the window; the full
    cache runs."""
    config_cls, model_cls, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**SMALL, "sliding_window": 32})).eval()
    ids = _ids(100)
    message = "every layer of this model slides .sliding_window=32 tokens, below its max_position_embeddings=2048.: kvcompress compresses"
    with pytest.raises(ValueError, match=message):
        CompressedCache(model, "knorm", compression_ratio=0.5, window=8)
    for mode in ("prefill", "decode"):
        with pytest.raises(ValueError, match=message):
            generate_ids(model, ids[:, :90], ids[:, 90:], method="knorm", compression_ratio=0.5, mode=mode, max_new_tokens=2)
    full = generate_ids(model, ids[:, :90], ids[:, 90:], method=None, max_new_tokens=2, stop_at_eos=False)
    assert full.slots_per_layer == [31, 31] and full.realised_compression_ratio == 0.0
    torch.manual_seed(0)
    unbounded = model_cls(config_cls(**{**SMALL, "sliding_window": SMALL["max_position_embeddings"]})).eval()
    assert all(kind == "full_attention" for kind, _ in check_supported(unbounded))


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_the_full_caches_bytes_are_what_a_plain_transformers_cache_stores(family):
    """kv_bytes_full, the reference of every 'saved' figure, is what transformers' own cache stores for the same tokens:
    a sliding-window layer holds its last window - 1 tokens, not every token."""
    model = tiny(family)
    ids = _ids(120)
    plain = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=plain, use_cache=True)
    stored = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in plain.layers)
    assert full_kv_bytes(model, 120, torch.float32) == stored
    assert generate_ids(model, ids[:, :100], ids[:, 100:], method=None, max_new_tokens=1, stop_at_eos=False).kv_bytes_full == stored


@pytest.mark.parametrize("method", ["hybrid", "express", "balancekv", "subgen", "random"])
def test_a_randomized_methods_batch_of_equal_rows_gives_each_row_its_solo_summary(method):
    """Beams, num_return_sequences and equal-length contexts are one unpadded batch: a randomized method compresses
    each row alone with the solo run's generator, so every row keeps what it keeps alone (drawn for all rows at once, no
    row did)."""
    model = tiny("llama")
    prompts = [_ids(150, 1), _ids(150, 1), _ids(150, 2)]
    cache = CompressedCache(model, method, compression_ratio=0.5, sink=2, window=8)
    batch = _greedy(model, torch.cat(prompts), cache)
    for row, prompt in enumerate(prompts):
        solo_cache = CompressedCache(model, method, compression_ratio=0.5, sink=2, window=8)
        solo = _greedy(model, prompt, solo_cache)
        assert torch.equal(batch[row], solo[0]), (method, row)
        for layer, alone in zip(cache.layers, solo_cache.layers):
            mine, theirs = layer.stored(), alone.stored()
            kept = torch.isfinite(mine.log_weights[row])
            assert torch.equal(mine.positions[row][kept], theirs.positions[0][torch.isfinite(theirs.log_weights[0])]), (method, row)


@pytest.mark.parametrize("mode", ["chunked", "decode"])
def test_a_randomized_methods_stream_refuses_a_batch_and_kvc_generate_runs_its_rows_alone(mode):
    model = tiny("llama")
    ids = torch.cat([_ids(150, 1), _ids(150, 2)])
    with pytest.raises(ValueError, match=rf"method 'express' draws random numbers.*mode='{mode}' run one row at a time"):
        _greedy(model, ids, CompressedCache(model, "express", mode=mode, budget=64, sink=2, window=8))
    _greedy(model, ids, CompressedCache(model, "keydiff", mode=mode, budget=64, sink=2, window=8))  # draws nothing
    results = generate_batch_ids(model, [ids[:1], ids[1:]], ids[:1, :5], method="express", mode=mode, compression_ratio=0.5,
                                 max_new_tokens=3, stop_at_eos=False)
    assert [r.extra["batch_run"] for r in results] == ["one_by_one"] * 2


@pytest.mark.parametrize("settings", [dict(method="adakv", method_params={"scorer": "random", "scope": "model"}),
                                      dict(method="random", prefill_approx="express")])
def test_kvc_generate_runs_alone_the_batches_one_forward_would_draw_for_together(settings):
    """A randomized scorer with one budget over every layer, and an approximate prefill (Express streams the batch),
    cannot draw row by row in one forward: kvc.generate answers each context alone, as it answers it alone."""
    model = tiny("llama")
    contexts, question = [_ids(150, 1), _ids(150, 2)], _ids(5, 3)
    results = generate_batch_ids(model, contexts, question, compression_ratio=0.5, max_new_tokens=3, stop_at_eos=False, **settings)
    assert [r.extra["batch_run"] for r in results] == ["one_by_one"] * 2
    for context, res in zip(contexts, results):
        assert res.token_ids == generate_ids(model, context, question, compression_ratio=0.5, max_new_tokens=3, stop_at_eos=False,
                                             **settings).token_ids


def test_assisted_generation_is_refused_before_any_token_is_fed():
    """transformers checks an assistant's draft tokens in the cache's forwards, so a compressing cache would compress them
    with the prompt (an identical assistant, whose drafts are all kept, changed the answer without a word), and crops the
    drafts it rejects, which no compressed cache takes back: refused before any token is fed (`activate_past_recording`),
    for an assistant model and for prompt lookup, at ratio 0 too (it ran there until the first rejected draft, then
    failed part way through the answer)."""
    model, ids = tiny("llama"), _ids(150, 1)
    draft = dict(assistant_model=tiny("llama"), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    for extra in (draft, dict(prompt_lookup_num_tokens=3, max_new_tokens=6, do_sample=False)):
        for settings, named in ((dict(compression_ratio=0.5), r"compression_ratio=0\.5"), (dict(compression_ratio=0.0), r"compression_ratio=0\.0"),
                                (dict(budget=16), "budget=16")):
            cache = CompressedCache(model, "keydiff", sink=2, window=8, **settings)
            with pytest.raises(ValueError, match=rf"^a CompressedCache \({named}\) cannot serve assisted generation"):
                model.generate(ids, past_key_values=cache, **extra)
            assert cache.get_seq_length() == 0  # refused before the prompt's forward


def test_cache_operations_transformers_calls_answer_or_are_refused_clearly():
    """crop (assisted generation, prompt lookup) is refused naming why; batch_select_indices selects rows as beam
    search's reorder does, and batch_repeat_interleave repeats them as transformers' layers do; reset starts a new
    prompt, which a chunked cache compresses again."""
    model, ids = tiny("llama"), torch.cat([_ids(150, 1), _ids(150, 2)])
    cache = CompressedCache(model, "keydiff", compression_ratio=0.5, sink=2, window=8)
    _greedy(model, ids, cache, new=2)
    cache.crop(0)  # transformers' no-op
    snapshot = cache.snapshot()
    with pytest.raises(ValueError, match=r"a CompressedCache cannot remove its last 5 tokens \(crop\(-5\)\): compression drops"):
        cache.crop(-5)
    with pytest.raises(ValueError, match=r"refused crop\(-5\) and still holds the tokens it was asked to drop"):
        _greedy(model, ids, cache, new=1)
    cache.restore(snapshot)
    cache.batch_repeat_interleave(2)
    stored, before = cache.layers[0].stored(), snapshot.layers[0]
    assert cache.layers[0].rows == 4 and torch.equal(stored.keys, cache.layers[0].stored().keys)
    restored = CompressedCache(model, "keydiff", compression_ratio=0.5, sink=2, window=8)
    restored.restore(snapshot)
    assert torch.equal(stored.keys, restored.layers[0].stored().keys.repeat_interleave(2, dim=0))
    cache.restore(snapshot)
    # two stored rows are each row's own context: one row would read both (broadcast), so it is refused
    with pytest.raises(ValueError, match=r"layer 0 holds 2 batch rows and got a block of 1: each row goes on from its own stored context"):
        _greedy(model, ids[:1], cache, new=1)
    cache.restore(snapshot)
    before = cache.layers[0].stored()
    for index in ([1], torch.tensor([False, True])):  # a list and a mask, as transformers' own layers take them
        cache.restore(snapshot)
        cache.batch_select_indices(index)
        assert torch.equal(cache.layers[0].stored().keys[0], before.keys[1])
    cache.restore(snapshot)
    cache.batch_select_indices(torch.tensor([1]))
    assert torch.equal(cache.layers[0].stored().keys[0], before.keys[1])
    chunked = CompressedCache(model, "snapkv", mode="chunked", budget=32, sink=2, window=8)
    fresh = [CompressedCache(model, "snapkv", mode="chunked", budget=32, sink=2, window=8) for _ in range(2)]
    first = model.generate(ids[:1], past_key_values=chunked, max_new_tokens=3, do_sample=False, prefill_chunk_size=64)
    assert torch.equal(first, model.generate(ids[:1], past_key_values=fresh[0], max_new_tokens=3, do_sample=False, prefill_chunk_size=64))
    chunked.reset()
    again = model.generate(ids[1:], past_key_values=chunked, max_new_tokens=3, do_sample=False, prefill_chunk_size=64)
    assert torch.equal(again, model.generate(ids[1:], past_key_values=fresh[1], max_new_tokens=3, do_sample=False, prefill_chunk_size=64))
    assert chunked.slots_per_layer() == fresh[1].slots_per_layer()
    for method in (None, "full", CompressionOptions(method=None)):
        with pytest.raises(ValueError, match="a CompressedCache compresses, and the full cache is transformers' own DynamicCache"):
            CompressedCache(model, method)


@pytest.mark.parametrize("family, method, bits", [("llama", "keydiff", None), ("gemma2", "keydiff", None), ("gemma3", "keydiff", None),
                                                  ("llama", "adakv", None), ("llama", "snapkv", 4), ("llama", "adakv", 4)])
def test_beams_and_samples_from_a_compressed_context_share_its_one_row(family, method, bits):
    """A one-row compressed context is shared by every row transformers expands the prompt to (beam search,
    num_return_sequences), however it is stored (a buffer, packed heads, quantized) and sliding-window layers' windows
    too: the same tokens as the cache expanded to those rows first. A live stream's rows are its own: another count is
    refused, before any layer takes the block."""
    from kvcompress.integration import compress_context_ids

    model, ids = tiny(family), _ids(120)
    prompt = torch.cat([ids, _ids(6, 2)], 1)
    settings = dict(method=method, compression_ratio=0.5, sink=2, window=8, kv_bits=bits)
    for k, kwargs in ((3, dict(num_beams=3, do_sample=False)), (2, dict(num_return_sequences=2, do_sample=True))):
        expanded = compress_context_ids(model, ids, **settings)
        expanded.batch_select_indices(torch.zeros(k, dtype=torch.long))
        torch.manual_seed(0)
        reference = model.generate(prompt, past_key_values=expanded, max_new_tokens=5, **kwargs)
        torch.manual_seed(0)
        shared = model.generate(prompt, past_key_values=compress_context_ids(model, ids, **settings), max_new_tokens=5, **kwargs)
        assert torch.equal(shared, reference)
    stream = compress_context_ids(model, ids, mode="decode", **settings)
    before = [layer.nbytes() for layer in stream.layers]
    with pytest.raises(ValueError, match="holds 1 batch row and got a block of 2: a live stream .* goes on with the rows it started with"):
        _greedy(model, torch.cat([prompt, prompt]), stream, new=1)
    assert [layer.nbytes() for layer in stream.layers] == before
    assert _greedy(model, prompt, stream, new=1).shape == (1, 1)  # and it goes on with its one row


def test_a_cache_refuses_the_blocks_of_another_model():
    """A cache built on one model and run by another of other shapes stored their blocks anyway (or failed inside a
    method): it now names the model it was built for."""
    config_cls, model_cls, extra = FAMILIES["llama"]
    built_for = tiny("llama")
    torch.manual_seed(0)
    other = model_cls(config_cls(**{**SMALL, "num_key_value_heads": 1}, **extra)).eval()
    assert other.config.num_key_value_heads != built_for.config.num_key_value_heads
    cache = CompressedCache(built_for, "keydiff", budget=16)
    with pytest.raises(ValueError, match="this cache was built for a model of .* layers of .* KV heads of dim .*; build a "
                                         "CompressedCache for the model it runs with"):
        with torch.no_grad():
            other(_ids(20), past_key_values=cache)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_ratio_zero_matches_a_plain_forward_in_logits_and_bytes(family):
    """At ratio 0 the logits are a plain forward's to float32 rounding (greedy tokens alone hid a wrong head mapping in
    Gemma 2's soft-capped path), and the bytes stored are the full cache's, sliding-window layers' windows included."""
    from kvcompress.integration import generate_ids

    model = tiny(family)
    ids = _ids(80)
    with torch.no_grad():
        plain = model(ids).logits
        cache = CompressedCache(model, "knorm", compression_ratio=0.0)
        torch.testing.assert_close(model(ids, past_key_values=cache).logits, plain, atol=1e-5, rtol=1e-5)
    res = generate_ids(model, ids[:, :70], ids[:, 70:], method="knorm", compression_ratio=0.0, max_new_tokens=4, stop_at_eos=False)
    assert res.kv_bytes == res.kv_bytes_full and res.realised_compression_ratio == 0.0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_padded_rows_statistics_are_its_own(family):
    """A short row of a padded batch reported the batch's width: its realised ratio counted the padding as tokens not
    kept, and a sliding-window layer's slots counted the padding its window holds; the batch's bytes were compared with
    one row's full cache. Each row's slots and realised ratio now equal its solo run's, and the bytes are the batch's."""
    model = tiny(family)
    contexts, question = [_ids(90, 5), _ids(50, 6)], _ids(5, 7)
    kw = dict(method="knorm", budget=12, sink=2, window=4, max_new_tokens=3, stop_at_eos=False)
    batch = generate_batch_ids(model, contexts, question, **kw)
    assert all(res.extra["batch_run"] == "one_forward" for res in batch)
    for ctx, res in zip(contexts, batch):
        solo = generate_ids(model, ctx, question, **kw)
        assert (res.slots_per_layer, res.realised_compression_ratio) == (solo.slots_per_layer, pytest.approx(solo.realised_compression_ratio))
        assert res.kv_bytes <= res.kv_bytes_full
    full = generate_batch_ids(model, contexts, question, **{**kw, "method": None, "budget": None, "sink": None, "window": None})
    assert all(res.kv_bytes == res.peak_kv_bytes == res.kv_bytes_full for res in full)  # the full cache saves nothing
    for ctx, res in zip(contexts, full):
        assert res.slots_per_layer == generate_ids(model, ctx, question, method=None, max_new_tokens=3, stop_at_eos=False).slots_per_layer


@pytest.mark.parametrize("mode", ["prefill", "chunked", "decode"])
def test_a_compressed_context_goes_on_under_model_generate(mode):
    """A cache from `compress_context_ids` (and after `answer_from_cache_ids` answered from it) goes on under a plain
    `model.generate`: a decode-mode cache's streams write in place into buffers built under inference mode, which
    torch refuses outside it; the tokens are those of the same cache answering the same question."""
    from kvcompress.integration import answer_from_cache_ids, compress_context_ids

    model, ids, question = tiny("llama"), _ids(120), _ids(6, 2)
    settings = dict(method="keydiff", compression_ratio=0.5, sink=2, window=8, mode=mode)
    (answer,) = answer_from_cache_ids(model, compress_context_ids(model, ids, **settings), [question], max_new_tokens=4,
                                      stop_at_eos=False)
    cache = compress_context_ids(model, ids, **settings)
    assert _greedy(model, torch.cat([ids, question], 1), cache, new=4)[0].tolist() == answer.token_ids
    answered = compress_context_ids(model, ids, **settings)
    answer_from_cache_ids(model, answered, [question], max_new_tokens=4, stop_at_eos=False)
    assert _greedy(model, torch.cat([ids, question], 1), answered, new=4)[0].tolist() == answer.token_ids


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_snapshot_restores_into_a_reset_or_a_fresh_cache(family, tmp_path):
    """`reset()` then `restore(snapshot)`, or a snapshot restored into a fresh cache, answers as the cache it was taken
    from, sliding-window layers included (their window was dropped as uninitialised), and keeps the budgets it was
    compressed to: the file it saves loads (it held the budgets of every compression since, or none)."""
    from kvcompress.integration import answer_from_cache_ids, compress_context_ids

    model, ctx, question = tiny(family), _ids(150), _ids(8, 2)
    cache = compress_context_ids(model, ctx, method="keydiff", compression_ratio=0.5)
    snapshot = cache.snapshot()
    (reference,) = answer_from_cache_ids(model, cache, [question], max_new_tokens=6, stop_at_eos=False)
    fresh = CompressedCache(model, cache.options)
    cache.reset()
    for target in (cache, fresh):
        target.restore(snapshot)
        (again,) = answer_from_cache_ids(model, target, [question], max_new_tokens=6, stop_at_eos=False)
        assert again.token_ids == reference.token_ids and again.budget == reference.budget
        target.save(tmp_path / "again.kvc")
        assert kvc.load_cache(tmp_path / "again.kvc", model).middle_budget() == cache.middle_budget()
    # restored to before its first context, a cache compresses the next one to that one's budget alone
    restored, alone = (CompressedCache(model, "keydiff", compression_ratio=0.5) for _ in range(2))
    before = restored.snapshot()
    with torch.no_grad():
        model(ctx, past_key_values=restored)
        restored.restore(before)
        model(ctx[:, :100], past_key_values=restored)
        model(ctx[:, :100], past_key_values=alone)
    assert [getattr(layer, "budgets", None) for layer in restored.layers] == [getattr(layer, "budgets", None) for layer in alone.layers]
    restored.save(tmp_path / "restored.kvc", token_ids=ctx[:, :100])
    assert kvc.load_cache(tmp_path / "restored.kvc", model).middle_budget() == alone.middle_budget()


def test_a_stream_past_its_stream_length_warns_once():
    """A cache built by name resolves its compression_ratio against stream_length; a stream that takes more tokens stays
    within the budget that gave, keeping less than the ratio says (at ratio 0 it compresses), and warns once, naming
    stream_length. Within it, ratio 0 answers as transformers' DynamicCache, without the warning."""
    import warnings

    model, ids = tiny("llama"), _ids(200)
    reference = model.generate(ids, past_key_values=DynamicCache(config=model.config), max_new_tokens=10, do_sample=False)
    for mode, length, warns in (("decode", 209, False), ("chunked", 200, False), ("decode", 200, True), ("chunked", 100, True)):
        cache = CompressedCache(model, "keydiff", compression_ratio=0.0, mode=mode, stream_length=length)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model.generate(ids, past_key_values=cache, max_new_tokens=10, do_sample=False)
        said = [str(w.message) for w in caught if "stream_length" in str(w.message)]
        assert len(said) == warns and all(f"more than stream_length={length}" in m for m in said), (mode, length, said)
        assert torch.equal(out, reference) or warns, (mode, length)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("method, mode", [("keydiff", "prefill"), ("keydiff", "chunked"), ("tova", "decode"),
                                          ("balancekv", "decode"), ("subgen", "chunked"), ("adakv", "decode")])
def test_a_context_compressed_under_inference_mode_answers_outside_it(family, method, mode, tmp_path):
    """torch.inference_mode makes inference tensors, which refuse in-place writes outside it: a context compressed under
    it (a stream's buffers, a block appended in place) answers through `model.generate` (which runs under no_grad) as
    the same context compressed under no_grad does, and so does one loaded from a file under it, and a snapshot
    restored under it, answered twice outside it."""
    from kvcompress.integration import answer_from_cache_ids, compress_context_ids

    model, ctx, question = tiny(family), _ids(150), _ids(8, 2)
    settings = dict(compression_ratio=0.5, mode=mode, **({"stream_length": 161} if mode != "prefill" else {}))  # + 3 answer tokens fed
    answers = []
    for grad_mode in (torch.no_grad, torch.inference_mode):
        cache = CompressedCache(model, method, **settings)
        with grad_mode():
            model(ctx, past_key_values=cache)
        answers.append(model.generate(torch.cat([ctx, question], 1), past_key_values=cache, max_new_tokens=4, do_sample=False))
    assert torch.equal(answers[0], answers[1])
    settings.pop("stream_length", None)
    cache = compress_context_ids(model, ctx, method=method, **settings)
    (reference,) = answer_from_cache_ids(model, cache, [question], max_new_tokens=4, stop_at_eos=False)
    with torch.inference_mode():
        cache.save(tmp_path / "doc.kvc")
        loaded = kvc.load_cache(tmp_path / "doc.kvc", model)
        snapshot = loaded.snapshot()
        restored = kvc.load_cache(tmp_path / "doc.kvc", model)
        restored.reset()
        restored.restore(snapshot)
    for held in (loaded, restored, restored):
        (again,) = answer_from_cache_ids(model, held, [question], max_new_tokens=4, stop_at_eos=False)
        assert again.token_ids == reference.token_ids


@pytest.mark.parametrize("method", ["keydiff", "adakv"])  # a block appended in place; a packed context and its tail
def test_a_forward_stopped_before_its_commit_is_forgotten_by_restore_and_reset(method):
    """A forward that stops between a layer's update and its commit (an error in the model, Ctrl-C) leaves that layer's
    block pending; `restore(snapshot)` and `reset()` then restore start over without it, so the cache answers again as
    it did."""
    from kvcompress.cache import CompressedLayer
    from kvcompress.integration import answer_from_cache_ids, compress_context_ids

    model, ctx, question = tiny("llama"), _ids(150), _ids(8, 2)
    cache = compress_context_ids(model, ctx, method=method, compression_ratio=0.5)
    snapshot = cache.snapshot()
    (reference,) = answer_from_cache_ids(model, cache, [question], max_new_tokens=6, stop_at_eos=False)

    def stopped(self, *args, **kwargs):
        raise KeyboardInterrupt

    for start_over in (lambda: cache.restore(snapshot), lambda: (cache.reset(), cache.restore(snapshot))):
        cache.restore(snapshot)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(CompressedLayer, "commit", stopped)
            with pytest.raises(KeyboardInterrupt), torch.no_grad():
                model(question, past_key_values=cache)
        assert any(layer.pending is not None for layer in cache.layers if isinstance(layer, CompressedLayer))
        with pytest.raises(RuntimeError, match=r"an earlier forward stopped .* cache\.restore\(snapshot\) or start over with cache\.reset\(\)"):
            with torch.no_grad():
                model(question, past_key_values=cache)
        start_over()
        (again,) = answer_from_cache_ids(model, cache, [question], max_new_tokens=6, stop_at_eos=False)
        assert again.token_ids == reference.token_ids


@pytest.mark.parametrize("mode", ["chunked", "decode"])
def test_a_stream_that_scores_rows_together_takes_one_row(mode):
    """AdaKV over SnapKV pads each head of a stream's batch to the longest head of the batch, and SnapKV's softmax and
    pooling read every key of a head: a cache refuses such a batch in a stream, naming what to do, and `kvc.generate`
    runs its contexts one at a time, each as it runs alone. Over KVzap's scores (the default's), fixed on entry, a
    batch streams in one forward."""
    from kvcompress.integration import use_compressed_attention
    from kvcompress.methods.registry import build_method
    from test_integration import blocks

    model, question = tiny("llama"), _ids(6, 2)
    contexts = [_ids(150, 1), _ids(150, 7)]
    cache = CompressedCache(model, "adakv", compression_ratio=0.5, mode=mode, stream_length=150)
    with pytest.raises(ValueError, match="streams a batch's rows together.*run one row at a time"):
        with torch.no_grad(), use_compressed_attention(model):
            model(torch.cat(contexts), past_key_values=cache)
    settings = dict(method="adakv", compression_ratio=0.5, mode=mode, max_new_tokens=5, stop_at_eos=False, **blocks(mode))
    batch = generate_batch_ids(model, contexts, question, **settings)
    assert [r.extra["batch_run"] for r in batch] == ["one_by_one"] * 2
    assert [r.token_ids for r in batch] == [generate_ids(model, c, question, **settings).token_ids for c in contexts]
    assert build_method("adakv", scorer="kvzap").stream_rows_apart and not build_method("adakv").stream_rows_apart


def test_a_context_held_only_exactly_is_shared_by_beams_and_a_restored_snapshot_saves_at_once(tmp_path):
    """A chunked cache whose prompt ended before its first token holds its context only in the exact tail: beams share
    it too. A decode-mode snapshot restored into a fresh cache saves at once (it took its dtype and device from the
    state, not from a forward) and loads to answer as the cache it was taken from."""
    from kvcompress.integration import answer_from_cache_ids, compress_context_ids

    model, ids = tiny("llama"), _ids(40)
    cache = CompressedCache(model, "keydiff", budget=24, mode="chunked")
    cache.absorbing = False
    with torch.no_grad():
        model(ids, past_key_values=cache)
    assert cache.layers[0].front is None
    prompt = torch.cat([ids, _ids(4, 2)], 1)
    assert model.generate(prompt, past_key_values=cache, max_new_tokens=3, min_new_tokens=3, num_beams=2, do_sample=False).shape == (1, 47)

    stream = compress_context_ids(model, _ids(150), method="keydiff", compression_ratio=0.5, mode="decode")
    fresh = CompressedCache(model, stream.options, stream_length=150)
    fresh.restore(stream.snapshot())
    fresh.save(tmp_path / "fresh.kvc")
    (here,) = answer_from_cache_ids(model, stream, [_ids(6, 3)], max_new_tokens=4, stop_at_eos=False)
    (loaded,) = answer_from_cache_ids(model, kvc.load_cache(tmp_path / "fresh.kvc", model), [_ids(6, 3)], max_new_tokens=4,
                                      stop_at_eos=False)
    assert loaded.token_ids == here.token_ids


def test_the_cache_protocol_on_a_model_with_sliding_window_layers():
    """What transformers' `Cache` offers, on Gemma 3 (a sliding-window layer ahead of the compressed one): a refused row
    change (a stream's rows) changes no layer (the sliding window's rows were reordered or repeated first, and the
    answer after it silently changed); rows repeat as transformers' layers repeat theirs; `reset` empties a cache as a
    fresh one is (its dtype and the window's peak bytes were kept); `crop` of an empty cache changes nothing (it was
    refused, and refused every forward after); early initialisation and a layer's offload are refused by name (an
    internal AttributeError, or a window left unusable)."""
    model, ids = tiny("gemma3"), torch.cat([_ids(70, 1), _ids(70, 2)])
    fresh = lambda **settings: CompressedCache(model, "knorm", compression_ratio=0.0, **settings)  # noqa: E731
    with torch.no_grad():
        for settings in (dict(mode="decode", stream_length=200), dict(mode="chunked", stream_length=200)):
            cache = fresh(**settings)
            if settings["mode"] == "chunked":
                model(ids[:, :40], past_key_values=cache)  # the prompt still streams
            else:
                model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
            window = cache.layers[0].keys.clone()
            for change, argument in (("reorder_cache", torch.tensor([1, 0])), ("batch_select_indices", [1]), ("batch_repeat_interleave", 2)):
                with pytest.raises(ValueError, match="beam search reorders the cache rows: supported in mode='prefill'"):
                    getattr(cache, change)(argument)
                assert torch.equal(cache.layers[0].keys, window), (settings, change)
        cache = fresh()
        prompt = model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False)
        cache.batch_repeat_interleave(2)
        assert cache.layers[1].rows == 4 and cache.layers[0].keys.shape[0] == 4
        plain = model.generate(prompt.repeat_interleave(2, 0), max_new_tokens=3, do_sample=False)
        assert torch.equal(model.generate(prompt.repeat_interleave(2, 0), past_key_values=cache, max_new_tokens=3, do_sample=False), plain)
        peak = fresh()
        model.generate(ids[:1], past_key_values=peak, max_new_tokens=2, do_sample=False)
        cache.reset()
        assert not cache.is_initialized and cache.peak_bytes() == 0 and cache.nbytes() == 0
        cache.crop(-3)  # nothing held: nothing to remove
        model.generate(ids[:1], past_key_values=cache, max_new_tokens=2, do_sample=False)
        assert cache.peak_bytes() == peak.peak_bytes() and cache.slots_per_layer() == peak.slots_per_layer()
        cache.reset()
        model.to(torch.bfloat16)  # an empty cache takes the model as it is now
        assert model.generate(ids[:1], past_key_values=cache, max_new_tokens=2, do_sample=False).shape == (1, 72)
    with pytest.raises(NotImplementedError, match=r"cannot be initialised in advance \(early_initialization"):
        cache.early_initialization(1, 1, 16, torch.float32, "cpu")
    for move in ("offload", "prefetch"):
        with pytest.raises(NotImplementedError, match="does not offload or prefetch"):
            getattr(cache.layers[1], move)()


def _longrope_phi3():
    """A tiny Phi-3 with LongRoPE (Phi-3-mini-128k's rotation): short factors for forwards within 64 positions, long
    factors beyond; weights large enough that the two rotations give other tokens."""
    torch.manual_seed(0)
    config = Phi3Config(**SMALL | {"max_position_embeddings": 256, "initializer_range": 0.2}, original_max_position_embeddings=64,
                        rope_parameters=dict(rope_type="longrope", rope_theta=1e4, original_max_position_embeddings=64,
                                             short_factor=[1.0] * 8, long_factor=[2.0 + i for i in range(8)]))
    return Phi3ForCausalLM(config).eval()


def test_a_longrope_prompt_is_fed_as_model_generate_rotates_it_or_refused():
    """LongRoPE (Phi-3-mini-128k, Phi-3.5) rotates a forward within original_max_position_embeddings with its short
    factors and a longer one with its long factors. A prompt past that length fed in blocks (chunked and decode modes),
    or its question after a context within it, had its first tokens rotated with the short factors, where
    model.generate's one forward uses the long ones: at ratio 0 every method and the full cache gave other tokens than
    model.generate, without a word. Such feeding is refused before any work, naming what to do; what it names, and a
    prompt within the length, give model.generate's tokens. A method that un-rotates a stream's keys (Compactor) is
    refused a stream that may reach past the length (it un-rotated short-factor keys with the long factors)."""
    model, ids = _longrope_phi3(), _ids(160, 1)
    plain = lambda prompt: _greedy(model, prompt, new=6)[0].tolist()  # noqa: E731
    run = dict(max_new_tokens=6, stop_at_eos=False)
    context, question = ids[:, :150], ids[:, 150:]
    for method, settings in ((None, {}), ("snapkv", dict(compression_ratio=0.0))):
        for mode in ("chunked", "decode"):
            with pytest.raises(ValueError, match=r"LongRoPE .* a prompt of 160 tokens fed in blocks of chunk_size=32 \(mode='" + mode +
                               r"'\) would have its first 32 rotated .* a chunk_size above 64, or a prompt within 64 tokens$"):
                generate_ids(model, context, question, method=method, mode=mode, chunk_size=32, **settings, **run)
            assert generate_ids(model, context, question, method=method, mode=mode, chunk_size=80, **settings, **run).token_ids == plain(ids)
            assert generate_ids(model, ids[:, :40], ids[:, 40:50], method=method, mode=mode, chunk_size=16, **settings,
                                **run).token_ids == plain(ids[:, :50])
        with pytest.raises(ValueError, match=r"fed as the context's forward and then the question's .* \(compress_question=True\)"):
            generate_ids(model, ids[:, :60], ids[:, 60:70], method=method, **settings, **run)
        if method is not None:
            assert generate_ids(model, ids[:, :60], ids[:, 60:70], method=method, compress_question=True, **settings,
                                **run).token_ids == plain(ids[:, :70])
        assert generate_ids(model, context, question, method=method, **settings, **run).token_ids == plain(ids)
    with pytest.raises(ValueError, match="a prompt of 70 tokens fed as the context's forward and then the question's"):
        answer_questions_ids(model, ids[:, :60], [ids[:, 60:62], ids[:, 60:70]], method="snapkv", compression_ratio=0.0, **run)
    for stream_length in (None, 65):
        with pytest.raises(ValueError, match=r"method 'compactor' in mode='chunked' un-rotates the keys its streams hold, .* this "
                                             r"model's RoPE \('longrope'\) .* switching past 64 positions"):
            CompressedCache(model, CompressionOptions(method="compactor", mode="chunked", budget=16), stream_length=stream_length)
    options = CompressionOptions(method="compactor", mode="chunked", budget=16)
    CompressedCache(model, options, stream_length=64)
    CompressedCache(model, CompressionOptions(method="compactor", budget=16))  # one forward rotates and un-rotates alike
    # a method that un-rotates a stream's keys is not advised a larger chunk_size (the cache refuses it whatever the blocks)
    with pytest.raises(ValueError, match=r"would have its first 32 rotated .* use mode='prefill' with compress_question=True or a prompt within 64 tokens$"):
        generate_ids(model, context, question, method="compactor", mode="chunked", chunk_size=32, compression_ratio=0.5, **run)


def test_a_compressed_answer_phi3_would_recompute_uncompressed_is_refused():
    """transformers' Phi-3 drops the cache `model.generate` decodes from when the sequence first passes
    original_max_position_embeddings, to recompute it with its long RoPE factors: a compressed answer crossing that
    length went on from an uncompressed cache while its result reported the compressed bytes, and a compressed cache
    given to `model.generate` with a longer prompt was never used. `kvc.generate` refuses an answer that would cross it
    (naming the max_new_tokens that fits), the full cache (transformers' own) is not refused, and a cache built by name
    for such a model warns."""
    model, ids = _longrope_phi3(), _ids(160, 1)
    run = dict(compression_ratio=0.5, sink=2, window=4, stop_at_eos=False)
    with pytest.raises(ValueError, match=r"drops the cache it decodes from when the sequence first passes original_max_position_embeddings=64 "
                                         r"tokens.* a prompt of 60 tokens .* lower max_new_tokens to 5 or fewer, or give a prompt of more than 64 tokens$"):
        generate_ids(model, ids[:, :50], ids[:, 50:60], method="snapkv", max_new_tokens=20, **run)
    with pytest.raises(ValueError, match="a prompt of 64 tokens .* lower max_new_tokens to 1 or fewer"):
        answer_questions_ids(model, ids[:, :50], [ids[:, 50:52], ids[:, 50:64]], method="snapkv", max_new_tokens=2, **run)
    assert len(generate_ids(model, ids[:, :50], ids[:, 50:60], method="snapkv", max_new_tokens=5, **run).token_ids) == 5
    assert len(generate_ids(model, ids[:, :50], ids[:, 50:60], method=None, max_new_tokens=20, stop_at_eos=False).token_ids) == 20
    assert len(generate_ids(model, ids[:, :140], ids[:, 140:150], method="snapkv", max_new_tokens=20, **run).token_ids) == 20
    with pytest.warns(UserWarning, match="drops the cache it is given when the sequence first passes original_max_position_embeddings=64"):
        CompressedCache(model, "snapkv", compression_ratio=0.5)
