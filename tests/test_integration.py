"""The transformers integration on tiny randomly initialised models (Llama, Qwen2, Qwen3, Mistral)."""

import pytest
import torch
from transformers import (
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import kvcompress as kvc
from kvcompress.cache import CompressedCache
from kvcompress.model_support import RotaryInverse
from kvcompress.options import CompressionOptions, block_settings
from kvcompress.decoding import answer_end
from kvcompress.integration import generate_ids, use_compressed_attention
from kvcompress.methods.budget import DEFAULT_SLACK, stream_split

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}


def tiny(arch="llama", seed=0):
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    return model_cls(config_cls(**SMALL, **extra)).eval()


def blocks(mode: str, size: int = 32) -> dict:
    """The tests' prompt blocks of `size` tokens in a streaming mode (`options.block_settings`)."""
    return block_settings(mode, size)


def _prompt(n=150, m=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (1, n), generator=g), torch.randint(0, 96, (1, m), generator=g)


def _words(n: int) -> str:
    """A text of n tokens of the word tokenizer (`test_hf._word_tokenizer`): w0, w1, ..., cycling over 90 words."""
    return " ".join(f"w{i % 90}" for i in range(n))


def _reference(model, ctx, question, new=12):
    out = model.generate(torch.cat([ctx, question], 1), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[0, ctx.shape[1] + question.shape[1] :].tolist()


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("mode", ["prefill", "chunked", "decode"])
def test_no_compression_reproduces_plain_generate(arch, mode):
    model = tiny(arch)
    ctx, question = _prompt()
    ref = _reference(model, ctx, question)
    for method in ["snapkv", "knorm"]:
        size = {"compression_ratio": 0.0} if mode == "prefill" else {"budget": 10_000}
        res = generate_ids(model, ctx, question, method=method, mode=mode, max_new_tokens=12, stop_at_eos=False, **blocks(mode), **size)
        assert res.token_ids == ref, (arch, mode, method)


@pytest.mark.parametrize("method", [None, "knorm"])
def test_prefill_computes_the_last_positions_logits_only(method, monkeypatch):
    """As model.generate does (logits_to_keep=1), and less: a 150-token context's forward, whose logits the question's
    forward makes unneeded, gives none ([B, 0, V], not [B, 150, V]), every later forward [B, 1, V], and the answer is
    plain generate's."""
    model = tiny()
    ctx, question = _prompt()
    ref = _reference(model, ctx, question)
    shapes = []
    forward = model.forward

    def recording(*args, logits_to_keep=0, **kwargs):
        out = forward(*args, logits_to_keep=logits_to_keep, **kwargs)
        shapes.append(tuple(out.logits.shape))
        return out

    monkeypatch.setattr(model, "forward", recording)
    options = {"compression_ratio": 0.0} if method else {}
    res = generate_ids(model, ctx, question, method=method, max_new_tokens=12, stop_at_eos=False, **options)
    assert res.token_ids == ref
    assert shapes[0][1] == 0 and len(shapes) > 1 and all(shape[1] == 1 for shape in shapes[1:]), shapes


def test_budget_at_least_context_reproduces_in_prefill():
    model = tiny()
    ctx, question = _prompt()
    res = generate_ids(model, ctx, question, method="h2o", budget=ctx.shape[1], max_new_tokens=12, stop_at_eos=False)
    assert res.token_ids == _reference(model, ctx, question)


def test_model_generate_with_compressed_cache():
    model = tiny("qwen2")
    ctx, question = _prompt()
    ids = torch.cat([ctx, question], 1)
    ref = _reference(model, ctx, question)
    cache = CompressedCache(model, CompressionOptions(method="tova", mode="prefill", compression_ratio=0.0))
    with use_compressed_attention(model):
        out = model.generate(ids, past_key_values=cache, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert out[0, ids.shape[1] :].tolist() == ref
    assert cache.get_seq_length() == ids.shape[1] + 11


def test_compressed_layers_really_shrink():
    model = tiny()
    ctx, question = _prompt(n=400)
    full = generate_ids(model, ctx, question, method="snapkv", compression_ratio=0.0, max_new_tokens=4, stop_at_eos=False)
    half = generate_ids(model, ctx, question, method="snapkv", compression_ratio=0.5, max_new_tokens=4, stop_at_eos=False)
    assert half.kv_bytes < 0.6 * full.kv_bytes
    # 200 context tokens kept + 8 question + 3 decoded, per layer
    assert half.slots_per_layer == [200 + 8 + 3] * 2
    # KV bytes are the keys and values (fp32, 2 heads) allocated: the slots held plus the room the
    # first decoded token reserved for the next ones, max(16, n/16) slots
    per_slot = 2 * 2 * 16 * 4
    assert sum(half.slots_per_layer) * per_slot <= half.kv_bytes <= sum(s + 16 for s in half.slots_per_layer) * per_slot


@pytest.mark.parametrize("question_kept_out", [True, False])
def test_the_language_model_head_runs_once_per_answer_token_and_never_for_a_context_block_before_the_last(question_kept_out):
    model = tiny()
    ctx, question = _prompt(n=150)
    rows = []
    hook = model.lm_head.register_forward_hook(lambda module, inputs, output: rows.append(inputs[0].shape[1]))
    try:
        res = generate_ids(model, ctx, question, method="knorm", budget=10_000, mode="chunked", chunk_size=32, max_new_tokens=5,
                           stop_at_eos=False, compress_question=not question_kept_out)
    finally:
        hook.remove()
    # 150 context tokens in 5 blocks (and the question absorbed as a 6th): one position for the first answer token, from
    # the question's forward or the absorbed question's block, then one per later answer token; the others keep none
    assert [r for r in rows if r] == [1] * 5
    assert res.token_ids == _reference(model, ctx, question, new=5)


def test_chunked_peak_memory_is_budget_plus_block():
    model = tiny()
    small, _ = _prompt(n=300)
    big, _ = _prompt(n=1200)
    peaks = []
    for ctx in (small, big):
        res = generate_ids(model, ctx, None, method="knorm", budget=64, sink=4, window=16, mode="chunked", chunk_size=32, max_new_tokens=2, stop_at_eos=False)
        peaks.append(res.peak_kv_bytes)
        assert max(res.slots_per_layer) <= 4 + 64 + 16 + 1
    assert peaks[0] == peaks[1]


def test_question_is_kept_out_of_compression_by_default():
    model = tiny()
    ctx, question = _prompt(n=200, m=20)
    res = generate_ids(model, ctx, question, method="streamingllm", budget=10, sink=2, window=4, max_new_tokens=1, stop_at_eos=False)
    assert res.slots_per_layer == [2 + 10 + 4 + 20] * 2
    res = generate_ids(model, ctx, question, method="streamingllm", budget=10, sink=2, window=4, max_new_tokens=1, stop_at_eos=False, compress_question=True)
    assert res.slots_per_layer == [2 + 10 + 4] * 2


def test_decode_mode_stays_bounded_while_generating():
    model = tiny()
    ctx, question = _prompt(n=100)
    res = generate_ids(model, ctx, question, method="knorm", budget=20, sink=2, window=8, mode="decode", max_new_tokens=60, stop_at_eos=False)
    # sink + middle + window: the middle never passes the budget (its re-compression slack comes out of it) and, past the
    # budget, never holds fewer than the target it re-compresses back to (`stream_split`)
    target, _ = stream_split(20, DEFAULT_SLACK)
    assert all(2 + target + 8 <= slots <= 2 + 20 + 8 for slots in res.slots_per_layer)


def test_rope_positions_keep_counting_original_tokens():
    model = tiny()
    ctx, question = _prompt(n=300)
    cache = CompressedCache(model, CompressionOptions(method="knorm", mode="prefill", budget=20, sink=2, window=4))
    with use_compressed_attention(model), torch.no_grad():
        model(ctx, past_key_values=cache)
        assert cache.layers[0].slots() == 26 and cache.get_seq_length() == 300
        model(question, past_key_values=cache)
    assert cache.layers[0].stored().positions[0, 0, -8:].tolist() == list(range(300, 308))


def test_pre_rope_keys_are_recovered():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny()
    unrotate = RotaryInverse(model)
    k = torch.randn(1, 2, 10, 16)
    pos = torch.arange(5, 15)
    cos, sin = model.model.rotary_emb(k, pos[None])
    _, rotated = apply_rotary_pos_emb(k, k, cos, sin)
    torch.testing.assert_close(unrotate(rotated, pos), k, atol=1e-5, rtol=1e-5)


def test_pre_rope_keys_for_a_batch_several_positions_and_bfloat16():
    """One inverse over calls that repeat the last call's positions (its angles reused) and change them."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny()
    unrotate = RotaryInverse(model)
    for start, dtype in [(5, torch.float32), (5, torch.float32), (7, torch.float32), (5, torch.bfloat16), (5, torch.float32)]:
        k = torch.randn(2, 2, 10, 16)
        pos = torch.arange(start, start + 10)
        cos, sin = model.model.rotary_emb(k, pos[None].expand(2, -1))
        _, rotated = apply_rotary_pos_emb(k, k, cos, sin)
        got = unrotate(rotated.to(dtype), pos)
        assert got.dtype == dtype and got.shape == k.shape
        torch.testing.assert_close(got.float(), k, atol=0.1 if dtype == torch.bfloat16 else 1e-5, rtol=0.02 if dtype == torch.bfloat16 else 1e-5)


def test_errors():
    model = tiny()
    ctx, question = _prompt()
    with pytest.raises(ValueError, match="empty context"):
        generate_ids(model, ctx[:, :0], question, method="knorm", budget=4)
    with pytest.raises(ValueError, match="mode must be one of"):
        generate_ids(model, ctx, question, method="knorm", budget=4, mode="fast")
    with pytest.raises(ValueError, match=r"compression_ratio must be in \[0, 1\)"):
        generate_ids(model, ctx, question, method="knorm", compression_ratio=1.5)
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        generate_ids(model, ctx, question, method="nope", budget=4)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).eval()
    with pytest.raises(ValueError, match="unsupported model type 'gpt2'"):
        generate_ids(gpt2, ctx % 50, None, method="knorm", budget=4)
    with pytest.raises(ValueError, match="mode='prefill' only"):
        with use_compressed_attention(model), torch.no_grad():
            cache = CompressedCache(model, CompressionOptions(method="knorm", mode="chunked", budget=4))
            padded = torch.cat([torch.zeros_like(ctx[:, :5]), torch.ones_like(ctx[:, 5:])], 1)
            model(torch.cat([ctx, ctx]), attention_mask=torch.cat([padded, torch.ones_like(ctx)]), past_key_values=cache)


def test_recorded_prefill_serves_many_methods_like_a_fresh_prefill():
    from kvcompress.eval.capture import capture_qkv

    model = tiny()
    ctx, question = _prompt(n=200)
    captured = capture_qkv(model, ctx)
    for method in ["snapkv", "knorm"]:
        fresh = generate_ids(model, ctx, question, method=method, compression_ratio=0.5, max_new_tokens=6, stop_at_eos=False)
        reused = generate_ids(model, ctx, question, method=method, compression_ratio=0.5, max_new_tokens=6, stop_at_eos=False, prefill=captured)
        assert reused.token_ids == fresh.token_ids and reused.slots_per_layer == fresh.slots_per_layer
    with pytest.raises(ValueError, match="recorded prefill"):
        generate_ids(model, ctx, question, method="knorm", budget=8, mode="chunked", prefill=captured)


def test_context_calibrated_ratio_is_chosen_and_reported(tmp_path):
    from kvcompress.calibration import Calibration

    model = tiny()
    ctx, question = _prompt(n=300)
    path = tmp_path / "fit.json"
    Calibration("knorm", alpha=0.0, beta=-3.0).save(path)  # kappa = -3: keep r* = ln(1 + 0.95(e^-3 - 1)) / -3
    res = generate_ids(model, ctx, question, method="knorm", quality=0.95, calibration=path, max_new_tokens=2, stop_at_eos=False, sink=0, window=0)
    chosen = res.extra["calibration"]
    assert chosen["retention"] == pytest.approx(0.776, abs=1e-3)
    assert res.slots_per_layer[0] == round(chosen["retention"] * 300 + 0.5) + 8 + 1
    with pytest.raises(ValueError, match="quality and calibration together"):
        generate_ids(model, ctx, question, method="knorm", quality=0.95, calibration=path, budget=10)


@pytest.mark.parametrize("method", [None, "knorm", "kvzip"])
def test_answer_log_probs_feed_the_answer_through_the_cache_generate_builds(method):
    """Teacher forcing the answer generate_ids gave through the same cache: each row's argmax is that answer's token;
    the full cache's rows are a plain forward's."""
    from kvcompress.integration import answer_log_probs_ids

    model = tiny()
    ctx, question = _prompt(n=120)
    settings = {} if method is None else {"budget": 30, "sink": 2, "window": 4}
    res = generate_ids(model, ctx, question, method=method, max_new_tokens=6, stop_at_eos=False, **settings)
    answer = torch.tensor([res.token_ids])
    log_probs = answer_log_probs_ids(model, ctx, question, answer, method=method, **settings)
    assert log_probs.shape == (6, model.config.vocab_size) and log_probs.dtype == torch.float32
    assert log_probs.argmax(-1).tolist() == res.token_ids
    if method is None:
        with torch.no_grad():
            plain = model(torch.cat([ctx, question, answer[:, :-1]], 1)).logits[0, -6:].float().log_softmax(-1)
        torch.testing.assert_close(log_probs, plain, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"answer_ids must be an integer tensor \[1, m\] with m >= 1"):
        answer_log_probs_ids(model, ctx, question, answer[:, :0], method=method, **settings)
    with pytest.raises(ValueError, match="compress_question=True"):
        answer_log_probs_ids(model, ctx, question, answer, method="knorm", budget=30, compress_question=True)


@pytest.mark.parametrize("method", ["keydiff", "express"])
def test_answer_log_probs_in_decode_mode_follow_the_streams_token_by_token(method):
    """In decode mode every answer token passes through the streams, which re-compress between tokens: the answer fed
    in one forward gave other rows than the answer generate_ids decoded a token at a time."""
    from kvcompress.integration import answer_log_probs_ids

    model = tiny()
    ctx, question = _prompt(n=120)
    settings = {"method": method, "budget": 12, "sink": 2, "window": 4, "mode": "decode", "chunk_size": 16}
    res = generate_ids(model, ctx, question, max_new_tokens=16, stop_at_eos=False, **settings)
    log_probs = answer_log_probs_ids(model, ctx, question, torch.tensor([res.token_ids]), **settings)
    assert log_probs.argmax(-1).tolist() == res.token_ids



def test_an_answer_ends_at_eos_or_at_a_stop_token_after_another_token():
    """`answer_end`: EOS ends an answer wherever it comes; a stop token only once another token came before it, so
    leading ones (a newline before a one-line answer, as LongBench decodes them) do not end it."""
    assert answer_end([7, 5, 7, 9], {9}, {7}) == 3 and answer_end([7, 7], set(), {7}) is None
    assert answer_end([9, 5], {9}, {7}) == 1 and answer_end([5, 8], {9}, {7}) is None and answer_end([], {9}, {7}) is None


@pytest.mark.parametrize("method", [None, "knorm"])
def test_a_stop_token_ends_the_answer_once_another_token_came_before_it(method):
    """generate_ids decodes as `answer_end` trims a free greedy answer (a stop id past the vocabulary is never met)."""
    model = tiny()
    ctx, question = _prompt()
    size = {} if method is None else {"budget": 64}
    plain = generate_ids(model, ctx, question, method=method, max_new_tokens=10, stop_at_eos=False, **size).token_ids
    for stops in ({plain[0]}, {plain[0], plain[2]}, {plain[1]}, {10**6}):
        got = generate_ids(model, ctx, question, method=method, max_new_tokens=10, stop_at_eos=False, stop_token_ids=stops, **size)
        assert got.token_ids == plain[: answer_end(plain, set(), stops) or len(plain)], stops
    leading = generate_ids(model, ctx, question, method=method, max_new_tokens=10, stop_at_eos=False, stop_token_ids={plain[0]}, **size)
    assert len(leading.token_ids) > 1  # the old rule ended it at its first token


def test_attention_dropout_applies_on_the_exact_path_and_is_refused_over_a_compressed_layer():
    """A model in training mode whose config sets attention dropout: through the 'kvcompress' attention without a
    compressed cache, the dropout is SDPA's (the same draws give the same logits); over a compressed layer, which has
    none, the forward is refused by name rather than run without it."""
    config_cls, model_cls, extra = ARCHS["llama"]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SMALL, **extra, attention_dropout=0.5)).train()
    ids = _prompt(n=40)[0]
    logits = []
    for implementation in ("sdpa", "kvcompress"):
        model.set_attn_implementation(implementation)
        torch.manual_seed(1)
        logits.append(model(ids).logits)
    torch.testing.assert_close(logits[1], logits[0])
    torch.manual_seed(2)
    assert not torch.allclose(model(ids).logits, logits[1])  # dropout drew again: it acts
    cache = CompressedCache(model, "snapkv", budget=16)
    with pytest.raises(ValueError, match=r"attention dropout=0.5 .*call model.eval\(\)"):
        model(ids, past_key_values=cache)
    model.eval()
    assert model(ids, past_key_values=CompressedCache(model, "snapkv", budget=16)).logits.isfinite().all()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_compressed_cache_under_use_cache_false_is_refused_by_name(arch):
    """`model.generate(..., past_key_values=cache, use_cache=False)` (or the setting on the model's configs): transformers
    fed the whole sequence again at every step and the cache stored it again each time, compressing nothing (SmolLM2:
    1,462 slots a layer after 6 tokens of a 273-token prompt, 5.6 times the full cache's bytes, the full cache's answer)
    without a word. It is refused naming use_cache; with it on, the same cache runs."""
    model = tiny(arch)
    ids = torch.cat(_prompt(n=120), 1)
    for setting in ({"use_cache": False}, {"generation_config": GenerationConfig(use_cache=False)}):
        with pytest.raises(ValueError, match=r"^a CompressedCache was given to a forward with use_cache=False: .*use_cache=True"):
            model.generate(ids, past_key_values=CompressedCache(model, "snapkv", budget=16), max_new_tokens=3, do_sample=False,
                           **setting)
    out = model.generate(ids, past_key_values=CompressedCache(model, "snapkv", budget=16), max_new_tokens=3, min_new_tokens=3,
                         do_sample=False)
    assert out.shape == (1, ids.shape[1] + 3)


@pytest.mark.parametrize("mode", ["prefill", "chunked"])
@pytest.mark.parametrize("method", sorted(set(kvc.methods()) - {"kvzip", "kvzap"}))  # KVzip: a reconstruction; KVzap: a scorer
def test_a_forward_with_gradients_on_runs_through_a_compressed_cache(method, mode):
    """A plain `model(...)` outside torch.no_grad: compression runs without gradients and the attention with them, so
    the logits are the ones a no-grad forward gives and can be differentiated, including for methods whose tensor code
    writes into preallocated outputs (out= products) and H2O's prefill attention, which computes the attention mass as
    it attends. What the cache stores never holds the graph (a block appended in place, a tail joined with the block), so
    a later forward with gradients on runs its own backward."""
    model = tiny()
    ids = _prompt(n=104)[0]
    logits = []
    for grad in (False, True):
        cache = CompressedCache(model, method, budget=16, mode=mode, **({} if mode == "prefill" else {"stream_length": 104}))
        with torch.set_grad_enabled(grad):
            model(ids[:, :64], past_key_values=cache)
            logits.append(model(ids[:, 64:96], past_key_values=cache).logits)
    assert logits[1].requires_grad and not logits[0].requires_grad
    torch.testing.assert_close(logits[1].detach(), logits[0], rtol=1e-4, atol=1e-5)
    logits[1].sum().backward()
    assert next(model.parameters()).grad is not None
    stored = [t for layer in cache.layers for part in layer._stored_parts() for t in (part.keys, part.values)]
    assert stored and not any(t.requires_grad for t in stored)
    model(ids[:, 96:], past_key_values=cache).logits.sum().backward()  # the next block's own graph


def test_the_full_cache_by_its_name_full_is_method_none():
    """"full", the full cache's name on the command line (`--method full`) and in an evaluation's records, is taken by the
    library too, as method=None: it was refused there as an unknown method. Settings it cannot take are refused naming it;
    a CompressedCache and compress_context, which compress, refuse it as they refuse None."""
    from test_hf import _word_tokenizer

    model, tokenizer = tiny("llama"), _word_tokenizer()
    context = _words(200)
    answers = [kvc.generate(model, tokenizer, context, "w1 w2", method=method, max_new_tokens=4, progress=False, stop_at_eos=False)
               for method in (None, "full")]
    assert answers[0].token_ids == answers[1].token_ids and answers[1].report().startswith("method            full (")
    assert all(CompressionOptions.build(method="full", mode=mode).method is None for mode in ("prefill", "chunked", "decode"))
    with pytest.raises(ValueError, match="method='full' is the full cache: it takes no compression_ratio"):
        CompressionOptions.build(method="full", compression_ratio=0.5)
    with pytest.raises(ValueError, match="method='full': a CompressedCache compresses"):
        CompressedCache(model, "full")
    with pytest.raises(ValueError, match=r"it takes a method .* got the full cache \(method=None or 'full'\)"):
        kvc.compress_context(model, tokenizer, context, method="full")
    from kvcompress.integration.prefill import SharedPrefill

    shared = SharedPrefill(model, tokenizer(context, return_tensors="pt").input_ids)
    assert [shared.cache(method).get_seq_length() for method in (None, "full")] == [shared.n] * 2
    with pytest.raises(ValueError, match=r"unknown method 'ful'; choose None or 'full' \(the full cache\)"):
        CompressionOptions.build(method="ful")


def test_model_generates_decoding_settings_are_refused_naming_model_generate():
    """kvc.generate and the pipeline decode greedily: do_sample, temperature, num_beams or a streamer (model.generate's) were
    refused as unknown settings and method parameters; they are refused naming model.generate with a CompressedCache,
    which takes them, before any forward."""
    from transformers import pipeline

    from kvcompress.integration import PIPELINE_TASK
    from test_hf import _word_tokenizer

    model, tokenizer = tiny("qwen2"), _word_tokenizer()
    context = _words(200)
    pipe = pipeline(PIPELINE_TASK, model=model, tokenizer=tokenizer)
    for settings, named in ((dict(temperature=0.7), "temperature is one of"), (dict(do_sample=True, top_p=0.9), "do_sample, top_p are"),
                            (dict(num_beams=2), "num_beams is one of"), (dict(streamer=object()), "streamer is one of"),
                            (dict(generate_kwargs={"do_sample": True}), "generate_kwargs is one of")):
        expected = rf"^{named} model\.generate's decoding settings: kvcompress answers greedily.* pass a kvc\.CompressedCache to model\.generate as past_key_values$"
        with pytest.raises(ValueError, match=expected):
            kvc.generate(model, tokenizer, context, "w1", method="snapkv", compression_ratio=0.5, progress=False, **settings)
        with pytest.raises(ValueError, match=expected):
            pipe(context, questions=["w1"], method="snapkv", compression_ratio=0.5, **settings)
    with pytest.raises(ValueError, match=r"^temperature is one of .*past_key_values; anchor is not an option or a parameter of the method either$"):
        kvc.generate(model, tokenizer, context, "w1", method="snapkv", compression_ratio=0.5, temperature=0.7, anchor="mean")


def _ids_of(n: int) -> torch.Tensor:
    """[1, n] token ids of a tiny model's vocabulary."""
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(0))


def test_a_cache_built_with_a_decoding_setting_names_the_generate_call_it_belongs_to():
    """CompressedCache(model, method, temperature=...) is a sampling setting given to the cache: the refusal names
    model.generate, where it goes, as kvc.generate's does (it was the generic unknown-setting message); an unknown
    name beside it is named too, and a name that is neither keeps the unknown-setting message."""
    model = tiny("llama")
    with pytest.raises(ValueError, match=r"^CompressedCache\(\.\.\., temperature=0\.7\): it is one of model\.generate's decoding "
                                         r"settings, not the cache's: .*model\.generate\(\.\.\., past_key_values=cache, temperature=\.\.\.\)$"):
        kvc.CompressedCache(model, "snapkv", compression_ratio=0.5, temperature=0.7)
    options = kvc.CompressionOptions(method="keydiff", compression_ratio=0.5)
    with pytest.raises(ValueError, match=r"do_sample=True, top_k=5\): they are .*do_sample=\.\.\., top_k=\.\.\.\); "
                                         r"anchor2 is not an option or a parameter of the method either$"):
        kvc.CompressedCache(model, "keydiff", compression_ratio=0.5, do_sample=True, top_k=5, anchor2=1)
    with pytest.raises(ValueError, match="unknown setting"):
        kvc.CompressedCache(model, "keydiff", compression_ratio=0.5, anchor2=1)
    # a name inside method_params was meant for the method: the method's refusal, not the decoding message (a KeyError)
    for build in (lambda: kvc.CompressedCache(model, "snapkv", compression_ratio=0.5, method_params={"temperature": 0.7}),
                  lambda: generate_ids(model, _ids_of(40), None, method="snapkv", compression_ratio=0.5, method_params={"top_k": 5})):
        with pytest.raises(ValueError, match=r"method 'snapkv' has no parameter\(s\) \['(temperature|top_k)'\]"):
            build()
    assert kvc.CompressedCache(model, options).options.method == "keydiff"


def test_a_compressed_cache_shows_what_it_holds():
    """repr(cache) names the method, mode and storage, the tokens seen, the slots per KV head kept and the bytes stored
    (transformers' repr listed `CompressedLayer` once per layer), before and after compression, in every mode."""
    from test_hf import _word_tokenizer

    model, tokenizer = tiny("llama"), _word_tokenizer()
    context = _words(200)
    assert repr(CompressedCache(model, "snapkv", compression_ratio=0.5)) == (
        "CompressedCache(method='snapkv', mode='prefill', tokens=0, slots=0..0 per KV head, stored_bytes=0)")
    assert "kv_bits=auto, tokens=0" in repr(CompressedCache(model, "knorm", compression_ratio=0.5, kv_bits="auto", budget_unit="memory"))
    for mode in ("prefill", "chunked", "decode"):
        cache = kvc.compress_context(model, tokenizer, context, method="keydiff", budget=16, mode=mode, kv_bits=4)
        slots = cache.slots_per_layer()
        assert repr(cache) == (f"CompressedCache(method='keydiff', mode='{mode}', kv_bits=4, tokens={cache.get_seq_length()}, "
                               f"slots={min(slots)}..{max(slots)} per KV head, stored_bytes={cache.nbytes()})")
        assert cache.get_seq_length() == cache.token_ids.shape[1] and 0 < cache.nbytes()
    auto = kvc.compress_context(model, tokenizer, context, method="knorm", compression_ratio=0.5, kv_bits="auto", budget_unit="memory")
    assert auto.kv_bits == 8 and ", kv_bits=8, " in repr(auto)  # what "auto" resolved to, as stored


def test_each_of_several_questions_reports_its_own_costs():
    """Several questions of one compressed context (`answer_questions_ids`, a snapshot restored after each): a question's
    peak bytes and compression seconds were those of every question before it too (the snapshot put back the layers'
    contents, not their costs); each now reports what it reports asked alone."""
    from test_hf import _word_tokenizer

    model, tokenizer = tiny("llama"), _word_tokenizer()
    context = _words(200)
    long, short = _words(300), "w3"  # the long one stores more than the context's prefill
    settings = dict(method="snapkv", budget=16, window=8, max_new_tokens=3, progress=False, stop_at_eos=False)
    for mode in ("prefill", "decode"):
        both = kvc.generate(model, tokenizer, context, questions=[long, short], mode=mode, **settings)
        alone = kvc.generate(model, tokenizer, context, short, mode=mode, **settings)
        assert both[1].token_ids == alone.token_ids and both[1].peak_kv_bytes == alone.peak_kv_bytes < both[0].peak_kv_bytes, mode
