"""AdaKV (arXiv:2407.11550): head-adaptive budgets over an inner score method, and the ragged storage that keeps
only what each head keeps (docs/design.md, "Memory")."""

import dataclasses
import math

import pytest
import torch

import kvcompress as kvc
from kvcompress.cache import CompressedCache
from kvcompress.integration import answer_from_cache_ids, compress_context_ids, generate_ids, use_compressed_attention
from kvcompress.methods.adakv import AdaKV, head_allocation
from kvcompress.methods.base import max_pool_scores
from kvcompress.methods.budget import DEFAULT_SLACK, stream_split
from kvcompress.methods.registry import build_method
from kvcompress.methods.tokens import Tokens
from kvcompress.quantization import QuantizedRaggedSummary
from kvcompress.ragged import RaggedSummary, concat_parts, has_empty_slots
from kvcompress.summary import KVSummary, Normalizer, concat

from test_integration import _prompt, blocks, tiny

NEW = 8


def _layer(b=2, h=4, n=120, d=16, seed=0, group=2):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)
    keys[:, 1] *= 4  # one head with sharper attention
    return keys, values, torch.randn(b, h * group, n, d, generator=g)


def _middle_counts(summary, exact):
    return torch.isfinite(summary.log_weights).sum(-1) - exact


@pytest.mark.parametrize("budget", [1, 7, 20, 33])
@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
def test_each_row_keeps_exactly_heads_times_budget(budget, alpha):
    g = torch.Generator().manual_seed(budget)
    scores = torch.rand(3, 4, 50, generator=g) ** 4
    kept = head_allocation(scores, budget, math.floor(alpha * budget))
    assert (kept.sum((-1, -2)) == 4 * budget).all()
    keys, values, queries = _layer()
    s = kvc.compress("adakv", keys, values, queries, budget=budget, sink=2, window=4, alpha_safeguard=alpha)
    assert (_middle_counts(s, 6).sum(-1) == 4 * budget).all()
    assert s.num_slots == 6 + int(_middle_counts(s, 6).max())


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.6])
def test_every_head_keeps_its_own_top_share(alpha):
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(2, 3, 80, generator=g)
    scores[:, 0] *= 100  # head 0 would take everything without the safeguard
    budget = 20
    safe = math.floor(alpha * budget)
    kept = head_allocation(scores, budget, safe)
    assert (kept.sum(-1) >= safe).all()
    if safe:
        own_top = scores.topk(safe, dim=-1).indices
        assert kept.gather(-1, own_top).all()
    if alpha == 0.0:
        assert (kept[:, 1:].sum(-1) == 0).all() and (kept[:, 0].sum(-1) == 3 * budget).all()


def test_alpha_one_and_identical_heads_are_the_scorer_itself():
    """With every head's scores the same (or every head guaranteed its whole budget), AdaKV keeps the scorer's own
    per-head top budget."""
    keys, values, queries = _layer(b=1)
    args = dict(budget=16, sink=2, window=4)
    snap = kvc.compress("snapkv", keys, values, queries, **args)
    assert torch.equal(kvc.compress("adakv", keys, values, queries, alpha_safeguard=1.0, **args).positions, snap.positions)
    same = (keys[:, :1].expand_as(keys).contiguous(), values[:, :1].expand_as(values).contiguous(),
            queries[:, :2].repeat(1, 4, 1, 1))
    ada = kvc.compress("adakv", *same, alpha_safeguard=0.0, **args)
    assert ada.num_slots == snap.num_slots and bool((ada.log_weights == 0).all())
    assert torch.equal(ada.positions, kvc.compress("snapkv", *same, **args).positions)
    for scorer in ("knorm", "keydiff"):
        sk = kvc.compress(scorer, *same, **args)
        assert torch.equal(kvc.compress("adakv", *same, scorer=scorer, **args).positions, sk.positions)


