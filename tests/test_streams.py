"""Block-wise streams with amortised re-compression (`methods.base.BlockwiseState`, issue 17): peak
slots, coverage, the slack=0 equivalence with per-block eviction, validation, the cache's compaction."""

import math
from dataclasses import replace

import pytest
import torch

import kvcompress as kvc
from kvcompress.cache import CompressedCache
from kvcompress.options import CompressionOptions
from kvcompress.integration import use_compressed_attention
from kvcompress.methods.base import make_generator
from kvcompress.methods.budget import DEFAULT_SLACK
from kvcompress.methods.registry import build_method
from kvcompress.methods.tokens import cat_tokens, Tokens
from kvcompress.methods.compactor import Compactor
from test_integration import _prompt, tiny


def _layer(n=600, h=2, hq=4, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, h, n, d, generator=g), torch.randn(1, h, n, d, generator=g)
    return keys, values, torch.randn(1, hq, n, d, generator=g), torch.randn(1, h, n, d, generator=g)


def _feed(st, layer, sizes):
    """Update the stream with consecutive blocks of the given sizes (cycled) until the layer is used up; yields after each."""
    keys, values, queries, pre = layer
    start, i = 0, 0
    while start < keys.shape[2]:
        sl = slice(start, start + sizes[i % len(sizes)])
        st.update(keys[:, :, sl], values[:, :, sl], queries[:, :, sl], pre_rope_keys=pre[:, :, sl], layer_idx=0, num_layers=1)
        start, i = min(sl.stop, keys.shape[2]), i + 1
        yield start


@pytest.mark.parametrize("method", ["keydiff", "snapkv", "h2o", "compactor", "pyramidkv"])
@pytest.mark.parametrize("slack", [0.0, 0.25, 1.0])
def test_peak_slots_are_budget_plus_slack_plus_block(method, slack):
    budget, block = 64, 16
    st = kvc.stream(method, budget=budget, sink=0, window=0, slack=slack)
    extra = math.ceil(slack * budget)
    for seen in _feed(st, _layer(), [block]):
        held = st.state.summary().num_slots
        assert held <= budget + extra
        assert held == min(seen, held)  # nothing is lost before the first re-compression
        assert st.nbytes() >= st.summary().nbytes()  # the reserved buffer is reported, never less than what is held
    # blocks of 16 fill the buffer exactly to budget + slack before the block that triggers re-compression
    assert st.state.peak_slots == budget + extra + block
    st.compact()
    assert st.summary().num_slots == budget
    # per slot and head: keys, values and pre-RoPE keys (float32), position (int64), log-weight (+ Compactor's attention score)
    per_slot = 2 * (3 * 16 * 4 + 8 + 4 + (4 if method == "compactor" else 0))
    assert st.nbytes() <= (budget + 64) * per_slot  # the room reserved for more blocks is given back


def test_reserved_bytes_cover_the_peak_and_the_previous_per_block_peak_is_smaller():
    layer = _layer()
    reports = {}
    for slack in (0.0, 0.5):
        st = kvc.stream("knorm", budget=64, sink=0, window=0, slack=slack)
        reports[slack] = max(st.nbytes() for _ in _feed(st, layer, [16]))
        per_slot = 2 * 16 * 4 * 2  # keys + values (fp32), 2 heads: the KV bytes
        assert reports[slack] >= st.state.peak_slots * per_slot - 16 * per_slot  # everything held plus room for the next block
    assert reports[0.5] > reports[0.0]


def test_each_token_takes_part_in_few_recompressions(monkeypatch):
    """The work is linear: with slack s, n tokens in single-token blocks cause about n / (s·budget) re-compressions."""
    calls = []
    method = build_method("keydiff")
    original = type(method).compress
    monkeypatch.setattr(type(method), "compress", lambda self, tokens, budget, gen: calls.append(tokens.length) or original(self, tokens, budget, gen))
    budget, n = 40, 400
    st = kvc.stream("keydiff", budget=budget, sink=0, window=0, slack=0.5)
    layer = _layer(n=n)
    for _ in _feed(st, layer, [1]):
        pass
    assert len(calls) == math.ceil((n - budget - 20) / 20)  # first at budget + 20 + 1 tokens, then every 20
    assert max(calls) == budget + 20 + 1
    calls.clear()
    st = kvc.stream("keydiff", budget=budget, sink=0, window=0, slack=0)
    for _ in _feed(st, layer, [1]):
        pass
    assert len(calls) == n - budget  # slack 0: one re-compression per token past the budget


