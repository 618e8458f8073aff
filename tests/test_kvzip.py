"""KVzip (methods/kvzip.py, integration/reconstruction.py): the score against a brute-force softmax, what it keeps,
the reconstruction forward in a model (its chunks, its cost counted as compression), and its refusals."""

import math
from dataclasses import asdict

import pytest
import torch

import kvcompress as kvc
from kvcompress.cache import CompressedCache
from kvcompress.integration import generate_batch_ids, generate_ids, use_compressed_attention
from kvcompress.integration.capture import capture_qkv
from kvcompress.integration.generation import compress_context_ids
from kvcompress.integration.reconstruction import load_reconstruction, reconstruct_context, record_reconstruction, repeat_prompt_ids
from kvcompress.methods.kvzip import KVzip, own_lse, reconstruction_scores
from kvcompress.methods.tokens import Tokens
from kvcompress.options import CompressionOptions
from kvcompress.ragged import RaggedSummary

from test_integration import _prompt, _reference, tiny


def _max_over_queries(queries, keys, probabilities):
    """[B, H_kv, n] float64: max over queries and group heads of probabilities(row, kv head, query head, i) -> [n]."""
    b, hq, nq, _ = queries.shape
    hkv, n = keys.shape[1], keys.shape[2]
    out = torch.zeros(b, hkv, n, dtype=torch.float64)
    for row in range(b):
        for head in range(hq):
            kv = head // (hq // hkv)
            for i in range(nq):
                out[row, kv] = torch.maximum(out[row, kv], probabilities(row, kv, head, i))
    return out


def _brute(queries, keys, exact, own, offset, scale):
    """[B, H_kv, n] float64: max over queries and group heads of softmax over (keys, exact, own causal keys), on `keys`."""
    def probabilities(row, kv, head, i):
        parts = [keys[row, kv], exact[row, kv], own[row, kv, : offset + i + 1]]
        return torch.softmax(torch.cat(parts).double() @ queries[row, head, i].double() * scale, 0)[: keys.shape[2]]
    return _max_over_queries(queries, keys, probabilities)


