"""Block-wise streams with amortised re-compression (`methods.base.BlockwiseState`, issue 17): peak
slots, coverage, the slack=0 equivalence with per-block eviction, validation, the cache's compaction."""

import math
from dataclasses import replace

import pytest
import torch

import kvcompress as kvc
from kvcompress.cache import CompressedCache
from kvcompress.options import CompressionOptions
from kvcompress.ragged import RaggedSummary
from kvcompress.integration import use_compressed_attention
from kvcompress.methods.base import make_generator
from kvcompress.methods.stream import Stream
from kvcompress.methods.budget import DEFAULT_SLACK, stream_split
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


@pytest.mark.parametrize("kv_bits", [None, 4])
def test_a_stream_refuses_a_shallow_copy_and_deep_copies_continue_alone(kv_bits):
    """copy.copy would share a stream's state with the original (updating the copy corrupted the original: wrong
    summaries, IndexError, a quantized buffer's RuntimeError): refused, naming copy.deepcopy. A deep copy or a pickled
    stream taken mid-stream and the original, fed the same blocks apart, end as a stream never copied, every method."""
    import copy
    import pickle

    layer = _layer(n=160)
    half = tuple(t[:, :, :96] for t in layer)
    rest = tuple(t[:, :, 96:] for t in layer)
    for method in [m for m in kvc.methods() if m not in ("kvzip", "kvzap")]:  # KVzip has no stream; KVzap reads hidden states
        window = 0 if method in ("compactor", "hybrid") else 8  # they score a token with its own query
        reference, original = (kvc.stream(method, budget=24, sink=2, window=window, seed=1, kv_bits=kv_bits) for _ in range(2))
        list(_feed(reference, layer, [16]))
        list(_feed(original, half, [16]))
        with pytest.raises(TypeError, match=r"cannot be shallow-copied.*copy\.deepcopy\(stream\)"):
            copy.copy(original)
        copies = [copy.deepcopy(original), pickle.loads(pickle.dumps(original))]
        for stream in (*copies, original):
            list(_feed(stream, rest, [16]))
            got, want = stream.summary(), reference.summary()
            assert torch.equal(got.keys, want.keys) and torch.equal(got.log_weights, want.log_weights), (method, kv_bits)


@pytest.mark.parametrize("method", ["keydiff", "snapkv", "h2o", "compactor", "pyramidkv"])
@pytest.mark.parametrize("slack", [0.0, 0.25, 1.0])
def test_peak_slots_stay_within_the_budget(method, slack):
    """The slack and the block being absorbed come out of the budget (`budget.stream_split`): the buffer a
    re-compression scores never holds more than `budget` slots, whatever the block size."""
    budget, block = 64, 16
    st = kvc.stream(method, budget=budget, sink=0, window=0, slack=slack)
    target, room = stream_split(budget, slack)
    assert (st.state.target, st.state.slack_slots) == (target, room) and target + room == budget
    for seen in _feed(st, _layer(), [block]):
        held = st.state.summary().num_slots
        assert held <= budget or method == "pyramidkv" and held <= st.state.limit + room
        assert seen > budget or held == seen  # nothing is lost before the first re-compression
        assert st.nbytes() >= st.summary().nbytes()  # the reserved buffer is reported, never less than what is held
    assert st.state.peak_slots == budget if method != "pyramidkv" else st.state.peak_slots <= st.state.limit + room
    st.compact()
    assert st.summary().num_slots <= max(budget, st.state.limit)
    # per slot and head: keys, values and pre-RoPE keys (float32) (+ Compactor's attention score column: not KV)
    per_slot = 2 * 3 * 16 * 4
    assert st.nbytes() <= max(budget, st.state.limit) * per_slot  # the room reserved for more blocks is given back