def _per_block_reference(method_name, layer, budget, block, seed=0):
    """The previous block-wise stream: concatenate what is kept with the block, evict back to budget after every block."""
    method = build_method(method_name)
    gen = make_generator(seed)
    keys, values, queries, _ = layer
    kept = None
    for start in range(0, keys.shape[2], block):
        sl = slice(start, start + block)
        pos = torch.arange(sl.start, min(sl.stop, keys.shape[2])).expand(1, keys.shape[1], -1)
        tokens = Tokens(keys[:, :, sl], values[:, :, sl], pos, queries[:, :, sl], None, keys.shape[-1] ** -0.5, query_positions=pos[0, 0])
        buffer = tokens if kept is None else cat_tokens([kept, tokens])
        if buffer.length > budget:
            s = method.compress(buffer, budget, gen)
            buffer = replace(buffer, keys=s.keys, values=s.values, positions=s.positions)
        kept = buffer
    return kept.positions


@pytest.mark.parametrize("method", ["keydiff", "snapkv", "tova", "h2o", "knorm"])
def test_slack_zero_is_per_block_eviction(method):
    layer = _layer(n=400)
    st = kvc.stream(method, budget=50, sink=0, window=0, slack=0)
    keys, values, queries, _ = layer
    for start in range(0, 400, 32):
        sl = slice(start, start + 32)
        st.update(keys[:, :, sl], values[:, :, sl], queries[:, :, sl])
    assert torch.equal(st.state.summary().positions, _per_block_reference(method, layer, 50, 32))


def test_compactor_slack_zero_is_per_block_eviction():
    """The previous Compactor stream: raw attention scores kept beside the tokens, leverage recomputed and top-k taken after every block."""
    keys, values, queries, pre = _layer(n=384)
    budget, block = 100, 64
    st = kvc.stream("compactor", budget=budget, slack=0, seed=3)
    method, gen = Compactor(), make_generator(3)
    held_pos = held_pre = attn = None
    for start in range(0, 384, block):
        sl = slice(start, start + block)
        st.update(keys[:, :, sl], values[:, :, sl], queries[:, :, sl], pre_rope_keys=pre[:, :, sl], layer_idx=0, num_layers=1)
        pos = torch.arange(start, start + block).expand(1, 2, -1)
        tokens = Tokens(keys[:, :, sl], values[:, :, sl], pos, queries[:, :, sl], pre[:, :, sl], 0.25, query_positions=pos[0, 0])
        a = method.attention_scores(tokens)
        held_pos = pos if held_pos is None else torch.cat([held_pos, pos], 2)
        held_pre = pre[:, :, sl] if held_pre is None else torch.cat([held_pre, pre[:, :, sl]], 2)
        attn = a if attn is None else torch.cat([attn, a], 2)
        if held_pos.shape[2] > budget:
            index = method.blend(attn, held_pre, gen).topk(budget, dim=-1).indices.sort(dim=-1).values
            held_pos, attn = held_pos.gather(2, index), attn.gather(2, index)
            held_pre = held_pre.gather(2, index[..., None].expand(-1, -1, -1, 16))
    assert torch.equal(st.summary().positions, held_pos)


@pytest.mark.parametrize("slack", [0.0, 0.25, 1.0])
def test_hybrid_stream_covers_every_token(slack):
    layer = _layer(n=700)
    budget = 120
    st = kvc.stream("hybrid", budget=budget, slack=slack, seed=1)
    n_exact = sum(st.method.split_budget(budget)[0])
    for seen in _feed(st, layer, [48, 16, 100]):
        s = st.summary()
        torch.testing.assert_close(s.total_weight(), torch.full((1, 2), float(seen), dtype=torch.float64), rtol=1e-5, atol=1e-3)
        assert bool((s.positions.diff(dim=-1) > 0).all())  # each token once, in order
        assert st.state.slots.length <= n_exact + math.ceil(slack * budget)  # exact slots held between updates
    st.compact()
    plain = (st.summary().log_weights == 0).sum(-1)
    assert bool((plain >= n_exact).all())