def test_spread_heads_get_more_slots_than_concentrated_ones():
    """Head 0's observation queries attend to a handful of tokens, head 1's spread evenly: head 1 keeps more."""
    n, d = 100, 16
    g = torch.Generator().manual_seed(2)
    direction = torch.randn(d, generator=g)
    keys = torch.zeros(1, 2, n, d)
    keys[0, 0] = 0.1 * torch.randn(n, d, generator=g)
    keys[0, 0, [10, 40, 70]] = 8 * direction  # three tokens take head 0's attention
    queries = torch.zeros(1, 2, n, d)
    queries[0, 0] = direction  # head 1's queries are 0: uniform attention over its keys
    values = torch.randn(1, 2, n, d, generator=g)
    # no pooling: SnapKV's pooling spreads each of head 0's three peaks over 7 neighbours
    s = kvc.compress("adakv", keys, values, queries, budget=20, sink=0, window=0, scorer_params={"kernel_size": 1})
    counts = _middle_counts(s, 0)[0]
    assert counts.sum() == 40 and counts[1] > 20 > counts[0] >= math.floor(0.2 * 20)
    assert {10, 40, 70} <= set(s.positions[0, 0][: int(counts[0])].tolist())


def test_span_keeps_each_top_token_with_its_neighbours():
    """With span 3, the three tokens around head 0's single peak are kept together; the -inf scores of tokens that
    must go are not raised by a neighbour's."""
    n, d = 60, 16
    g = torch.Generator().manual_seed(3)
    direction = torch.randn(d, generator=g)
    keys = 0.1 * torch.randn(1, 2, n, d, generator=g)
    keys[0, :, 30] = 8 * direction
    queries = direction.expand(1, 2, n, d).contiguous()
    values = torch.randn(1, 2, n, d, generator=g)
    args = dict(budget=3, sink=0, window=0, alpha_safeguard=1.0, scorer_params={"kernel_size": 1})
    plain = kvc.compress("adakv", keys, values, queries, **args)
    pooled = kvc.compress("adakv", keys, values, queries, span=3, **args)
    assert 30 in plain.positions[0, 0].tolist() and plain.positions[0, 0].tolist() != [29, 30, 31]
    assert pooled.positions[0, 0].tolist() == [29, 30, 31] and pooled.positions[0, 1].tolist() == [29, 30, 31]
    scores = torch.tensor([[[0.0, -math.inf, 5.0, 1.0, 2.0]]])
    assert max_pool_scores(scores, 3).tolist() == [[[0.0, -math.inf, 5.0, 5.0, 2.0]]]
    assert max_pool_scores(scores, 1) is scores


def test_the_summary_pads_short_heads_with_empty_slots_at_the_end():
    keys, values, queries = _layer(b=1, n=90)
    s = kvc.compress("adakv", keys, values, queries, budget=12, sink=0, window=0)
    counts = _middle_counts(s, 0)[0]
    assert len(set(counts.tolist())) > 1
    for head, c in enumerate(counts.tolist()):
        assert (s.log_weights[0, head, :c] == 0).all() and torch.isneginf(s.log_weights[0, head, c:]).all()
        assert (s.positions[0, head, c:] == -1).all() and (s.keys[0, head, c:] == 0).all()
        assert (s.positions[0, head, :c].diff() > 0).all()
    out = kvc.weighted_attention(queries[:, :, -4:], s)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_with_large_keys_stays_finite(dtype):
    keys, values, queries = _layer(b=1)
    keys, values, queries = (keys * 300).to(dtype), values.to(dtype), queries.to(dtype)
    for normalize in ("none", "softmax"):
        s = kvc.compress("adakv", keys, values, queries, budget=10, sink=2, window=4, normalize=normalize)
        assert (_middle_counts(s, 6).sum(-1) == 40).all() and s.keys.dtype == dtype
        assert torch.isfinite(kvc.weighted_attention(queries, s)).all()