def _case(seed=0, b=2, hkv=2, group=2, n=40, m=5, nq=12, offset=3, d=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    exact = torch.randn(b, hkv, m, d, generator=g)
    own = torch.randn(b, hkv, offset + nq, d, generator=g)
    queries = 2 * torch.randn(b, hkv * group, nq, d, generator=g)
    return [t.to(dtype) for t in (keys, values, exact, own, queries)]


def _tokens(keys, values, queries, exact=None, extra=None, scale=None):
    b, h, n, d = keys.shape
    return Tokens(keys, values, torch.arange(n).expand(b, h, n), queries, scale=scale or d**-0.5, exact_keys=exact, extra_lse=extra)


def test_the_score_is_the_max_softmax_probability_over_context_and_reconstruction_keys():
    keys, values, exact, own, queries = _case()
    scale = 8**-0.5
    extra = own_lse(queries, own, scale, offset=3)
    score = KVzip().score(_tokens(keys, values, queries, exact, extra, scale), torch.Generator())
    assert score.shape == (2, 2, 40) and score.dtype == torch.float32
    torch.testing.assert_close(score.exp().double(), _brute(queries, keys, exact, own, 3, scale), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_value_norm_weighs_each_probability_by_its_values_l1_norm(dtype):
    """value_norm="absolute": probability times ‖v‖₁ (Guo et al., value also matters); "relative": times ‖v‖₁ over the
    mean of its head's, which keeps each head's order of "absolute" and its scores on the probability's scale."""
    keys, values, exact, own, queries = _case(seed=3, dtype=dtype)
    values = values * 300  # float16 values whose l1 norm (d = 8) would pass 65504 at 300x more: formed in float32
    scale = 8**-0.5
    extra = own_lse(queries, own, scale, offset=3)
    tokens = _tokens(keys, values, queries, exact, extra, scale)
    plain = KVzip().score(tokens, torch.Generator())
    absolute = KVzip(value_norm="absolute").score(tokens, torch.Generator())
    relative = KVzip(value_norm="relative").score(tokens, torch.Generator())
    norms = values.double().abs().sum(-1)
    assert absolute.dtype == relative.dtype == torch.float32 and torch.isfinite(absolute).all()
    torch.testing.assert_close(absolute.exp().double(), plain.exp().double() * norms, rtol=1e-4, atol=0)
    torch.testing.assert_close(relative.exp().double(), plain.exp().double() * norms / norms.mean(-1, keepdim=True), rtol=1e-4, atol=0)
    assert torch.equal(absolute.argsort(-1), relative.argsort(-1))
    zero = KVzip(value_norm="absolute").score(_tokens(keys, torch.zeros_like(values), queries, exact, extra, scale), torch.Generator())
    assert torch.isfinite(zero).all()  # a zero value is least worth keeping, not a token that must go (-inf)


def test_value_norm_is_refused_outside_its_choices():
    with pytest.raises(ValueError, match="value_norm must be one of \\('none', 'absolute', 'relative'\\).*got 'l2'"):
        KVzip(value_norm="l2")
    with pytest.raises(ValueError, match="value_norm must be one of"):
        CompressionOptions(method="adakv", budget=8, method_params={"scorer": "kvzip", "scorer_params": {"value_norm": True}})


def test_own_lse_is_the_causal_log_sum_exp_of_the_queries_own_keys():
    _, _, _, own, queries = _case(seed=1)
    got = own_lse(queries, own, 0.3, offset=3, max_logits=50)  # tiny chunks of queries
    b, hq, nq, _ = queries.shape
    for i in range(nq):
        logits = torch.einsum("bhd,bhkd->bhk", queries[:, :, i].double(), own.repeat_interleave(2, 1)[:, :, : 3 + i + 1].double()) * 0.3
        torch.testing.assert_close(got[:, :, i].double(), logits.logsumexp(-1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="need 15 keys"):
        own_lse(queries, own[:, :, :-1], 0.3, offset=3)


def test_query_chunks_give_the_same_scores_as_one_chunk():
    keys, values, exact, own, queries = _case(seed=2)
    extra = own_lse(queries, own, 0.35, offset=3)
    whole = reconstruction_scores(queries, keys, 0.35, exact, extra)
    for chunk in (1, 5):
        torch.testing.assert_close(reconstruction_scores(queries, keys, 0.35, exact, extra, chunk_size=chunk), whole)
        method = KVzip(reconstruction_chunk_size=chunk)
        tokens = _tokens(keys, values, queries, exact, extra, 0.35)
        torch.testing.assert_close(method.score(tokens, torch.Generator()), whole[0])
        torch.testing.assert_close(method.score_and_middle_lse(tokens, torch.Generator()), whole)
    torch.testing.assert_close(reconstruction_scores(queries, keys, 0.35, exact, extra, max_logits=1), whole)


def test_the_middle_lse_is_each_querys_log_sum_exp_over_the_middle_keys_alone():
    """What a refit of the kept slots reuses (`methods.attention_matching`): the normaliser over `keys` only, neither the
    exact keys nor the forward's own (extra_lse), a KV head's rows its query heads' queries, head by head."""
    keys, _, exact, own, queries = _case(seed=3)
    b, hq, nq, d = queries.shape
    hkv = keys.shape[1]
    _, middle_lse = reconstruction_scores(queries, keys, 0.35, exact, own_lse(queries, own, 0.35, offset=3), chunk_size=5)
    logits = torch.einsum("bhqd,bhkd->bhqk", queries.double(), keys.repeat_interleave(hq // hkv, 1).double()) * 0.35
    torch.testing.assert_close(middle_lse.double(), logits.logsumexp(-1).reshape(b, hkv, -1), rtol=1e-5, atol=1e-5)


def _brute_chunked(queries, keys, positions, exact, exact_positions, extra, chunk, scale):
    """[B, H_kv, n] float64: the paper's chunked scores by brute force: query j (repeating position j) scores the keys of its
    chunk, its softmax over them, the exact keys of its chunk or before the middle, and extra's keys (their log-sum-exp)."""
    def probabilities(row, kv, head, j):
        first = j // chunk * chunk
        mine = (positions[row, kv] >= first) & (positions[row, kv] < first + chunk)
        seen = (exact_positions[row, kv] < positions[row, kv].min()) | (
            (exact_positions[row, kv] >= first) & (exact_positions[row, kv] < first + chunk))
        q = queries[row, head, j].double()
        logits = keys[row, kv][mine].double() @ q * scale
        lse = torch.logsumexp(torch.cat([logits, exact[row, kv][seen].double() @ q * scale, extra[row, head, j:j + 1].double()]), 0)
        return torch.zeros(keys.shape[2], dtype=torch.float64).masked_scatter(mine, (logits - lse).exp())
    return _max_over_queries(queries, keys, probabilities)


@pytest.mark.parametrize("chunk", [7, 16, 100])
def test_chunked_scoring_scores_each_token_by_its_own_chunks_queries_as_the_paper_does(chunk):
    """scoring='chunk' (KVzip Sec. 3, kvpress's KVzipPress): the queries that repeat chunk c score only chunk c's tokens, their
    softmax over those, the sink and their own forward's keys; a chunk covering the context is the whole-context scoring."""
    g = torch.Generator().manual_seed(7)
    b, hkv, group, sink, window, n, d = 2, 2, 2, 3, 2, 35, 8
    total = sink + n + window
    keys, values = torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    exact = torch.randn(b, hkv, sink + window, d, generator=g)
    queries = 2 * torch.randn(b, hkv * group, total, d, generator=g)
    extra = torch.randn(b, hkv * group, total, generator=g)
    positions = torch.arange(sink, sink + n).expand(b, hkv, n)
    exact_positions = torch.cat([torch.arange(sink), torch.arange(sink + n, total)]).expand(b, hkv, sink + window)
    tokens = Tokens(keys, values, positions, queries, scale=0.4, exact_keys=exact, exact_positions=exact_positions, extra_lse=extra)
    score = KVzip(reconstruction_chunk_size=chunk, scoring="chunk").score(tokens, torch.Generator())
    expected = _brute_chunked(queries, keys, positions, exact, exact_positions, extra, chunk, 0.4)
    torch.testing.assert_close(score.exp().double(), expected, rtol=1e-5, atol=1e-7)
    small, middle_lse = reconstruction_scores(queries, keys, 0.4, exact, extra, chunk, max_logits=64,
                                              chunk_local=(positions[0, 0], exact_positions[0, 0]))
    torch.testing.assert_close(small, score)
    assert middle_lse is None  # a chunk's queries never see the whole middle
    if chunk >= total:
        torch.testing.assert_close(score, KVzip(reconstruction_chunk_size=chunk).score(tokens, torch.Generator()))


def test_chunked_scoring_needs_one_query_per_context_token():
    keys, values, _, _, queries = _case(seed=8)
    with pytest.raises(ValueError, match="scoring='chunk' needs one reconstruction query per context token.*got 12 queries for 40"):
        KVzip(scoring="chunk").score(_tokens(keys, values, queries), torch.Generator())
    with pytest.raises(ValueError, match="scoring must be one of \\('context', 'chunk'\\).*got 'local'"):
        KVzip(scoring="local")


def test_chunked_scoring_in_a_model_reads_the_recorded_queries_of_each_chunk():
    """In a model, query j of the recorded reconstruction repeats context token j: chunked scoring keeps tokens from every
    chunk, and one chunk covering the context keeps what whole-context scoring keeps."""
    model = tiny()
    ctx, _ = _prompt(n=100)
    kept = {}
    for scoring, chunk in (("context", 100), ("chunk", 100), ("chunk", 25)):
        cache = CompressedCache(model, CompressionOptions(method="kvzip", budget=20, sink=2, window=0,
                                                          method_params={"reconstruction_chunk_size": chunk, "scoring": scoring}))
        with use_compressed_attention(model):
            reconstruct_context(model, cache, ctx)
        kept[scoring, chunk] = [layer.stored().positions for layer in cache.layers]
    assert all(torch.equal(a, b) for a, b in zip(kept["context", 100], kept["chunk", 100]))
    assert not all(torch.equal(a, b) for a, b in zip(kept["context", 100], kept["chunk", 25]))
    assert all(p.shape == (1, 2, 22) for p in kept["chunk", 25])


def test_without_own_keys_the_normaliser_is_the_context_alone():
    """kvc.compress: the caller's queries are the reconstruction queries, their softmax over the keys given."""
    keys, values, _, _, queries = _case(seed=3)
    score = KVzip().score(_tokens(keys, values, queries), torch.Generator())
    empty = keys[:, :, :0]
    torch.testing.assert_close(score.exp().double(), _brute(queries, keys, empty, empty, 0, 8**-0.5), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("scoring", ["context", "chunk"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_with_large_logits_stays_finite_and_matches_float32(dtype, scoring):
    keys, values, exact, own, queries = _case(seed=4, dtype=dtype, nq=45)  # 45 = 5 exact + 40 middle: one query per token
    keys, queries = (keys.float() * 40).to(dtype), (queries.float() * 40).to(dtype)
    extra = own_lse(queries, own, 8**-0.5, offset=3)
    method = KVzip(scoring=scoring, reconstruction_chunk_size=16)

    def tokens(k, v, q, e):
        return Tokens(k, v, torch.arange(5, 45).expand(2, 2, 40), q, scale=8**-0.5, exact_keys=e,
                      exact_positions=torch.arange(5).expand(2, 2, 5), extra_lse=extra)
    score = method.score(tokens(keys, values, queries, exact), torch.Generator())
    ref = method.score(tokens(keys.float(), values.float(), queries.float(), exact.float()), torch.Generator())
    assert torch.isfinite(extra).all() and not torch.isnan(score).any() and (score <= 1e-6).all()
    torch.testing.assert_close(score, ref)


def test_a_key_a_reconstruction_query_attends_to_sharply_is_kept():
    g = torch.Generator().manual_seed(5)
    keys, values = 0.1 * torch.randn(1, 2, 64, 16, generator=g), torch.randn(1, 2, 64, 16, generator=g)
    queries = 0.1 * torch.randn(1, 4, 10, 16, generator=g)
    keys[0, 0, 37] = keys[0, 1, 11] = 3 * torch.ones(16)
    queries[0, 0, 4] = queries[0, 3, 7] = 3 * torch.ones(16)  # head 0 reads KV head 0, head 3 KV head 1
    s = kvc.compress("kvzip", keys, values, queries, budget=3, sink=0, window=0)
    assert 37 in s.positions[0, 0].tolist() and 11 in s.positions[0, 1].tolist()
    assert s.num_slots == 3 and bool((s.log_weights == 0).all())


def test_modes_other_than_prefill_and_streams_are_refused():
    for mode in ("chunked", "decode"):
        with pytest.raises(ValueError, match=f"method 'kvzip' runs in mode 'prefill' only, got mode='{mode}'.*reconstruct"):
            CompressionOptions(method="kvzip", mode=mode, budget=8)
        with pytest.raises(ValueError, match="'prefill' only"):
            generate_ids(tiny(), *_prompt(n=40), method="kvzip", mode=mode, budget=8, max_new_tokens=1)
    with pytest.raises(ValueError, match="'kvzip' has no stream"):
        kvc.stream("kvzip", budget=8)
    assert KVzip.requirements.modes == ("prefill",) and KVzip.requirements.needs("reconstruction")


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64", None])
def test_bad_parameters_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="reconstruction_chunk_size"):
        CompressionOptions(method="kvzip", budget=8, method_params={"reconstruction_chunk_size": bad})
    with pytest.raises(ValueError, match="has no parameter"):
        CompressionOptions(method="kvzip", budget=8, method_params={"observation_window": 4})
    with pytest.raises(ValueError, match="kvzip.*cannot be a part of the hybrid"):
        kvc.compress("hybrid", torch.randn(1, 1, 10, 4), torch.randn(1, 1, 10, 4), budget=3, score="kvzip", exact_fraction=0.3,
                     score_params=None)


NEW = 8


def test_generation_runs_the_reconstruction_counts_it_and_ratio_zero_is_the_full_cache():
    model = tiny()
    ctx, question = _prompt(n=150)
    prefix = torch.tensor([[5, 6, 7]])
    res = generate_ids(model, ctx, question, method="kvzip", compression_ratio=0.0, max_new_tokens=NEW, stop_at_eos=False,
                       repeat_prompt_ids=prefix[0].tolist(), method_params={"reconstruction_chunk_size": 64})
    assert res.token_ids == _reference(model, ctx, question, NEW)
    assert res.slots_per_layer == [150 + question.shape[1] + NEW - 1] * 2
    rec = res.extra["reconstruction"]
    assert rec["forwards"] == 3 and rec["tokens"] == 150 + 3 * 3  # the context again, the instruction before each chunk
    assert 0 < rec["seconds"] <= res.compress_seconds <= res.prefill_seconds
    # the transient buffer held the context, the instruction and at most one chunk
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (keys, values) x KV heads x head dim x float32
    assert rec["peak_kv_bytes"] == (150 + 3 + 64) * per_token


def test_compressed_generation_keeps_the_budget_and_answers_from_the_compressed_context():
    model = tiny()
    ctx, question = _prompt(n=200)
    res = generate_ids(model, ctx, question, method="kvzip", budget=40, sink=2, window=0, max_new_tokens=NEW, stop_at_eos=False)
    assert res.slots_per_layer == [42 + question.shape[1] + NEW - 1] * 2 and res.budget == 40
    assert res.kv_bytes < res.kv_bytes_full and res.peak_kv_bytes <= res.kv_bytes_full
    assert res.extra["reconstruction"]["tokens"] == 200  # no instruction given: the context alone is repeated


def test_one_chunk_keeps_what_the_brute_force_reconstruction_scores_keep():
    """The cache's kept tokens are the top-k of the brute-force scores on one forward over [context, instruction, context]."""
    model = tiny()
    ctx, _ = _prompt(n=60)
    prefix = torch.tensor([[9, 8, 7, 6]])
    cache = CompressedCache(model, CompressionOptions(method="kvzip", budget=12, sink=0, window=0))
    with use_compressed_attention(model):
        reconstruct_context(model, cache, ctx, prefix)
    captured = capture_qkv(model, torch.cat([ctx, prefix, ctx], 1))
    scale = model.model.layers[0].self_attn.scaling
    empty = torch.zeros(1, 2, 0, 16)
    for layer, (q, k, _) in captured.items():
        scores = _brute(q[:, :, 64:], k[:, :, :60], empty, k[:, :, 60:], 4, scale)
        expected = scores.topk(12, -1).indices.sort(-1).values
        assert torch.equal(cache.layers[layer].stored().positions, expected), layer


def test_adakv_over_kvzip_reconstructs_in_its_scorers_chunks():
    """scorer_params' reconstruction_chunk_size reaches the reconstruction forward through AdaKV."""
    model = tiny()
    ctx, question = _prompt(n=100)
    res = generate_ids(model, ctx, question, method="adakv", budget=20, max_new_tokens=1,
                       method_params={"scorer": "kvzip", "scorer_params": {"reconstruction_chunk_size": 32}})
    assert res.extra["reconstruction"]["forwards"] == 4


def test_smaller_chunks_bound_each_forward_and_still_score_every_token():
    model = tiny()
    ctx, _ = _prompt(n=100)
    results = {}
    for chunk in (100, 1000, 16):
        cache = CompressedCache(model, CompressionOptions(method="kvzip", budget=20, sink=0, window=0,
                                                          method_params={"reconstruction_chunk_size": chunk}))
        with use_compressed_attention(model):
            logits, stats = reconstruct_context(model, cache, ctx)
        results[chunk] = ([layer.stored().positions for layer in cache.layers], stats)
    assert all(torch.equal(a, b) for a, b in zip(results[100][0], results[1000][0]))  # a chunk covering everything is one chunk
    positions, stats = results[16]
    assert stats.forwards == math.ceil(100 / 16) and stats.tokens == 100
    assert stats.peak_kv_bytes == (100 + 16) * 2 * 2 * 2 * 16 * 4 < results[100][1].peak_kv_bytes
    assert all(p.shape == (1, 2, 20) and bool((p.diff(dim=-1) > 0).all()) for p in positions)


def test_one_recorded_reconstruction_serves_every_ratio_and_kvzip_scored_method_as_a_fresh_one_would():
    """generate_ids(prefill=recorded) answers token for token as the fresh reconstruction, for any number of caches;
    the recorded forwards' seconds still count as each cache's compression time, and nothing in the record changes."""
    model = tiny()
    ctx, question = _prompt(n=90)
    prefix = torch.tensor([[9, 8, 7, 6]])
    recorded = record_reconstruction(model, CompressedCache(model, CompressionOptions(method="kvzip", budget=8)), ctx, prefix)
    assert recorded.stats.forwards == 1 and recorded.stats.tokens == 94 and recorded.stats.context_seconds > 0
    assert set(recorded.queries) == set(range(len(recorded.keys))) and recorded.queries[0].shape == (1, 4, 90, 16)
    before = [t.clone() for t in (*recorded.keys, *recorded.values, *recorded.queries.values(), *recorded.lse.values())]
    cells = [dict(method="kvzip", compression_ratio=r) for r in (0.5, 0.75, 0.9)]
    cells.append(dict(method="adakv", compression_ratio=0.75, window=0, method_params={"scorer": "kvzip", "scope": "model", "alpha_safeguard": 0.05}))
    for cell in cells:
        fresh = generate_ids(model, ctx, question, max_new_tokens=NEW, repeat_prompt_ids=prefix[0].tolist(), **cell)
        loaded = generate_ids(model, ctx, question, max_new_tokens=NEW, repeat_prompt_ids=prefix[0].tolist(), prefill=recorded, **cell)
        assert loaded.token_ids == fresh.token_ids and loaded.slots_per_layer == fresh.slots_per_layer, cell
        assert loaded.kv_bytes == fresh.kv_bytes and loaded.extra["reconstruction"] == asdict(recorded.stats)
        assert loaded.compress_seconds >= recorded.stats.seconds
    after = (*recorded.keys, *recorded.values, *recorded.queries.values(), *recorded.lse.values())
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_recorded_reconstruction_is_refused_where_it_does_not_fit():
    model = tiny()
    ctx, question = _prompt(n=60)
    kvzip = CompressionOptions(method="kvzip", budget=8)
    recorded = record_reconstruction(model, CompressedCache(model, kvzip), ctx)
    with pytest.raises(ValueError, match="made for other context_ids"):
        generate_ids(model, _prompt(n=60, seed=4)[0], question, kvzip, prefill=recorded)
    with pytest.raises(ValueError, match="made for other repeat_prompt_ids"):
        generate_ids(model, ctx, question, method="kvzip", budget=8, prefill=recorded, repeat_prompt_ids=[9, 8])
    with pytest.raises(ValueError, match="serves a method scored by reconstruction.*got method='snapkv'"):
        generate_ids(model, ctx, question, method="snapkv", budget=8, prefill=recorded)
    chunked = CompressionOptions(method="kvzip", budget=8, method_params={"reconstruction_chunk_size": 16})
    with pytest.raises(ValueError, match="reconstructs in chunks of 16 tokens.*used chunks of \\d+"):
        load_reconstruction(model, CompressedCache(model, chunked), recorded)
    with pytest.raises(ValueError, match="does not score with a reconstruction"):
        record_reconstruction(model, CompressedCache(model, CompressionOptions(method="snapkv", budget=8)), ctx)


def test_kvc_generate_puts_the_repeat_instruction_before_the_repeated_context(tiny_checkpoint):
    model, tokenizer = kvc.load_model(tiny_checkpoint)
    prefix = repeat_prompt_ids(tokenizer)
    assert tokenizer.decode(prefix[0]) == "\n\nRepeat the previous context exactly."  # no chat template: the plain text
    res = kvc.generate(model, tokenizer, "some words in a context " * 12, "what?", method="kvzip", compression_ratio=0.5,
                       max_new_tokens=4, progress=False)
    assert res.extra["reconstruction"]["tokens"] == res.context_tokens + prefix.shape[1]
    cache = kvc.compress_context(model, tokenizer, "another context " * 10, method="kvzip", compression_ratio=0.5, progress=False)
    assert cache.compress_seconds() > 0 and cache.get_seq_length() == cache.token_ids.shape[1]
    with pytest.raises(ValueError, match="instruction must be a non-empty str"):
        repeat_prompt_ids(tokenizer, "  ")


def test_what_kvzip_cannot_take_is_refused_clearly():
    model = tiny()
    ctx, question = _prompt(n=60)
    with pytest.raises(ValueError, match="a recorded prefill is not supported, nor an approximate one; name another method"):
        generate_ids(model, ctx, question, method="kvzip", budget=8, prefill=capture_qkv(model, ctx))
    same = generate_batch_ids(model, [ctx, _prompt(n=60, seed=4)[0]], question, method="kvzip", budget=8, max_new_tokens=2)
    assert [r.extra["reconstruction"]["forwards"] for r in same] == [1, 1]  # a batch of equal lengths reconstructs at once
    assert [r.extra["batch_run"] for r in same] == ["one_forward"] * 2
    with pytest.raises(ValueError, match="reconstruction forward.*not with the context's own"):
        model.generate(ctx, past_key_values=CompressedCache(model, "kvzip", budget=8), max_new_tokens=2)
    with pytest.raises(ValueError, match="reconstruction forward.*not with the context's own.*recorded prefill"):
        CompressedCache.from_prefill(model, CompressionOptions(method="kvzip", budget=8), capture_qkv(model, ctx))
    with pytest.raises(ValueError, match="context_ids must be an integer tensor"):
        reconstruct_context(model, CompressedCache(model, CompressionOptions(method="kvzip", budget=8)), ctx.float())
    with pytest.raises(ValueError, match="fresh prefill-mode CompressedCache"):
        reconstruct_context(model, CompressedCache(model, CompressionOptions(method="snapkv", budget=8, mode="chunked")), ctx)
    with pytest.raises(ValueError, match="does not score with a reconstruction"):
        reconstruct_context(model, CompressedCache(model, CompressionOptions(method="snapkv", budget=8)), ctx)


@pytest.mark.parametrize("method", ["kvzip_refit", "kvzip"])
def test_a_padded_batch_with_kvzip_refit_or_kvzip_runs_each_context_alone_with_its_solo_answer(method):
    """One padded forward cannot compress its rows apart through a reconstruction forward (nor with kvzip_refit's one
    budget over every layer): each context is compressed and answered alone, exactly as generate_ids does it."""
    model = tiny()
    contexts = [_prompt(n=n, seed=s)[0] for n, s in ((120, 1), (80, 2), (101, 3))]
    _, question = _prompt(n=60, seed=4)
    kw = dict(method=method, compression_ratio=0.5, max_new_tokens=6, stop_at_eos=False)
    batch = generate_batch_ids(model, contexts, question, **kw)
    assert len(batch) == 3
    for ctx, res in zip(contexts, batch):
        solo = generate_ids(model, ctx, question, **kw)
        assert res.token_ids == solo.token_ids and res.slots_per_layer == solo.slots_per_layer
        assert res.method == solo.method == ("adakv" if method == "kvzip_refit" else "kvzip")
        assert res.context_tokens == ctx.shape[1] and res.extra["reconstruction"]["forwards"] == 1
        assert res.extra["batch_run"] == "one_by_one" and res.extra["batch_size"] == 3


@pytest.mark.parametrize("family", ["mistral", "qwen3", "phi3", "gemma3", "gemma2"])
def test_every_family_reconstructs_at_ratio_zero_as_the_full_cache_or_refuses_soft_capping(family):
    """Sliding-window layers (Gemma 3) keep their window from the reconstruction's context prefill; Gemma 2's soft-capped
    logits are not what KVzip's softmax scores model, so it is refused by name."""
    from test_hf import _greedy, _ids
    from test_hf import tiny as tiny_family

    model = tiny_family(family)
    ctx, question = _ids(100), _ids(6, 2)
    run = dict(method="kvzip", compression_ratio=0.0, max_new_tokens=6, stop_at_eos=False)
    if family == "gemma2":
        with pytest.raises(ValueError, match="soft-caps its attention logits"):
            generate_ids(model, ctx, question, **run)
        return
    reference = _greedy(model, torch.cat([ctx, question], 1), new=6)[0].tolist()
    assert generate_ids(model, ctx, question, **run).token_ids == reference



def test_adakv_shares_kvzips_budget_among_heads_through_the_reconstruction():
    """AdaKV over KVzip's scores (head-wise budgets): the reconstruction runs, each layer row keeps H_kv·(sink + budget)
    tokens in all, and the cache stores them ragged."""
    model = tiny()
    ctx, question = _prompt(n=200)
    options = CompressionOptions(method="adakv", budget=40, sink=2, window=0, method_params={"scorer": "kvzip"})
    res = generate_ids(model, ctx, question, options, max_new_tokens=NEW, stop_at_eos=False)
    assert res.extra["reconstruction"]["tokens"] == 200
    cache = compress_context_ids(model, ctx, options)
    for layer in cache.layers:
        assert isinstance(layer.front, RaggedSummary)
        kept = torch.isfinite(layer.front.summary().log_weights).sum(-1)  # [B, H_kv]: the middle of each head
        assert int(kept.sum()) == 2 * 40 and layer.tail.positions[0, 0].tolist() == [0, 1]  # the sink: the exact tail


def test_adakv_with_model_scope_shares_kvzips_budget_among_every_layers_heads():
    """KVzip's own allocation (AdaKV over its scores, scope "model", no safeguard): after the reconstruction every layer is
    compressed together, the model keeps L·H_kv·budget middle tokens in all, unevenly among its layers."""
    model = tiny()
    ctx, question = _prompt(n=200)
    options = CompressionOptions(method="adakv", budget=40, sink=2, window=0,
                                 method_params={"scorer": "kvzip", "scope": "model", "alpha_safeguard": 0.0})
    res = generate_ids(model, ctx, question, options, max_new_tokens=NEW, stop_at_eos=False)
    assert res.extra["reconstruction"]["tokens"] == 200 and len(res.token_ids) == NEW
    cache = compress_context_ids(model, ctx, options)
    per_layer = [int(torch.isfinite(layer.stored().log_weights).sum()) - 2 * 2 for layer in cache.layers]
    assert sum(per_layer) == len(cache.layers) * 2 * 40 and len(set(per_layer)) > 1


def test_kvzip_refit_is_the_slow_prefill_default_by_name_and_takes_no_parameters():
    """method="kvzip_refit" (`options.NAMED_SETTINGS`) resolves, when the options are built, to KVzip's scores ranked
    across every layer's heads with a 5 % safeguard and no exact window, the kept slots' log-weights and values refitted
    to the reconstruction's attention; prefill mode only, and its parameters are not given by name."""
    prefill = CompressionOptions(method="kvzip_refit", compression_ratio=0.5)
    assert (prefill.method, prefill.method_params, prefill.window, prefill.sink) == (
        "adakv", {"scorer": "kvzip", "scope": "model", "alpha_safeguard": 0.05, "refit": "log_weights_values"}, 0, 4)
    assert prefill.compressor.requirements.needs("reconstruction") and prefill.compressor.requirements.budget_scope == "model"
    assert CompressionOptions(**prefill.to_dict()) == prefill  # what a saved cache records builds the same options
    assert CompressionOptions(method="kvzip_refit", compression_ratio=0.5, window=16).window == 16  # a window given replaces it
    for mode in ("chunked", "decode"):
        with pytest.raises(ValueError, match=rf"method 'kvzip_refit' runs in mode 'prefill' only, got mode='{mode}'"):
            CompressionOptions(method="kvzip_refit", budget=8, mode=mode)
    with pytest.raises(ValueError, match=r"method parameters \['scorer'\] need a registered method: 'kvzip_refit' in mode 'prefill' is 'adakv'"):
        CompressionOptions.build(method="kvzip_refit", compression_ratio=0.5, scorer="snapkv")
    model = tiny()
    ctx, question = _prompt(n=120)
    res = generate_ids(model, ctx, question, method="kvzip_refit", compression_ratio=0.5, max_new_tokens=2)
    assert res.method == "adakv" and res.extra["reconstruction"]["forwards"] == 1
