"""H2O's attention mass taken from the model's own prefill attention (issue 17): the fused kernel
`integration.attention.causal_attention_with_mass` and its use through `generate`."""

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import kvcompress.integration.attention as kv_attention
from kvcompress.cache import CompressedCache
from kvcompress.options import CompressionOptions
from kvcompress.integration import generate_ids, use_compressed_attention
from kvcompress.integration.attention import causal_attention_with_mass
from kvcompress.methods.base import compress_tokens
from kvcompress.methods.tokens import attention_mass, Tokens
from kvcompress.methods.h2o import H2O
from kvcompress.methods.requirements import Requirements


def qkv(n_q, n, hq=6, hkv=2, d=16, dv=8, key_scale=1.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, n_q, d, generator=g)
    k = torch.randn(2, hkv, n, d, generator=g) * key_scale
    v = torch.randn(2, hkv, n, dv, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("n_q, n, key_scale", [(70, 70, 1.0), (70, 70, 40.0), (25, 90, 1.0)])
def test_fused_mass_equals_attention_mass_and_output_equals_sdpa(n_q, n, key_scale):
    """Several query chunks, GQA, a causal tail (n > n_q) and logits far beyond exp's float32 range (max-shifted path)."""
    q, k, v = qkv(n_q, n, key_scale=key_scale)
    scale = 0.25
    out, mass = causal_attention_with_mass(q, k, v, scale, max_logits=1500)
    causal = torch.ones(n_q, n, dtype=torch.bool).tril(n - n_q)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scale, enable_gqa=True)
    assert out.shape == reference.shape and torch.allclose(out, reference, atol=1e-5)
    positions = torch.arange(n).expand(2, 2, n)
    expected = attention_mass(Tokens(k, v, positions, q, scale=scale, query_positions=torch.arange(n - n_q, n)))
    assert mass.dtype == torch.float32 and torch.allclose(mass, expected, atol=1e-5)
    assert torch.allclose(mass.sum(-1), torch.full((2, 2), float(n_q)), rtol=1e-5)  # every query hands out mass 1 per head


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_kernel_accumulates_in_float32_for_half_inputs(dtype):
    """Half-precision inputs with logits of several hundred: no overflow, the output in the input dtype,
    the mass equal to float32's on the same (rounded) inputs."""
    q, k, v = qkv(40, 40, key_scale=30.0, dtype=dtype)
    out, mass = causal_attention_with_mass(q, k, v, 1.0)
    out32, mass32 = causal_attention_with_mass(q.float(), k.float(), v.float(), 1.0)
    assert out.dtype == dtype and bool(torch.isfinite(out).all()) and bool(torch.isfinite(mass).all())
    assert torch.allclose(out.float(), out32, atol=2e-2) and torch.allclose(mass, mass32, atol=1e-4)


@pytest.mark.cuda
def test_fused_kernel_on_cuda_in_bfloat16_matches_the_cpu():
    q, k, v = qkv(300, 300, key_scale=4.0, dtype=torch.bfloat16)
    out, mass = causal_attention_with_mass(q.cuda(), k.cuda(), v.cuda(), 0.25)
    out_cpu, mass_cpu = causal_attention_with_mass(q, k, v, 0.25)
    assert out.device.type == "cuda" and out.dtype == torch.bfloat16 and mass.device.type == "cuda"
    assert torch.allclose(out.float().cpu(), out_cpu.float(), atol=2e-2) and torch.allclose(mass.cpu(), mass_cpu, atol=1e-3)


@pytest.fixture
def shifted_passes(monkeypatch):
    """Records the `shifted` flag of every chunk run of the fused kernel."""
    flags = []
    attend = kv_attention._attend_chunks

    def recording(*args):
        flags.append(args[-1])
        return attend(*args)

    monkeypatch.setattr(kv_attention, "_attend_chunks", recording)
    return flags


@pytest.mark.parametrize("key_scale, redone", [(1.0, False), (40.0, True)])
def test_the_unshifted_pass_stands_unless_an_exponential_overflows(shifted_passes, key_scale, redone):
    q, k, v = qkv(30, 30, key_scale=key_scale)
    causal_attention_with_mass(q, k, v, 0.25, workers=1)
    assert shifted_passes == [False, True] if redone else shifted_passes == [False]


def test_rows_whose_every_exponential_underflows_are_redone_shifted(shifted_passes):
    """Every logit near -300: unshifted, each row's total is 0; the shifted redo gives the exact softmax."""
    g = torch.Generator().manual_seed(3)
    q = torch.rand(1, 2, 20, 16, generator=g) + 1.0
    k = -(torch.rand(1, 1, 20, 16, generator=g) + 4.0)
    v = torch.randn(1, 1, 20, 8, generator=g)
    out, mass = causal_attention_with_mass(q, k, v, 2.0, workers=1)
    assert shifted_passes == [False, True]
    causal = torch.ones(20, 20, dtype=torch.bool).tril()
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=2.0, enable_gqa=True)
    expected = attention_mass(Tokens(k, v, torch.arange(20).expand(1, 1, 20), q, scale=2.0, query_positions=torch.arange(20)))
    assert torch.allclose(out, reference, atol=1e-5) and torch.allclose(mass, expected, atol=1e-5)