def test_streams_keep_heads_times_budget_and_never_allocate_more_than_they_took_in():
    keys, values, queries = _layer(b=1, n=200)
    st = kvc.stream("adakv", budget=16, sink=2, window=4)
    for start in range(0, 200, 23):
        stop = min(200, start + 23)
        st.update(keys[:, :, start:stop], values[:, :, start:stop], queries[:, :, start:stop])
        assert st.state.slots.kv_bytes() <= 2 * 4 * max(st.seen - 6, 0) * 16 * 4
    st.compact()
    s = st.summary()
    target, _ = stream_split(16, DEFAULT_SLACK)  # what a re-compression keeps; blocks then fill the rest of the budget
    assert ((_middle_counts(s, 6).sum(-1) >= 4 * target) & (_middle_counts(s, 6).sum(-1) <= 4 * 16)).all()
    assert torch.equal(torch.isneginf(s.log_weights), s.positions == -1)


def test_bad_parameters_are_refused_clearly():
    with pytest.raises(ValueError, match=r"scorer must be the name of a registered score method.*snapkv.*got 'balancekv'"):
        build_method("adakv", scorer="balancekv")
    for bad in ("adakv", "nope", 3):
        with pytest.raises(ValueError, match="scorer must be"):
            build_method("adakv", scorer=bad)
    for bad in (-0.1, 1.5, True, "0.2", float("nan")):
        with pytest.raises(ValueError, match=r"alpha_safeguard must be a number in \[0, 1\]"):
            build_method("adakv", alpha_safeguard=bad)
    with pytest.raises(ValueError, match="normalize must be one of"):
        build_method("adakv", normalize="sum")
    for bad in (0, 2, -1, 1.0, True, "3"):
        with pytest.raises(ValueError, match=r"span must be an odd integer >= 1.*got"):
            build_method("adakv", span=bad)
    with pytest.raises(ValueError, match="scorer_params must be a dict"):
        build_method("adakv", scorer_params="fast")
    with pytest.raises(ValueError, match="no parameter"):
        build_method("adakv", scorer="snapkv", scorer_params={"nope": 1})
    with pytest.raises(ValueError, match="scores tokens with queries"):
        kvc.compress("adakv", *_layer()[:2], budget=8)
    m = build_method("adakv", scorer="random")
    assert m.randomized and not m.requirements.needs("queries") and isinstance(m, AdaKV)


def test_ragged_summary_packs_unpacks_and_selects_rows():
    keys, values, queries = _layer(b=3, n=90)
    s = kvc.compress("adakv", keys, values, queries, budget=12, sink=2, window=0)
    assert has_empty_slots(s) and not has_empty_slots(kvc.compress("snapkv", keys, values, queries, budget=12, sink=2, window=0))
    r = RaggedSummary.of(s)
    counts = torch.isfinite(s.log_weights).sum(-1)
    assert torch.equal(r.counts, counts.int()) and r.keys.shape == (int(counts.sum()), 16) and r.log_weights is None
    assert r.nbytes() == int(counts.sum()) * 2 * 16 * 4 + 3 * 4 * 4 and r.nbytes() < s.nbytes()
    u = r.summary()
    for t in ("keys", "values", "log_weights", "positions"):
        assert torch.equal(getattr(u, t), getattr(s, t)), t  # the compressed summary already has its padding at the end
    torch.testing.assert_close(kvc.weighted_attention(queries, u), kvc.weighted_attention(queries, s))
    rows = torch.tensor([2, 0, 2])
    picked = r.select_rows(rows).summary()
    width = picked.num_slots
    for i, row in enumerate(rows.tolist()):
        assert torch.equal(picked.positions[i, :, : u.num_slots][:, :width], u.positions[row][:, :width])
        assert torch.equal(picked.keys[i], u.keys[row][:, :width])
    half = r.to("cpu", torch.bfloat16)
    assert half.keys.dtype == torch.bfloat16 and half.positions.dtype == torch.int32
    weighted = KVSummary(s.keys, s.values, s.log_weights.masked_fill(s.log_weights == 0, 0.5), s.positions)
    assert torch.equal(RaggedSummary.of(weighted).summary().log_weights, weighted.log_weights)
    even = RaggedSummary.of(kvc.compress("snapkv", keys, values, queries, budget=12, sink=2, window=0))
    assert even.eviction_only and even.summary().eviction_only
    with pytest.raises(ValueError, match="normalizer"):
        RaggedSummary.of(KVSummary(s.keys, s.values, s.log_weights, s.positions, Normalizer(s.keys, s.log_weights, s.positions)))