@pytest.mark.parametrize("block", [1, 5, 16, 100])
def test_a_block_larger_than_the_room_is_taken_in_pieces(block):
    st = kvc.stream("knorm", budget=64, sink=0, window=0, slack=0.5)
    per_slot = 3 * 16 * 4 * 2  # keys, values and the pre-RoPE keys given (fp32), 2 heads: the KV bytes
    for _ in _feed(st, _layer(), [block]):
        assert st.nbytes() <= 64 * per_slot
        assert st.state.peak_slots <= 64


def test_reserved_bytes_stay_within_the_budget_for_any_slack():
    layer = _layer()
    per_slot = 3 * 16 * 4 * 2  # keys, values and the pre-RoPE keys given (fp32), 2 heads: the KV bytes
    for slack in (0.0, 0.5, 2.0):
        st = kvc.stream("knorm", budget=64, sink=0, window=0, slack=slack)
        assert max(st.nbytes() for _ in _feed(st, layer, [16])) <= 64 * per_slot


def test_a_budget_without_room_for_the_stream_is_an_error():
    with pytest.raises(ValueError, match="re-compressing stream needs a middle budget >= 2"):
        kvc.stream("keydiff", budget=1)
    with pytest.raises(ValueError, match=r"does not leave the middle budget of 2 per KV head that streaming keydiff needs"):
        CompressionOptions.build(method="keydiff", mode="decode", compression_ratio=0.9, sink=0, window=0).budget_for(5)


def test_each_token_takes_part_in_few_recompressions(monkeypatch):
    """The work is linear: with slack s, n tokens in single-token blocks cause about n / room re-compressions, room =
    budget - floor(budget / (1 + s))."""
    calls = []
    method = build_method("keydiff")
    original = type(method).compress
    monkeypatch.setattr(type(method), "compress", lambda self, tokens, budget, gen: calls.append(tokens.length) or original(self, tokens, budget, gen))
    budget, n = 40, 400
    st = kvc.stream("keydiff", budget=budget, sink=0, window=0, slack=0.5)
    layer = _layer(n=n)
    for _ in _feed(st, layer, [1]):
        pass
    assert st.state.target == 26
    assert len(calls) == math.ceil((n - budget) / 14)  # first at budget + 1 tokens, then every 14
    assert max(calls) == budget
    calls.clear()
    st = kvc.stream("keydiff", budget=budget, sink=0, window=0, slack=0)
    for _ in _feed(st, layer, [1]):
        pass
    assert len(calls) == n - budget  # slack 0: one re-compression per token past the budget


def _per_block_reference(method_name, layer, budget, block, seed=0):
    """Per-block eviction: before a block that does not fit budget + block, evict what is held back to budget (scored
    with the latest block's queries), then append the block."""
    method = build_method(method_name)
    gen = make_generator(seed)
    keys, values, queries, _ = layer
    kept = None
    for start in range(0, keys.shape[2], block):
        sl = slice(start, start + block)
        pos = torch.arange(sl.start, min(sl.stop, keys.shape[2])).expand(1, keys.shape[1], -1)
        tokens = Tokens(keys[:, :, sl], values[:, :, sl], pos, queries[:, :, sl], None, keys.shape[-1] ** -0.5, query_positions=pos[0, 0])
        if kept is not None and kept.length + tokens.length > budget + block:
            s = method.compress(kept, budget, gen)
            kept = replace(kept, keys=s.keys, values=s.values, positions=s.positions)
        kept = tokens if kept is None else cat_tokens([kept, tokens])
    return kept.positions


@pytest.mark.parametrize("method", ["keydiff", "snapkv", "tova", "h2o", "knorm"])
def test_a_room_of_one_block_is_per_block_eviction(method):
    """Budget 82 with slack 0.64: target 50 and a room of 32, one block: KeyDiff's block prompt processing at a cache
    budget of 50 (its peak, 50 + the block, is the stream's budget)."""
    layer = _layer(n=400)
    st = kvc.stream(method, budget=82, sink=0, window=0, slack=0.64)
    assert (st.state.target, st.state.slack_slots) == (50, 32)
    keys, values, queries, _ = layer
    for start in range(0, 400, 32):
        sl = slice(start, start + 32)
        st.update(keys[:, :, sl], values[:, :, sl], queries[:, :, sl])
    assert torch.equal(st.state.summary().positions, _per_block_reference(method, layer, 50, 32))