@pytest.mark.parametrize("key_scale", [1.0, 40.0])
def test_worker_threads_give_the_one_thread_result_and_leave_the_thread_count_alone(key_scale):
    """Chunks of 8 queries dealt to 3 worker threads, inside inference mode (per thread, so the workers must take
    it on to write the caller's inference tensors): the same output and mass as the same chunks on one thread,
    and torch's thread count, in this thread and for new ones, is what it was."""
    q, k, v = qkv(70, 90, key_scale=key_scale)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        out, mass = causal_attention_with_mass(q, k, v, 0.25, query_chunk=8, workers=1)
        out3, mass3 = causal_attention_with_mass(q, k, v, 0.25, query_chunk=8, workers=3)
    assert torch.allclose(out3, out, atol=1e-6) and torch.allclose(mass3, mass, atol=1e-5)
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(torch.get_num_threads).result() == threads
    assert torch.get_num_threads() == threads


def test_a_row_total_beyond_float32_is_caught_by_both_mass_kernels():
    """12000 keys each at logit 79.5: every exponential is finite (e^79.5 = 3.3e34), their sum (4e38) is
    not, so both kernels must max-shift. The query's mass is then 1/12000 on every key."""
    n, logit = 12000, 79.5
    keys = torch.full((1, 1, n, 1), logit**0.5)
    query = torch.full((1, 1, 1, 1), logit**0.5)
    values = torch.ones(1, 1, n, 1)
    _, fused = causal_attention_with_mass(query, keys, values, 1.0)
    pure = attention_mass(Tokens(keys, values, torch.arange(n).expand(1, 1, n), query, scale=1.0, query_positions=torch.tensor([n - 1])))
    for mass in (fused, pure):
        assert torch.allclose(mass, torch.full((1, 1, n), 1.0 / n), rtol=1e-4)


@pytest.mark.parametrize("workers", [0, -2, 1.5, True])
def test_workers_must_be_a_positive_integer(workers):
    q, k, v = qkv(8, 8)
    with pytest.raises(ValueError, match=r"workers must be an integer >= 1, got"):
        causal_attention_with_mass(q, k, v, 0.25, workers=workers)


def test_h2o_uses_a_given_mass_and_computes_it_without_one():
    q, k, v = qkv(50, 50)
    positions = torch.arange(50).expand(2, 2, 50)
    tokens = Tokens(k, v, positions, q, scale=0.25, query_positions=torch.arange(50))
    gen = torch.Generator()
    computed = compress_tokens(H2O(), tokens, 10, 4, 8, gen)
    given = torch.zeros(2, 2, 50)
    given[..., 20:30] = 1.0  # a mass that is not the attention's: the method must keep exactly these tokens
    kept = compress_tokens(H2O(), Tokens(k, v, positions, q, scale=0.25, attention_mass=given), 10, 4, 8, gen)
    middle = kept.positions[..., 4:14]
    assert torch.equal(middle, torch.arange(20, 30).expand(2, 2, 10))
    _, fused = causal_attention_with_mass(q, k, v, 0.25)
    with_fused = compress_tokens(H2O(), Tokens(k, v, positions, q, scale=0.25, attention_mass=fused), 10, 4, 8, gen)
    assert torch.equal(with_fused.positions, computed.positions)


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=96, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                         num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the prefill attention calls that go through the fused kernel."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return causal_attention_with_mass(*args, **kwargs)

    monkeypatch.setattr(kv_attention, "causal_attention_with_mass", counting)
    return calls


def kept_positions(model, ctx, method):
    cache = CompressedCache(model, CompressionOptions(method=method, mode="prefill", compression_ratio=0.6))
    with use_compressed_attention(model), torch.no_grad():
        model(ctx, past_key_values=cache, use_cache=True)
    return [layer.front.summary().positions for layer in cache.layers]