def test_hybrid_slack_zero_reselects_after_every_block():
    """slack=0: once past the budget, the exact set is re-selected after every block (never holding more than its
    share) and its evictions go to the coreset stream, so the weights add up to the tokens seen."""
    keys, values, queries, pre = _layer(n=320)
    budget, block = 80, 40
    st = kvc.stream("hybrid", budget=budget, sink=0, window=0, slack=0, seed=5)
    counts, _ = build_method("hybrid").split_budget(budget)
    for start in range(0, 320, block):
        sl = slice(start, start + block)
        st.update(keys[:, :, sl], values[:, :, sl], queries[:, :, sl], pre_rope_keys=pre[:, :, sl], layer_idx=0, num_layers=1)
        s = st.summary()
        assert torch.allclose(s.total_weight(), torch.full(s.total_weight().shape, start + block, dtype=torch.float64))
        if start + block > budget:
            assert st.state.held().length <= sum(counts)
            assert st.state.coreset.summary() is not None


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), True, "0.5", None])
def test_slack_is_validated_by_name(bad):
    if bad is None:  # None means the default
        assert kvc.stream("keydiff", budget=8).state.slack_slots == math.ceil(DEFAULT_SLACK * 8)
        return
    with pytest.raises(ValueError, match=r"slack must be a finite number >= 0.*got"):
        kvc.stream("keydiff", budget=8, slack=bad)


def test_slack_for_a_native_stream_or_prefill_is_an_error():
    with pytest.raises(ValueError, match="slack=0.5: method 'express' streams natively"):
        kvc.stream("express", budget=64, slack=0.5)
    kvc.stream("express", budget=64)  # the default is fine
    with pytest.raises(ValueError, match="slack=0.5 sets how streams re-compress.*not 'prefill'"):
        CompressionOptions(method="knorm", mode="prefill", budget=8, slack=0.5)
    with pytest.raises(ValueError, match="streams natively"):
        CompressionOptions(method="subgen", mode="chunked", budget=64, slack=0.5)
    with pytest.raises(ValueError, match="slack must be"):
        CompressionOptions(method="knorm", mode="decode", budget=8, slack=-1)


def test_chunked_cache_holds_the_slack_while_absorbing_and_compacts_at_the_end():
    model = tiny()
    ctx, _ = _prompt(n=300)
    budget, sink, window = 40, 2, 8
    cache = CompressedCache(model, "knorm", budget=budget, sink=sink, window=window, mode="chunked", slack=0.5)
    held = []
    with use_compressed_attention(model), torch.no_grad():
        for start in range(0, 300, 16):
            model(ctx[:, start : start + 16], past_key_values=cache)
            held.append(cache.layers[0].slots())
        assert max(held) <= sink + budget + 20 + window
        assert max(held) > sink + budget + window  # the slack is used between re-compressions
        cache.absorbing = False
        assert [layer.slots() for layer in cache.layers] == [sink + budget + window] * 2
        assert cache.peak_bytes() >= cache.nbytes()


def test_generate_passes_slack_to_the_cache():
    from kvcompress.integration.generation import generate_ids

    model = tiny()
    ctx, question = _prompt(n=300)
    common = dict(method="knorm", budget=40, sink=2, window=8, mode="chunked", chunk_size=16, max_new_tokens=2)
    tight = generate_ids(model, ctx, question, slack=0.0, **common)
    loose = generate_ids(model, ctx, question, slack=1.0, **common)
    assert loose.peak_kv_bytes > tight.peak_kv_bytes  # the slack is held between re-compressions
    assert loose.kv_bytes == tight.kv_bytes  # both compacted to the budget when the prompt ends
    with pytest.raises(ValueError, match="slack=0.5 sets how streams re-compress.*not 'prefill'"):
        generate_ids(model, ctx, question, **{**common, "mode": "prefill"}, slack=0.5)
    with pytest.raises(ValueError, match="method=None is the full cache: it takes no slack"):
        generate_ids(model, ctx, question, method=None, slack=0.5)


@pytest.mark.parametrize("method", ["random", "clustergen"])
def test_weighted_blockwise_streams_keep_their_weights(method):
    """weighted=True through a block-wise stream: the kept slots carry weights summing to the tokens seen, as one-shot's do
    (they once came back as plain slots, every log-weight 0, total = budget)."""
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 400, 8, generator=g), torch.randn(1, 2, 400, 8, generator=g)
    st = kvc.stream(method, budget=40, sink=0, window=0, weighted=True)
    for start in range(0, 400, 25):
        st.update(keys[:, :, start : start + 25], values[:, :, start : start + 25])
        total = st.summary().total_weight()
        assert torch.allclose(total, torch.full_like(total, start + 25.0), rtol=1e-5)
    st.compact()
    s = st.summary()
    assert s.num_slots == 40 and bool((s.log_weights > 0).any())
    assert torch.allclose(s.total_weight(), torch.full((1, 2), 400.0, dtype=torch.float64), rtol=1e-5)