def test_compactor_room_of_one_block_is_per_block_eviction():
    """The previous Compactor stream: raw attention scores kept beside the tokens, leverage recomputed and top-k taken after
    every block (a stream of budget 164 = target 100 + a room of one block of 64)."""
    keys, values, queries, pre = _layer(n=384)
    budget, block = 100, 64
    st = kvc.stream("compactor", budget=budget + block, slack=0.64, seed=3)
    assert st.state.target == budget
    method, gen = Compactor(), make_generator(3)
    held_pos = held_pre = attn = None
    for start in range(0, 384, block):
        sl = slice(start, start + block)
        st.update(keys[:, :, sl], values[:, :, sl], queries[:, :, sl], pre_rope_keys=pre[:, :, sl], layer_idx=0, num_layers=1)
        pos = torch.arange(start, start + block).expand(1, 2, -1)
        tokens = Tokens(keys[:, :, sl], values[:, :, sl], pos, queries[:, :, sl], pre[:, :, sl], 0.25, query_positions=pos[0, 0])
        a = method.attention_scores(tokens)
        if held_pos is not None and held_pos.shape[2] > budget:  # the block does not fit budget + block: evict first
            index = method.blend(attn, held_pre, gen).topk(budget, dim=-1).indices.sort(dim=-1).values
            held_pos, attn = held_pos.gather(2, index), attn.gather(2, index)
            held_pre = held_pre.gather(2, index[..., None].expand(-1, -1, -1, 16))
        held_pos = pos if held_pos is None else torch.cat([held_pos, pos], 2)
        held_pre = pre[:, :, sl] if held_pre is None else torch.cat([held_pre, pre[:, :, sl]], 2)
        attn = a if attn is None else torch.cat([attn, a], 2)
    assert torch.equal(st.summary().positions, held_pos)


@pytest.mark.parametrize("slack", [0.0, 0.25, 1.0])
def test_hybrid_stream_covers_every_token(slack):
    layer = _layer(n=700)
    budget = 120
    st = kvc.stream("hybrid", budget=budget, slack=slack, seed=1)
    target, room = stream_split(budget, slack)
    n_exact = sum(st.method.split_budget(target)[0])
    assert st.state.target == n_exact and st.state.budget == n_exact + room
    for seen in _feed(st, layer, [48, 16, 100]):
        s = st.summary()
        torch.testing.assert_close(s.total_weight(), torch.full((1, 2), float(seen), dtype=torch.float64), rtol=1e-5, atol=1e-3)
        assert bool((s.positions.diff(dim=-1) > 0).all())  # each token once, in order
        assert st.state.slots.length <= n_exact + room  # exact slots held: the exact set's share and the room
        assert st.state.nbytes() <= budget * 2 * 2 * 16 * 4 * 1.5  # keys, values (and pre-RoPE keys of the exact set)
    st.compact()
    plain = (st.summary().log_weights == 0).sum(-1)
    assert bool((plain >= n_exact).all())