def test_h2o_keeps_the_same_tokens_with_the_prefill_mass_as_with_its_own(fused_calls, monkeypatch):
    model = tiny_llama()
    g = torch.Generator().manual_seed(1)
    ctx, question = torch.randint(0, 96, (1, 300), generator=g), torch.randint(0, 96, (1, 6), generator=g)
    fused = kept_positions(model, ctx, "h2o")
    assert len(fused_calls) == 2  # one fused prefill attention per layer, then nothing else
    res_fused = generate_ids(model, ctx, question, method="h2o", compression_ratio=0.6, max_new_tokens=8, stop_at_eos=False)
    assert len(fused_calls) == 4  # the question and the answer tokens attend through the ordinary path
    monkeypatch.setattr(H2O, "requirements", Requirements(inputs={"queries"}))  # H2O then computes the mass itself from the queries
    own = kept_positions(model, ctx, "h2o")
    res_own = generate_ids(model, ctx, question, method="h2o", compression_ratio=0.6, max_new_tokens=8, stop_at_eos=False)
    assert len(fused_calls) == 4
    for a, b in zip(fused, own):
        assert a.shape[-1] == int(0.4 * 300) and torch.equal(a, b)
    assert res_fused.token_ids == res_own.token_ids and res_fused.slots_per_layer == res_own.slots_per_layer


@pytest.mark.parametrize("method", ["snapkv", "tova", "knorm", "compactor"])
def test_other_methods_take_the_sdpa_path(method, fused_calls):
    model = tiny_llama()
    ctx = torch.randint(0, 96, (1, 200), generator=torch.Generator().manual_seed(2))
    kept_positions(model, ctx, method)
    assert fused_calls == []


def test_padded_batches_and_streams_compute_the_mass_themselves(fused_calls):
    """A padded batch compresses each row alone and a chunked prefill streams: neither has one causal pass over
    the compressed tokens, so H2O falls back to `attention_mass` (and still keeps what it should)."""
    model = tiny_llama()
    ctx = torch.randint(0, 96, (1, 200), generator=torch.Generator().manual_seed(3))
    res = generate_ids(model, ctx, None, method="h2o", budget=40, mode="chunked", chunk_size=64, max_new_tokens=2, stop_at_eos=False)
    assert max(res.slots_per_layer) <= 4 + 40 + 64 + 64 + 2
    cache = CompressedCache(model, CompressionOptions(method="h2o", mode="prefill", compression_ratio=0.5))
    mask = torch.ones(2, 200, dtype=torch.long)
    mask[1, :10] = 0
    with use_compressed_attention(model), torch.no_grad():
        model(torch.cat([ctx, ctx]), attention_mask=mask, past_key_values=cache, use_cache=True)
    assert fused_calls == []
    assert cache.layers[0].slots(0) == 100 and cache.layers[0].slots(1) == 95


def test_recorded_prefill_carries_the_mass_to_h2o_only(monkeypatch):
    """capture_qkv(attention_mass=True) records each layer's mass from its own (fused) attention; a replay
    of that record keeps H2O's tokens and answer of a fresh prefill, with no second mass computation."""
    from kvcompress.eval.capture import capture_qkv

    model = tiny_llama()
    g = torch.Generator().manual_seed(4)
    ctx, question = torch.randint(0, 96, (1, 240), generator=g), torch.randint(0, 96, (1, 6), generator=g)
    plain = capture_qkv(model, ctx)
    captured = capture_qkv(model, ctx, attention_mass=True)
    scale = model.model.layers[0].self_attn.scaling
    for layer, (q, k, v, mass) in captured.items():
        assert torch.allclose(q, plain[layer][0], atol=1e-5) and len(plain[layer]) == 3
        expected = attention_mass(Tokens(k, v, torch.arange(240).expand(1, 2, 240), q, scale=scale, query_positions=torch.arange(240)))
        assert torch.allclose(mass, expected, atol=1e-5)
    fresh = generate_ids(model, ctx, question, method="h2o", compression_ratio=0.6, max_new_tokens=6, stop_at_eos=False)

    def no_recomputation(tokens, *args, **kwargs):
        raise AssertionError("H2O recomputed the mass the record holds")

    monkeypatch.setattr(sys.modules[H2O.__module__], "attention_mass", no_recomputation)
    replayed = generate_ids(model, ctx, question, method="h2o", compression_ratio=0.6, max_new_tokens=6, stop_at_eos=False, prefill=captured)
    assert replayed.token_ids == fresh.token_ids and replayed.slots_per_layer == fresh.slots_per_layer
    knorm = generate_ids(model, ctx, question, method="knorm", compression_ratio=0.6, max_new_tokens=6, stop_at_eos=False, prefill=captured)
    assert knorm.token_ids == generate_ids(model, ctx, question, method="knorm", compression_ratio=0.6, max_new_tokens=6,
                                           stop_at_eos=False, prefill=plain).token_ids


@pytest.mark.parametrize("query_chunk", [0, 2.5, True])
def test_a_query_chunk_that_is_not_a_positive_count_is_refused_by_name(query_chunk):
    q, k, v = qkv(8, 8)
    with pytest.raises(ValueError, match=r"query_chunk must be an integer >= 1, got"):
        causal_attention_with_mass(q, k, v, 0.25, query_chunk=query_chunk)