@pytest.mark.parametrize("weighted", [False, True])
def test_concat_parts_joins_packed_parts_as_the_summaries_they_pack(weighted):
    """`concat_parts` with packed parts anywhere among rectangular ones equals `concat` of the padded summaries they were
    packed from (the compressed summary ends each head with its empty slots, as unpacking does)."""
    keys, values, queries = _layer(b=2, n=90)
    s = kvc.compress("adakv", keys, values, queries, budget=12, sink=0, window=0)
    if weighted:
        s = KVSummary(s.keys, s.values, s.log_weights.masked_fill(s.log_weights == 0, 0.5), s.positions)
    packed = RaggedSummary.of(s)
    exact = KVSummary.exact(keys[:, :, :5], values[:, :, :5], torch.arange(5))
    block = KVSummary.exact(keys[:, :, 85:], values[:, :, 85:], torch.arange(85, 90))
    for parts in ([exact, packed, block], [packed, block], [exact, packed], [packed, exact, packed]):
        got = concat_parts(parts)
        want = concat([s if p is packed else p for p in parts])
        for t in ("keys", "values", "log_weights", "positions"):
            assert torch.equal(getattr(got, t), getattr(want, t)), t
        assert got.eviction_only == want.eviction_only
    assert concat_parts([exact, block]).eviction_only and torch.equal(concat_parts([packed]).keys, s.keys)


def _compressed_cache(model, ctx, mode, **kw):
    options = dict(method="adakv", budget=24, sink=2, window=8, mode=mode, **blocks(mode), **kw)
    return compress_context_ids(model, ctx, **options), options


@pytest.mark.parametrize("mode", ["prefill", "chunked"])
def test_a_cache_stores_only_the_slots_each_head_keeps(mode):
    """Stored bytes = (kept middle slots, summed over heads) x bytes per slot + 4 bytes per head (the counts), plus the
    exact sink and window; strictly less than the longest head times the heads; and the layer keeps H_kv·budget."""
    model = tiny()
    ctx, _ = _prompt(n=300)
    cache, _ = _compressed_cache(model, ctx, mode)
    slot_bytes = 2 * 16 * 4  # a key and a value, head_dim 16, float32
    ragged = 0
    for layer in cache.layers:
        counts = torch.isfinite(layer.stored().log_weights).sum(-1)[0] - 8
        if mode == "prefill":
            assert int(counts.sum()) == 2 * (2 + 24)  # 2 KV heads: sink + middle each, the middle shared out
        else:  # a stream holds between its target and its budget (its slack comes out of the budget)
            target, _ = stream_split(24, DEFAULT_SLACK)
            assert 2 * (2 + target) <= int(counts.sum()) <= 2 * (2 + 24)
        if len(set(counts.tolist())) == 1:  # heads that happen to keep as many: stored as any other method's
            assert not isinstance(layer.front, RaggedSummary)
            continue
        ragged += 1
        front, tail = layer.front, layer.tail
        middle = counts - 2  # the sink starts the exact tail
        assert isinstance(front, RaggedSummary) and torch.equal(front.counts[0], middle.int())
        assert front.nbytes() == int(middle.sum()) * slot_bytes + counts.numel() * 4
        assert front.nbytes() < int(middle.max()) * counts.numel() * slot_bytes
        assert tail.num_slots == 2 + 8 and tail.nbytes() == 2 * (2 + 8) * slot_bytes
        assert layer.nbytes() == front.nbytes() + tail.nbytes()
    assert ragged and cache.nbytes() == sum(layer.nbytes() for layer in cache.layers)