def test_hybrid_room_of_one_block_reselects_after_every_block():
    """A room of one block: once past the budget, the exact set is re-selected after every block (never holding more
    than its share after it) and its evictions go to the coreset stream, so the weights add up to the tokens seen."""
    keys, values, queries, pre = _layer(n=320)
    budget, block = 80, 40
    st = kvc.stream("hybrid", budget=budget + block, sink=0, window=0, slack=0.5, seed=5)
    assert stream_split(budget + block, 0.5) == (budget, block)
    counts, _ = build_method("hybrid").split_budget(budget)
    for start in range(0, 320, block):
        sl = slice(start, start + block)
        st.update(keys[:, :, sl], values[:, :, sl], queries[:, :, sl], pre_rope_keys=pre[:, :, sl], layer_idx=0, num_layers=1)
        s = st.summary()
        assert torch.allclose(s.total_weight(), torch.full(s.total_weight().shape, start + block, dtype=torch.float64))
        if st.exact is None and st.state.seen > budget + block:  # handed to the state and re-selected at least once
            assert st.state.held().length <= sum(counts) + block  # its share, then the block that followed
            assert st.state.coreset.summary() is not None


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), True, "0.5", None])
def test_slack_is_validated_by_name(bad):
    if bad is None:  # None means the default
        assert kvc.stream("keydiff", budget=9).state.slack_slots == 9 - math.floor(9 / (1 + DEFAULT_SLACK))
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
        assert max(held) <= sink + budget + window  # the slack is used within the budget
        assert min(held[-5:]) < sink + budget + window  # compressed back to the target, then filled again
        cache.absorbing = False
        assert all(sink + 27 + window <= layer.slots() <= sink + budget + window for layer in cache.layers)
        assert cache.peak_bytes() >= cache.nbytes()


def test_a_chunked_cache_under_model_generate_streams_the_prompt_and_keeps_the_answer_exact():
    """A chunked cache built by name under `model.generate(..., prefill_chunk_size=N)`: the prompt streams in blocks of N
    and ends at the first step (the answer's tokens stay exact, as when the caller ends the prompt itself before
    its first step), with the peak of a block, not of the prompt; the same tokens as feeding the blocks by hand."""
    model = tiny()
    ctx, _ = _prompt(n=200)
    new = 6
    settings = dict(budget=24, sink=2, window=4, mode="chunked")
    cache = CompressedCache(model, "knorm", **settings)
    out = model.generate(ctx, attention_mask=torch.ones_like(ctx), past_key_values=cache, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, prefill_chunk_size=32)
    assert not cache.absorbing
    for layer in cache.layers:  # the prompt compressed and stored, then the answer's tokens (all but the last) exact
        stored = layer.stored()
        answer = stored.positions[..., -(new - 1):]
        assert not isinstance(layer.front, Stream) and layer.slots() <= settings["sink"] + settings["budget"] + settings["window"] + new - 1
        assert (answer == torch.arange(200, 200 + new - 1)).all() and (stored.log_weights[..., -(new - 1):] == 0).all()
    one_forward = CompressedCache(model, "knorm", **settings)
    model.generate(ctx, attention_mask=torch.ones_like(ctx), past_key_values=one_forward, max_new_tokens=2, do_sample=False)
    assert cache.peak_bytes() < one_forward.peak_bytes() / 3
    by_hand = CompressedCache(model, "knorm", **settings)
    ids = []
    with use_compressed_attention(model), torch.no_grad():
        for start in range(0, 200, 32):
            logits = model(ctx[:, start : start + 32], past_key_values=by_hand).logits
        by_hand.absorbing = False
        for _ in range(new):
            ids.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([ids[-1:]]), past_key_values=by_hand).logits
    assert out[0, 200:].tolist() == ids


@pytest.mark.parametrize("name, value", [("chunk_size", 64), ("compress_question", True), ("prefill_approx", "express")])
def test_a_cache_refuses_the_settings_of_how_kvc_generate_feeds_a_prompt(name, value):
    with pytest.raises(ValueError, match=rf"CompressedCache\(\.\.\., {name}=.*feeds nothing itself"):
        CompressedCache(tiny(), "knorm", budget=24, mode="chunked", **{name: value})