@pytest.mark.parametrize("mode", ["prefill", "chunked"])
def test_save_and_load_answer_as_the_live_cache(tmp_path, mode):
    model = tiny()
    ctx, question = _prompt(n=300)
    cache, options = _compressed_cache(model, ctx, mode)
    reference = generate_ids(model, ctx, question, max_new_tokens=NEW, stop_at_eos=False, **options)
    cache.save(tmp_path / "ada.kvc")
    loaded = kvc.load_cache(tmp_path / "ada.kvc", model)
    assert any(isinstance(layer.front, RaggedSummary) for layer in loaded.layers)
    for mine, theirs in zip(cache.layers, loaded.layers):
        if isinstance(mine.front, RaggedSummary):
            assert isinstance(theirs.front, RaggedSummary)
            for name in ("keys", "values", "positions", "counts"):
                assert torch.equal(getattr(mine.front, name), getattr(theirs.front, name)), name
            assert theirs.nbytes() == mine.nbytes()
        for name in ("keys", "values", "positions", "log_weights"):
            assert torch.equal(getattr(mine.stored(), name), getattr(theirs.stored(), name)), name
    (here,) = answer_from_cache_ids(model, cache, [question], max_new_tokens=NEW, stop_at_eos=False)
    (there,) = answer_from_cache_ids(model, loaded, [question], max_new_tokens=NEW, stop_at_eos=False)
    assert here.token_ids == there.token_ids == reference.token_ids


def test_quantized_storage_packs_the_front():
    """With kv_bits the front is quantized and packed without its empty slots (`QuantizedRaggedSummary`), the sink and the
    window the exact tail: nothing is lost, and the answer at 8 bits starts as at full precision."""
    model = tiny()
    ctx, question = _prompt(n=300)
    cache, options = _compressed_cache(model, ctx, "prefill", kv_bits=8)
    layer = cache.layers[0]
    assert isinstance(layer.front, QuantizedRaggedSummary)
    assert int(torch.isfinite(layer.front.summary().log_weights).sum()) == 2 * 24
    assert layer.tail.positions[0, 0, :2].tolist() == [0, 1] and layer.tail.num_slots == 2 + 8
    full = generate_ids(model, ctx, question, max_new_tokens=NEW, stop_at_eos=False, **{**options, "kv_bits": None})
    quantized = generate_ids(model, ctx, question, max_new_tokens=NEW, stop_at_eos=False, **options)
    assert quantized.token_ids[:4] == full.token_ids[:4] and quantized.kv_bytes < full.kv_bytes


def test_beam_search_reorders_a_ragged_cache():
    model = tiny()
    ctx, _ = _prompt(n=120)
    cache = CompressedCache(model, "adakv", budget=30, sink=2, window=8)
    out = model.generate(ctx, past_key_values=cache, max_new_tokens=6, num_beams=3, do_sample=False)
    assert out.shape == (1, 126) and isinstance(cache.layers[0].front, RaggedSummary)
    assert cache.layers[0].front.counts.shape[0] == 3


def test_decode_after_a_ragged_front_matches_attention_over_the_padded_summary():
    """The ragged front answers as the padded summary would: decode logits over both agree."""
    model = tiny()
    ctx, _ = _prompt(n=200)
    cache = CompressedCache(model, "adakv", budget=20, sink=2, window=8)
    with torch.inference_mode(), use_compressed_attention(model):
        model(ctx, past_key_values=cache)
        padded = CompressedCache(model, "adakv", budget=20, sink=2, window=8)
        assert any(isinstance(layer.front, RaggedSummary) for layer in cache.layers)
        for mine, other in zip(cache.layers, padded.layers):
            stored = mine.stored()
            other.lazy_initialization(stored.keys, stored.values)
            other.front, other.seen, other.budgets = stored, mine.seen, mine.budgets
        a = model(torch.tensor([[5]]), past_key_values=cache).logits
        b = model(torch.tensor([[5]]), past_key_values=padded).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_padded_batch_is_stored_ragged_and_answers_as_each_row_alone():
    from kvcompress.integration import generate_batch_ids

    model = tiny("qwen2")
    contexts = [_prompt(n=n, seed=s)[0] for n, s in ((180, 1), (120, 2))]
    _, question = _prompt(n=10)
    kw = dict(method="adakv", budget=30, sink=2, window=8, max_new_tokens=NEW, stop_at_eos=False)
    batch = generate_batch_ids(model, contexts, question, **kw)
    for ctx, res in zip(contexts, batch):
        assert res.token_ids == generate_ids(model, ctx, question, **kw).token_ids
    ids = torch.cat([torch.cat([torch.zeros(1, 60, dtype=torch.long), contexts[1]], 1), contexts[0]])
    mask = torch.ones_like(ids)
    mask[1, :60] = 0
    cache = CompressedCache(model, "adakv", budget=30, sink=2, window=8)
    with torch.inference_mode():
        model(ids, attention_mask=mask, past_key_values=cache)
    front = cache.layers[0].front
    assert isinstance(front, RaggedSummary) and (front.counts.sum(-1) == 2 * 30).all()  # the sink starts the exact tail
    assert cache.layers[0].tail.num_slots == 2 + 8


# ---------------------------------------------------------------- scope "model": one budget over every layer


def _layers(count=3, seed=0, **kw):
    """Middles of `count` layers of one context, with the SnapKV queries (the same shapes in each)."""
    out = []
    for i in range(count):
        keys, values, queries = _layer(seed=seed + i, **kw)
        b, h, n, _ = keys.shape
        out.append(Tokens(keys, values, torch.arange(n).expand(b, h, n), queries, scale=16**-0.5))
    return out


@pytest.mark.parametrize("alpha", [0.0, 0.2])
def test_model_scope_is_one_top_k_over_every_layers_heads(alpha):
    """compress_layers keeps exactly what `head_allocation` keeps from the scores of every layer's heads side by side:
    L·H_kv·budget middle tokens per row in all, each head at least its safeguard, the layers unequal."""
    method, budget = AdaKV(scope="model", alpha_safeguard=alpha), 20
    layers = _layers()
    layers[2] = Tokens(layers[2].keys * 3, layers[2].values, layers[2].positions, layers[2].queries, scale=layers[2].scale)
    summaries = method.compress_layers(layers, budget, [torch.Generator() for _ in layers])
    scores = torch.cat([method.head_scores(t, torch.Generator())[0] for t in layers], 1)
    expected = head_allocation(scores, budget, method.safeguard(budget)).split(4, 1)
    counts = torch.stack([_middle_counts(s, 0) for s in summaries])  # [L, B, H]
    assert (counts.sum((0, 2)) == 3 * 4 * budget).all()
    assert (counts >= method.safeguard(budget)).all() and len(set(counts.sum((1, 2)).tolist())) > 1
    for tokens, summary, kept in zip(layers, summaries, expected):
        for row in range(2):
            for head in range(4):
                real = torch.isfinite(summary.log_weights[row, head])
                assert torch.equal(summary.positions[row, head][real], tokens.positions[row, head][kept[row, head]])
    one = method.compress_layers(layers[:1], budget, [torch.Generator()])[0]  # one layer: the layer scope
    layer_scope = AdaKV(alpha_safeguard=alpha).compress(layers[0], budget, torch.Generator())
    assert torch.equal(one.positions, layer_scope.positions)