def test_a_layers_slots_are_counted_part_by_part_as_its_unpacked_state_counts_them(tiny_default_scorer):
    """`slots` reads each stored part (a stream's packed kept tokens, its buffer, the sink and window) without unpacking:
    the same count as the finite log-weights of the whole `stored()` summary, per row and over the batch (AdaKV over
    KVzap's scores, which stream a batch's rows apart)."""
    model = tiny()
    ctx = torch.cat([_prompt(n=200, seed=2)[0], _prompt(n=200, seed=3)[0]])
    cache = CompressedCache(model, "adakv", method_params={"scorer": "kvzap"}, budget=24, sink=2, window=4, mode="chunked", slack=0.5)
    with use_compressed_attention(model), torch.no_grad():
        for start in range(0, 200, 32):
            model(ctx[:, start : start + 32], past_key_values=cache)
            for layer in cache.layers:
                occupied = torch.isfinite(layer.stored().log_weights).float().sum(-1)
                assert [layer.slots(row) for row in (0, 1)] == [int(occupied[row].mean().round()) for row in (0, 1)]
                assert layer.slots() == int(occupied.mean().round())
        assert any(isinstance(part, RaggedSummary) for layer in cache.layers for part in layer._stored_parts())


def test_generate_passes_slack_to_the_cache():
    from kvcompress.integration.generation import generate_ids

    model = tiny()
    ctx, question = _prompt(n=300)
    common = dict(method="knorm", budget=40, sink=2, window=8, mode="chunked", chunk_size=16, max_new_tokens=2)
    tight = generate_ids(model, ctx, question, slack=0.0, **common)
    loose = generate_ids(model, ctx, question, slack=1.0, **common)
    assert loose.peak_kv_bytes == tight.peak_kv_bytes  # the slack comes out of the budget: the same peak
    assert loose.kv_bytes <= tight.kv_bytes  # slack 1 compresses back to half the budget, slack 0 to budget - 1
    with pytest.raises(ValueError, match="slack=0.5 sets how streams re-compress.*not 'prefill'"):
        generate_ids(model, ctx, question, **{**{k: v for k, v in common.items() if k != "chunk_size"}, "mode": "prefill"}, slack=0.5)
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
    assert s.num_slots <= 40 and bool((s.log_weights > 0).any())
    assert torch.allclose(s.total_weight(), torch.full((1, 2), 400.0, dtype=torch.float64), rtol=1e-5)


def test_a_stream_keeps_its_blocks_queries_only_for_a_method_that_reads_them():
    """Stream.update drops the queries of a method whose requirements do not name them (KeyDiff), so its state never
    holds them; SnapKV, which scores with them, keeps its latest block's; the window keeps its tokens without them."""
    from kvcompress.methods.registry import build_method

    keys, values, queries = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 4, 40, 8)
    for name, holds in (("keydiff", False), ("snapkv", True)):
        stream = Stream(build_method(name), 16, 2, 4, make_generator(0))
        stream.update(keys, values, queries)
        assert (stream.state.last.queries is not None) == holds, name
        assert stream.recent.queries is None


@pytest.mark.parametrize("method", ["snapkv", "keydiff"])
def test_the_sink_keeps_its_tokens_not_the_first_blocks_storage_or_queries(method):
    """The sink is copied out of the first block without the block's queries: a view held the whole block's keys and
    values, and its queries were held (and saved with a decode-mode cache) for as long as the stream lived."""
    g = torch.Generator().manual_seed(0)
    keys, values, queries = (torch.randn(1, 2, 256, 16, generator=g) for _ in range(3))
    st = kvc.stream(method, budget=32, sink=4, window=8)
    st.update(keys, values, queries)
    assert st.head.queries is None and st.head.query_positions is None
    for name in ("keys", "values"):
        kept = getattr(st.head, name)
        assert torch.equal(kept, {"keys": keys, "values": values}[name][:, :, :4])
        assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()  # its own 4 tokens, not the block's 256