def test_model_scope_in_a_cache_shares_the_budget_across_layers_in_both_prefill_paths():
    """A prefill forward and a recorded prefill (`from_prefill`) give the same stored state: every layer holds its sink and
    window, the middles hold L·H_kv·budget tokens in all, stored ragged; a budget above the context is the full cache."""
    from kvcompress.eval.capture import capture_qkv
    from kvcompress.options import CompressionOptions

    model = tiny()
    ctx, question = _prompt(n=200)
    options = CompressionOptions(method="adakv", budget=40, sink=2, window=8, method_params={"scope": "model"})
    cache = compress_context_ids(model, ctx, options)
    recorded = CompressedCache.from_prefill(model, options, capture_qkv(model, ctx))
    middles = []
    for layer, other in zip(cache.layers, recorded.layers):
        stored = layer.stored()
        assert torch.equal(stored.positions, other.stored().positions) and torch.equal(stored.keys, other.stored().keys)
        kept = torch.isfinite(stored.log_weights).sum(-1)[0]
        middles.append(kept - 2 - 8)
        assert layer.budgets == [40]
    middles = torch.stack(middles)
    assert int(middles.sum()) == len(cache.layers) * 2 * 40 and len(set(middles.sum(-1).tolist())) > 1
    assert any(isinstance(layer.front, RaggedSummary) for layer in cache.layers)
    full = generate_ids(model, ctx, question, method=None, max_new_tokens=NEW, stop_at_eos=False)
    wide = generate_ids(model, ctx, question, dataclasses.replace(options, budget=500), max_new_tokens=NEW, stop_at_eos=False)
    assert wide.token_ids == full.token_ids


def test_model_scope_refuses_streams_and_unknown_scopes_and_runs_a_padded_batch_one_context_at_a_time():
    from kvcompress.integration import generate_batch_ids

    with pytest.raises(ValueError, match=r"scope must be one of \('layer', 'model'\).*got 'layers'"):
        build_method("adakv", scope="layers")
    model = tiny()
    ctx, question = _prompt(n=120)
    for mode in ("chunked", "decode"):
        with pytest.raises(ValueError, match=f"scope='model' runs in mode 'prefill' only, got mode='{mode}'"):
            generate_ids(model, ctx, question, method="adakv", budget=20, mode=mode, scope="model", max_new_tokens=2)
    with pytest.raises(ValueError, match="scope='model' has no stream"):
        kvc.stream("adakv", budget=8, scope="model")
    contexts = [_prompt(n=n, seed=s)[0] for n, s in ((120, 1), (90, 2))]
    kw = dict(method="adakv", budget=20, scope="model", max_new_tokens=2, stop_at_eos=False)
    batch = generate_batch_ids(model, contexts, question, **kw)  # one budget over every layer: each context alone
    for ctx, res in zip(contexts, batch):
        assert res.token_ids == generate_ids(model, ctx, question, **kw).token_ids and res.extra["batch_run"] == "one_by_one"


def test_evicted_summary_holds_each_runs_mean_with_its_count():
    """Each head's evicted tokens, in position order, cut into runs of (nearly) equal count: one slot per run with the
    run's mean key and value, its last position and log-weight log(count); runs with no token are empty slots."""
    from kvcompress.methods.adakv import evicted_summary

    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 20, 4, generator=g), torch.randn(1, 2, 20, 4, generator=g)
    evicted = torch.zeros(1, 2, 20, dtype=torch.bool)
    evicted[0, 0, [1, 3, 5, 7, 9]] = True
    evicted[0, 1, 2] = True
    s = evicted_summary(Tokens(keys, values, torch.arange(20).expand(1, 2, 20)), evicted, 2)
    torch.testing.assert_close(s.keys[0, 0], torch.stack([keys[0, 0, [1, 3, 5]].mean(0), keys[0, 0, [7, 9]].mean(0)]))
    torch.testing.assert_close(s.values[0, 0], torch.stack([values[0, 0, [1, 3, 5]].mean(0), values[0, 0, [7, 9]].mean(0)]))
    torch.testing.assert_close(s.log_weights[0], torch.tensor([[math.log(3), math.log(2)], [0.0, -math.inf]]))
    assert s.positions[0].tolist() == [[5, 9], [2, -1]]
    torch.testing.assert_close(s.keys[0, 1, 0], keys[0, 1, 2])
    assert not s.keys[0, 1, 1].any() and not s.values[0, 1, 1].any()


@pytest.mark.parametrize("scope", ["layer", "model"])
def test_evicted_slots_come_out_of_the_budget_and_never_attend_more_than_the_evicted_tokens(scope):
    """With evicted_slots=E the middles keep L·H_kv·(budget - E) tokens per batch row (each layer's H_kv·(budget - E) in
    scope "layer") and E summary slots per head after them; every token is kept or counted in its head's summary
    slots; for any query a head's summary slots weigh at most what its evicted tokens would (Jensen's inequality)."""
    budget, slots = 20, 3
    layers = _layers()
    method = AdaKV(scope=scope, evicted_slots=slots)
    summaries = (method.compress_layers(layers, budget, [torch.Generator() for _ in layers]) if scope == "model"
                 else [method.compress(t, budget, torch.Generator()) for t in layers])
    g = torch.Generator().manual_seed(5)
    kept_per_row = 0
    for tokens, s in zip(layers, summaries):
        kept_weights, summary_weights = s.log_weights[..., :-slots], s.log_weights[..., -slots:]
        real = torch.isfinite(kept_weights)
        assert (kept_weights[real] == 0).all()
        n = tokens.keys.shape[2]
        assert torch.equal(real.sum(-1) + summary_weights.exp().sum(-1).round().long(), torch.full((2, 4), n))
        if scope == "layer":
            assert (real.sum((-1, -2)) == 4 * (budget - slots)).all()
        kept_per_row = kept_per_row + real.sum((-1, -2))
        for row in range(2):
            for head in range(4):
                q = torch.randn(tokens.keys.shape[-1], generator=g)
                evicted = torch.ones(n, dtype=torch.bool)
                evicted[s.positions[row, head, :-slots][real[row, head]]] = False
                evicted_mass = torch.logsumexp(tokens.keys[row, head][evicted] @ q, 0)
                summary_mass = torch.logsumexp(s.keys[row, head, -slots:] @ q + summary_weights[row, head], 0)
                assert summary_mass <= evicted_mass + 1e-5
    assert (kept_per_row == len(layers) * 4 * (budget - slots)).all()


def test_evicted_slots_in_a_cache_store_the_budget_and_answer_as_the_full_cache_when_nothing_is_evicted():
    """In a prefill-mode cache the layers hold sink, window and H_kv·budget middle slots in all (stored ragged, with
    their log-weights); a budget above the context is the full cache's answer; the streams and too small a budget
    are refused by name."""
    model = tiny()
    ctx, question = _prompt(n=200)
    options = dict(method="adakv", sink=2, window=8, scope="model", evicted_slots=4)
    cache = compress_context_ids(model, ctx, budget=40, **options)
    middles = sum(int(torch.isfinite(layer.stored().log_weights).sum()) - 2 * (2 + 8) for layer in cache.layers)
    assert middles == len(cache.layers) * 2 * 40
    assert any((layer.stored().log_weights > 0).any() for layer in cache.layers)
    full = generate_ids(model, ctx, question, method=None, max_new_tokens=NEW, stop_at_eos=False)
    wide = generate_ids(model, ctx, question, budget=500, max_new_tokens=NEW, stop_at_eos=False, **options)
    assert wide.token_ids == full.token_ids
    for mode in ("chunked", "decode"):
        with pytest.raises(ValueError, match=f"evicted_slots=4 runs in mode 'prefill' only, got mode='{mode}'"):
            generate_ids(model, ctx, question, method="adakv", budget=20, mode=mode, evicted_slots=4, max_new_tokens=2)
    with pytest.raises(ValueError, match="evicted_slots=4 has no stream"):
        kvc.stream("adakv", budget=8, evicted_slots=4)
    with pytest.raises(ValueError, match="evicted_slots=4 leaves no slot to keep tokens in at budget 4 per head"):
        generate_ids(model, ctx, question, budget=4, max_new_tokens=2, **options)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="evicted_slots"):
            build_method("adakv", evicted_slots=bad)