@pytest.mark.parametrize("method", ["snapkv", "adakv", "compactor"])
def test_a_blockwise_state_keeps_its_latest_blocks_queries_not_its_tokens(method):
    """The latest block is kept to score what is held at the next re-compression: its queries and exact neighbours.
    Its keys and values are in the state's slots; kept again with the block they doubled what a decode-mode cache held
    and saved, uncounted."""
    g = torch.Generator().manual_seed(0)
    keys, values, queries = (torch.randn(1, 2, 256, 16, generator=g) for _ in range(3))
    window = 0 if method == "compactor" else 8  # Compactor scores each token with its own query: no exact window
    st = kvc.stream(method, budget=32, sink=4, window=window)
    pre_rope = (lambda n: {"pre_rope_keys": keys[:, :, :n]}) if method == "compactor" else (lambda n: {})
    st.update(keys, values, queries, **pre_rope(256))
    last = st.state.last
    assert last.length == 0 and last.queries is not None
    assert last.keys.untyped_storage().nbytes() == 0 and last.values.untyped_storage().nbytes() == 0
    st.update(keys[:, :, :3], values[:, :, :3], queries[:, :, :3], **pre_rope(3))  # and it goes on
    assert st.summary().num_slots <= 4 + 32 + window


@pytest.mark.parametrize("method, read", [("snapkv", 32), ("pyramidkv", 32), ("tova", 1), ("adakv", 32), ("expected_attention", 512),
                                          ("h2o", None), ("compactor", None)])
def test_a_stream_keeps_only_the_queries_its_method_reads(method, read, monkeypatch):
    """Between blocks a stream state keeps the latest block's queries to score what it holds: only the last
    `Method.queries_read` of them (SnapKV's observation window, TOVA's last query), copied, and the summaries are the
    ones a stream keeping every query gives."""
    from kvcompress.methods.base import Method

    g = torch.Generator().manual_seed(0)
    n = 900
    keys, values, pre = (torch.randn(1, 2, n, 16, generator=g) for _ in range(3))
    queries = torch.randn(1, 4, n, 16, generator=g)
    window = 0 if method == "compactor" else 8

    def run() -> "Stream":
        st = kvc.stream(method, budget=40, sink=2, window=window, seed=0)
        for start in range(0, n, 100):
            block = slice(start, start + 100)
            st.update(keys[:, :, block], values[:, :, block], queries[:, :, block], layer_idx=1, num_layers=4,
                      **({"pre_rope_keys": pre[:, :, block]} if method == "compactor" else {}))
        return st

    kept = run()
    assert kept.state.method.queries_read == read
    held = kept.state.last.queries
    assert held.shape[2] == min(100, read or 100)
    if read is not None and read < 100:  # copied, not a view of the block's queries
        assert held.untyped_storage().nbytes() == held.numel() * held.element_size()
    for cls in {type(kept.state.method), Method}:
        monkeypatch.setattr(cls, "queries_read", property(lambda self: None))
    every = run()
    assert every.state.last.queries.shape[2] == 100
    a, b = kept.summary(), every.summary()
    assert torch.equal(a.positions, b.positions) and torch.equal(a.keys, b.keys) and torch.equal(a.log_weights, b.log_weights)


def test_a_stream_whose_layer_shares_need_its_length_is_refused_when_the_cache_is_built(tiny_default_scorer):
    """The default (AdaKV over KVzap, one budget over the model) shares a stream's budget among the layers by the
    fraction of the stream kept: built with a budget and no stream_length, the cache is refused there, not in the
    middle of its first forward; with stream_length, or a layer scope, it streams."""
    model = tiny()
    with pytest.raises(ValueError, match=r"give the cache the stream's length \(CompressedCache\(\.\.\., stream_length=N\)\)"):
        CompressedCache(model, "default", mode="chunked", budget=40)
    for cache in (CompressedCache(model, "default", mode="chunked", budget=40, stream_length=200),
                  CompressedCache(model, "adakv", method_params={"scorer": "kvzap", "scope": "layer"}, mode="chunked", budget=40)):
        with use_compressed_attention(model), torch.no_grad():
            model(_prompt(n=64)[0], past_key_values=cache)
        assert cache.layers[0].seen == 64
