"""Quantized storage of kept slots (issue 37): KIVI's per-channel keys and per-token values, packed codes, honest
byte counts, the options that ask for it, and how a quantized cache composes with the modes, padding and beams."""

import math

import pytest
import torch

import kvcompress as kvc
from registered import SHARED
from kvcompress.cache import CompressedCache
from kvcompress.integration import generate_batch_ids, generate_ids
from kvcompress.options import CompressionOptions
from kvcompress.methods.budget import DEFAULT_SLACK, stream_split
from kvcompress.methods.registry import build_method
from kvcompress.quantization import DEFAULT_GROUP_SIZE, QuantizedRaggedSummary, QuantizedSummary, _pack, _unpack, quantize
from kvcompress.ragged import RaggedSummary
from kvcompress.summary import KVSummary, Normalizer, concat, split_exact_ends, take_slots

from test_integration import _prompt, blocks, tiny

BITS = [8, 4, 2]


def _x(shape=(2, 3, 100, 64), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * torch.linspace(0.1, 4.0, shape[-1])).to(dtype)  # channels of different ranges


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("d", [64, 10, 7])
def test_codes_pack_into_bytes_and_back(bits, d):
    codes = torch.randint(0, 1 << bits, (2, 3, 5, d), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = _pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 5, math.ceil(d * bits / 8))
    assert torch.equal(_unpack(packed, bits, d), codes)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_every_element_is_within_half_a_step_of_its_group(bits, axis):
    """x ≈ code·scale + zero, each element within half its group's step (float32 rounding aside)."""
    x = _x()
    q = quantize(x, bits, 32, axis)
    n, d = x.shape[2], x.shape[3]
    if axis == "channel":  # keys: a group is 32 consecutive slots of one channel
        assert q.scale.shape == (2, 3, math.ceil(n / 32), d)
        step = q.scale.repeat_interleave(32, dim=2)[:, :, :n]
        lo = torch.stack([x[:, :, i : i + 32].amin(2) for i in range(0, n, 32)], 2)
    else:  # values: a group is 32 consecutive channels of one slot
        assert q.scale.shape == (2, 3, n, math.ceil(d / 32))
        step = q.scale.repeat_interleave(32, dim=3)[..., :d]
        lo = torch.stack([x[..., i : i + 32].amin(-1) for i in range(0, d, 32)], -1)
    assert torch.equal(q.zero, lo)  # the zero point is the group's minimum
    error = (q.dequantize() - x).abs()
    assert bool((error <= step / 2 + 1e-5).all()), float((error - step / 2).max())
    assert q.dequantize().dtype == x.dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", BITS)
def test_half_precision_stores_scales_in_its_dtype_and_stays_accurate(dtype, bits):
    """Scales and zero points in the input's dtype, codes rounded against them: the error is the quantization step's
    plus the dtype's own rounding, never a NaN or an overflow."""
    x = _x(dtype=dtype)
    for axis in ("channel", "token"):
        q = quantize(x, bits, 32, axis)
        assert q.scale.dtype == dtype and q.zero.dtype == dtype
        out = q.dequantize()
        assert out.dtype == dtype and bool(torch.isfinite(out).all())
        rel = float((out.float() - x.float()).norm() / x.float().norm())
        assert rel < {8: 0.01, 4: 0.12, 2: 0.6}[bits], (axis, rel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_dequantizing_gives_code_times_scale_plus_zero_rounded_once_into_any_slice(dtype, bits, axis):
    """Every element, of whole groups and of a last partial group (100 slots and 70 channels in groups of 32), is
    code·scale + zero computed in float32 and rounded once to the dtype; dequantized into `out`, the first slots of a
    longer tensor, the same values land there and the slots after them are untouched."""
    x = _x((2, 3, 100, 70), dtype=dtype)
    q = quantize(x, bits, 32, axis)
    codes = _unpack(q.packed, bits, 70).float()
    along = 2 if axis == "channel" else 3  # the axis a group runs along
    scale, zero = (t.float().repeat_interleave(32, along).narrow(along, 0, codes.shape[along]) for t in (q.scale, q.zero))
    want = torch.addcmul(zero, codes, scale).to(dtype)
    assert torch.equal(q.dequantize(), want) and q.dequantize().dtype == dtype
    longer = torch.full((2, 3, 104, 70), 7.0, dtype=dtype)
    assert q.dequantize(out=longer[:, :, :100]).data_ptr() == longer.data_ptr()
    assert torch.equal(longer[:, :, :100], want) and bool((longer[:, :, 100:] == 7).all())


def test_dequantizing_into_a_tensor_of_another_shape_dtype_or_device_is_refused():
    q = quantize(_x(), 4, 32, "channel")
    for bad in (torch.empty(2, 3, 99, 64), torch.empty(2, 3, 100, 64, dtype=torch.float64), torch.empty(2, 3, 100, 64, device="meta")):
        with pytest.raises(ValueError, match=r"out must be \[2, 3, 100, 64\] torch.float32 on cpu"):
            q.dequantize(out=bad)


@pytest.mark.parametrize("weighted,normalizer", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_summary_then_exact_slots_is_their_concatenation(weighted, normalizer, dtype):
    """`summary_then` (attention's view of a quantized context, its exact tail and the new block) is
    `concat([summary(), *rest])` bit for bit, whatever the weights, a normalizer or the dtype."""
    s = _summary(weighted, normalizer).to(dtype=dtype)
    q = QuantizedSummary.of(s, 4, 32)
    tail = KVSummary.exact(_x((1, 2, 5, 16), seed=1, dtype=dtype), _x((1, 2, 5, 16), seed=2, dtype=dtype), torch.arange(50, 55))
    block = KVSummary.exact(_x((1, 2, 1, 16), seed=3, dtype=dtype), _x((1, 2, 1, 16), seed=4, dtype=dtype), torch.arange(55, 56))
    joined, want = q.summary_then([tail, block]), concat([q.summary(), tail, block])
    for field in ("keys", "values", "log_weights", "positions"):
        got, expected = getattr(joined, field), getattr(want, field)
        assert got.dtype == expected.dtype and torch.equal(got, expected), field
    assert joined.eviction_only == want.eviction_only == (not weighted)
    assert (joined.normalizer is None) == (not normalizer)
    if normalizer:
        assert torch.equal(joined.normalizer.keys, want.normalizer.keys)
    wrong = KVSummary.exact(_x((1, 2, 5, 8), dtype=dtype), _x((1, 2, 5, 16), dtype=dtype), torch.arange(50, 55))
    with pytest.raises(ValueError, match="must match it" if not normalizer else "must share batch"):
        q.summary_then([wrong])


def test_empty_slots_do_not_widen_the_key_ranges():
    """Slots with log-weight -inf (padding, head-wise budgets) are left out of the per-channel ranges: the real slots
    quantize as they would alone."""
    x = _x((1, 2, 40, 16))
    valid = torch.ones(1, 2, 40, dtype=torch.bool)
    valid[:, :, 30:] = False
    padded = x.clone()
    padded[:, :, 30:] = 1e4
    q = quantize(padded, 4, 32, "channel", valid).dequantize()[:, :, :30]
    alone = quantize(x[:, :, :30], 4, 32, "channel").dequantize()
    assert torch.equal(q, alone)


def test_nbytes_counts_the_packed_codes_the_scales_and_the_zero_points():
    x = _x((1, 2, 100, 64))
    for bits in BITS:
        keys, values = quantize(x, bits, 32, "channel"), quantize(x, bits, 32, "token")
        codes = 1 * 2 * 100 * 64 * bits // 8
        assert keys.nbytes() == codes + 2 * (1 * 2 * 4 * 64) * 4  # 4 groups of 32 slots per channel, scale + zero in float32
        assert values.nbytes() == codes + 2 * (1 * 2 * 100 * 2) * 4  # 2 groups of 32 channels per slot


def _summary(weighted: bool, normalizer: bool) -> KVSummary:
    x = _x((1, 2, 50, 16))
    log_weights = torch.zeros(1, 2, 50)
    if weighted:
        log_weights = torch.rand(1, 2, 50, generator=torch.Generator().manual_seed(3)).log1p()
        log_weights[:, 1, -5:] = -math.inf  # head-wise padding
    positions = torch.arange(50).expand(1, 2, 50).clone()
    positions[:, 1, -5:] = -1 if weighted else positions[:, 1, -5:]
    norm = Normalizer(x, torch.zeros(1, 2, 50), torch.arange(50).expand(1, 2, 50)) if normalizer else None
    summary = KVSummary(x, x.flip(-1), log_weights, positions, norm)
    return summary.checked_eviction()


@pytest.mark.parametrize("weighted,normalizer", [(False, False), (True, False), (True, True)])
def test_a_quantized_summary_keeps_weights_positions_and_normalizer_exactly(weighted, normalizer):
    s = _summary(weighted, normalizer)
    q = QuantizedSummary.of(s, 8, 32)
    back = q.summary()
    assert back.eviction_only == s.eviction_only == (not weighted)
    assert torch.equal(back.positions, s.positions) and back.positions.dtype == torch.int64
    assert torch.equal(back.log_weights, s.log_weights)
    assert q.positions.dtype == torch.int32
    assert (q.log_weights is None) == s.eviction_only  # an eviction-only summary stores no log-weights
    occupied = torch.isfinite(s.log_weights)  # an empty slot's key sets no range and is never attended
    torch.testing.assert_close(back.keys[occupied], s.keys[occupied], atol=0.05, rtol=0)
    torch.testing.assert_close(back.values, s.values, atol=0.05, rtol=0)
    if normalizer:
        assert torch.equal(back.normalizer.positions, s.normalizer.positions)
        torch.testing.assert_close(back.normalizer.keys, s.normalizer.keys, atol=0.05, rtol=0)
    else:
        assert back.normalizer is None
    # attention over the dequantized summary stays close to attention over the original
    queries = 0.1 * _x((1, 4, 6, 16), seed=5)  # logits of a few units, as a model's
    exact = kvc.weighted_attention(queries, s)
    for bits, bound in ((8, 0.01), (4, 0.15)):
        assert kvc.relative_error(kvc.weighted_attention(queries, QuantizedSummary.of(s, bits, 32).summary()), exact) < bound
    stored = q.nbytes() + q.index_nbytes()
    assert q.index_nbytes() == 2 * 50 * 4 + (0 if not weighted else 2 * 50 * 4) + (2 * 50 * 8 if normalizer else 0)  # int32 positions, float32 log-weights
    assert stored < s.nbytes() + s.index_nbytes()


def test_rows_of_a_quantized_summary_are_selected_as_stored():
    s = KVSummary(_x((3, 2, 40, 16)), _x((3, 2, 40, 16), seed=1), torch.zeros(3, 2, 40), torch.arange(40).expand(3, 2, 40))
    q = QuantizedSummary.of(s.checked_eviction(), 4, 32)
    picked = q.select_rows(torch.tensor([2, 0]))
    assert torch.equal(picked.summary().keys, q.summary().keys[[2, 0]])
    assert torch.equal(picked.summary().values, q.summary().values[[2, 0]])


def _ragged_summary(rows=2, heads=3, n=90, d=16, weighted=True, dtype=torch.float32):
    """A summary whose heads keep 90, 41, 7, ... slots, with empty slots scattered through each head (as AdaKV leaves them)."""
    g = torch.Generator().manual_seed(11)
    keep = torch.rand(rows, heads, n, generator=g) < torch.tensor([1.0, 0.45, 0.08])[:heads, None]
    log_weights = torch.rand(rows, heads, n, generator=g).log1p() if weighted else torch.zeros(rows, heads, n)
    positions = torch.arange(n).expand(rows, heads, n).masked_fill(~keep, -1)
    return KVSummary(_x((rows, heads, n, d), dtype=dtype), _x((rows, heads, n, d + 4), seed=1, dtype=dtype),
                     log_weights.masked_fill(~keep, -math.inf), positions)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("weighted", [True, False])
def test_a_ragged_quantized_summary_stores_only_the_kept_slots_as_a_padded_one_would_quantize_them(bits, weighted):
    """Packed (no code or scale for an empty slot), quantized exactly as a padded summary with each head's slots first:
    key groups of 32 consecutive slots of one head's run, values per slot."""
    s = _ragged_summary(weighted=weighted)
    q = QuantizedRaggedSummary.of(s, bits, 32)
    reference = QuantizedSummary.of(RaggedSummary.of(s).summary(), bits, 32).summary()
    back = q.summary()
    real = torch.isfinite(reference.log_weights)
    assert torch.equal(back.log_weights, reference.log_weights) and torch.equal(back.positions, reference.positions)
    assert torch.equal(back.keys[real], reference.keys[real]) and torch.equal(back.values[real], reference.values[real])
    counts = torch.isfinite(s.log_weights).sum(-1)
    assert torch.equal(q.counts, counts.int()) and q.num_slots == int(counts.max())
    # bytes: each kept slot's codes, key scales per 32 slots of a head's run, value scales per 32 channels of a slot
    kept, key_groups = int(counts.sum()), int(((counts + 31) // 32).sum())
    codes = kept * (math.ceil(16 * bits / 8) + math.ceil(20 * bits / 8))
    scales = 2 * 4 * (key_groups * 16 + kept * 1)
    assert q.nbytes() == codes + scales + counts.numel() * 4
    assert q.nbytes() < 0.6 * QuantizedSummary.of(s, bits, 32).nbytes()  # 276 of 540 slots: padded, every head takes the longest's size
    assert q.index_nbytes() == kept * 4 + (kept * 4 if weighted else 0)
    picked = q.select_rows(torch.tensor([1, 1, 0]))
    for name in ("keys", "values", "log_weights", "positions"):
        assert torch.equal(getattr(picked.summary(), name), getattr(back, name)[[1, 1, 0]])


@pytest.mark.parametrize("bits", BITS)
def test_ragged_runs_of_every_length_dequantize_as_the_padded_summary_does(bits):
    """Heads that keep no slot, fewer than a group, exactly one group, a group and one, and several groups: each head's
    run is dequantized against its own key groups (`QuantizedRaggedSummary.ragged`), element for element as the padded
    summary's keys and values are."""
    counts = torch.tensor([[0, 5, 32], [33, 0, 96]])
    n = int(counts.max())
    keep = torch.arange(n)[None, None, :] < counts[..., None]
    s = KVSummary(_x((2, 3, n, 16)), _x((2, 3, n, 24), seed=1), torch.zeros(2, 3, n).masked_fill(~keep, -math.inf),
                  torch.arange(n).expand(2, 3, n).masked_fill(~keep, -1))
    q = QuantizedRaggedSummary.of(s, bits, 32)
    reference = QuantizedSummary.of(RaggedSummary.of(s).summary(), bits, 32).summary()
    back = q.summary()
    assert torch.equal(back.keys[keep], reference.keys[keep]) and torch.equal(back.values[keep], reference.values[keep])
    assert torch.equal(q.counts, counts.int())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_ragged_quantized_summary_keeps_half_precision_scales_and_moves(dtype):
    q = QuantizedRaggedSummary.of(_ragged_summary(dtype=dtype), 4, 32)
    assert q.key_scale.dtype == q.values.scale.dtype == dtype and q.summary().keys.dtype == dtype
    moved = q.to("cpu", torch.float32)
    assert moved.key_scale.dtype == torch.float32 and torch.equal(moved.key_codes, q.key_codes)
    assert torch.equal(moved.summary().keys.to(dtype), q.summary().keys)  # computed in float32 either way, rounded once here


@pytest.mark.parametrize("bad", [3, 16, 1, 0, True, "4", 4.0, "Auto"])
def test_kv_bits_outside_8_4_2_and_auto_is_refused(bad):
    with pytest.raises(ValueError, match=r"kv_bits must be None \(full precision\), one of 8, 4, 2 .* or 'auto' .*got"):
        CompressionOptions(method="snapkv", compression_ratio=0.5, kv_bits=bad)


def test_storage_options_are_checked_when_built():
    assert CompressionOptions(method="snapkv", compression_ratio=0.5, kv_bits=4).kv_group_size == DEFAULT_GROUP_SIZE
    assert CompressionOptions(method="snapkv", compression_ratio=0.5, kv_bits=2, kv_group_size=64).kv_group_size == 64
    with pytest.raises(ValueError, match="kv_group_size=16 groups quantized storage: it takes kv_bits"):
        CompressionOptions(method="snapkv", compression_ratio=0.5, kv_group_size=16)
    # one bound for every bad value (a scale and a zero point per group: smaller groups stored more bytes than the full cache)
    for bad in (0, -3, 2.5, True, 1, 2, 7):
        with pytest.raises(ValueError, match=f"kv_group_size must be an integer >= 8, got {bad}: each group stores a scale and a zero point"):
            CompressionOptions(method="snapkv", compression_ratio=0.5, kv_bits=4, kv_group_size=bad)
    for small in (1, 7):
        with pytest.raises(ValueError, match=f"kv_group_size must be an integer >= 8, got {small}"):
            CompressionOptions(method="snapkv", compression_ratio=0.5, kv_bits=8, kv_group_size=small)
    for method in ("snapkv", "express", "subgen", "clustergen", "balancekv", "hybrid"):  # block-wise and native streams
        assert CompressionOptions(method=method, budget=8, mode="decode", kv_bits=4).kv_bits == 4
    with pytest.raises(ValueError, match="method=None is the full cache: it takes no kv_bits"):
        CompressionOptions(method=None, kv_bits=4)
    for setting in ({"seed": 5}, {"compress_question": True}):  # taken and unused before: nothing is drawn or compressed
        with pytest.raises(ValueError, match=f"method=None is the full cache: it takes no {next(iter(setting))}"):
            CompressionOptions(method=None, **setting)


def _reference_budget(model, ctx, question, **kw):
    return generate_ids(model, ctx, question, max_new_tokens=8, stop_at_eos=False, **blocks(kw.get("mode", "prefill")), **kw)


def _exact_tokens(positions: list[int], d: int = 4) -> KVSummary:
    n = len(positions)
    pos = torch.tensor(positions)[None, None]
    return KVSummary(torch.randn(1, 1, n, d), torch.randn(1, 1, n, d), torch.zeros(1, 1, n), pos)


def test_the_exact_sink_and_window_split_off_a_summary_with_a_normalizer():
    """split_exact_ends undoes concat([sink, middle, window]): the middle comes back with its own normalizer, the sink then the
    window as exact, eviction-only slots that own their storage; concat of the two is the summary again, slots reordered."""
    torch.manual_seed(0)
    sink, window = _exact_tokens([0, 1]), _exact_tokens([9, 10, 11])
    middle = KVSummary(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), torch.tensor([[[0.5, -0.2, 1.0]]]), torch.tensor([[[3, 5, 7]]]))
    middle.normalizer = Normalizer(torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5), torch.tensor([[[2, 3, 4, 5, 7]]]))
    whole = concat([sink, middle, window])
    front, exact = split_exact_ends(whole, 2, 3)
    assert torch.equal(front.keys, middle.keys) and torch.equal(front.log_weights, middle.log_weights)
    assert torch.equal(front.normalizer.keys, middle.normalizer.keys) and torch.equal(front.normalizer.positions, middle.normalizer.positions)
    assert exact.normalizer is None and exact.eviction_only and exact.positions.tolist() == [[[0, 1, 9, 10, 11]]]
    assert torch.equal(exact.keys, torch.cat([sink.keys, window.keys], 2))
    whole_storage = whole.keys.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() != whole_storage for t in (exact.keys, exact.values))
    for s, w in ((0, 3), (2, 0), (0, 0)):
        front, exact = split_exact_ends(whole, s, w)
        assert front.num_slots == 8 - s - w and exact.num_slots == s + w


def test_splitting_off_slots_that_are_not_exact_is_an_error():
    """A weighted slot where the sink or the window should be, or counts beyond the summary, are refused."""
    weighted = KVSummary(torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4), torch.tensor([[[0.3, 0.0, 0.0, 0.0]]]), torch.arange(4)[None, None])
    with pytest.raises(ValueError, match="not exact tokens"):
        split_exact_ends(weighted, 1, 1)
    assert split_exact_ends(weighted, 0, 3)[1].num_slots == 3
    with pytest.raises(ValueError, match="at most 4 slots together, got sink=3, window=2"):
        split_exact_ends(weighted, 3, 2)


@pytest.mark.parametrize("mode", ["prefill", "chunked"])
def test_a_quantized_cache_stores_its_front_packed_and_its_sink_window_and_tail_exact(mode):
    """What is stored after the context: the compressed front (the method's summary) quantized, the sink, the window and
    every later token at full precision; nbytes counts exactly that."""
    model = tiny()
    ctx, question = _prompt(n=300)
    options = CompressionOptions(method="keydiff", budget=40, sink=4, window=16, mode=mode, kv_bits=4, **blocks(mode))
    cache = CompressedCache(model, options)
    with torch.inference_mode(), kvc.integration.use_compressed_attention(model):
        for block in (ctx.split(32, 1) if mode == "chunked" else [ctx]):
            model(block, past_key_values=cache, use_cache=True)
        cache.absorbing = False
        layer = cache.layers[0]
        # prefill keeps the budget; a compacted stream holds between its target and the budget (`stream_split`)
        middle = range(40, 41) if mode == "prefill" else range(stream_split(40, DEFAULT_SLACK)[0], 41)
        assert isinstance(layer.front, QuantizedSummary) and layer.front.num_slots in middle, layer.front.num_slots
        assert int(layer.front.positions.min()) >= 4  # the sink leads the exact tail, then the window
        exact = torch.cat([torch.arange(4), torch.arange(284, 300)])
        assert layer.tail.num_slots == 20 and torch.equal(layer.tail.positions[0, 0], exact)
        sink_keys = layer.tail.keys[:, :, :4].clone()
        model(question, past_key_values=cache, use_cache=True)
    assert layer.tail.num_slots == 20 + question.shape[1] and layer.tail.keys.dtype == torch.float32
    assert torch.equal(layer.tail.keys[:, :, :4], sink_keys)
    assert layer.nbytes() == layer.front.nbytes() + layer.tail.nbytes()
    kept = layer.front.num_slots  # the middle
    per_head_codes = kept * 16 * 4 // 8
    # keys: ceil(kept / 32) slot groups x 16 channels; values: 1 channel group per slot (a scale and a zero point each)
    scales = 2 * (math.ceil(kept / 32) * 16) * 4 + 2 * (kept * 1) * 4
    assert layer.front.nbytes() == 2 * (2 * per_head_codes + scales)


@pytest.mark.parametrize("mode", ["prefill", "chunked", "decode"])
@pytest.mark.parametrize("method", SHARED)
def test_every_method_composes_with_quantized_storage(method, mode):
    """At 8 bits every method answers as at full precision on the tiny model in prefill mode, and stores fewer bytes at 8,
    4 and 2 in prefill mode and at 8 and 2 in the streams (4 bits between them: the stream tests below). In chunked and
    decode modes every stream, block-wise or native, stores its slots quantized."""
    if mode not in build_method(method).requirements.modes:  # KVzip runs in prefill mode only: refused when the options are built
        with pytest.raises(ValueError, match=f"got mode='{mode}'"):
            CompressionOptions(method=method, mode=mode, budget=24, kv_bits=4)
        return
    model = tiny()
    ctx, question = _prompt(n=300)
    kw = dict(method=method, mode=mode, budget=24, sink=2, window=0 if method == "compactor" else 8)
    full = _reference_budget(model, ctx, question, **kw)
    stored = [full.kv_bytes]
    for bits in BITS if mode == "prefill" else [8, 2]:
        res = _reference_budget(model, ctx, question, kv_bits=bits, **kw)
        assert res.kv_bits == bits
        if mode == "decode" and method == "subgen":
            # decode: the stream selects on stored keys (test_a_decode_stream_quantizes_...), and SubGen's live slots
            # follow its clusters of them: as many as its budget allows at most
            assert max(res.slots_per_layer) <= 2 + 24 + 8, res.slots_per_layer
        else:
            assert res.slots_per_layer == full.slots_per_layer, (bits, res.slots_per_layer, full.slots_per_layer)
        if bits == 8 and mode == "prefill":  # a stream selects on stored keys (test_a_decode_stream_quantizes_...)
            _answers_alike(model, ctx, question, full.token_ids[:4], res.token_ids[:4], kw)
        stored.append(res.kv_bytes)
    assert stored == sorted(stored, reverse=True) and stored[-1] < stored[0], stored


def _answers_alike(model, ctx, question, full: list[int], quantized: list[int], kw: dict, tie: float = 1e-3):
    """The quantized cache's answer is the full-precision one, up to where full precision itself is at a tie: the first
    token they differ at is one the full-precision cache gives within `tie` of its own choice (log-probability, teacher
    forced on its answer: `answer_log_probs_ids`). 8-bit storage moves the tiny model's logits by about 1e-4, so only such
    a tie can flip; a real difference in what is attended moves them much more."""
    from kvcompress.integration.generation import answer_log_probs_ids

    if quantized == full:
        return
    at = next(i for i, (a, b) in enumerate(zip(full, quantized)) if a != b)
    log_probs = answer_log_probs_ids(model, ctx, question, torch.tensor([full[: at + 1]]), **blocks(kw["mode"]), **kw)[at]
    gap = float(log_probs[full[at]] - log_probs[quantized[at]])
    assert abs(gap) <= tie, (kw["method"], kw["mode"], full, quantized, at, gap)


def _decode_layer0(dtype, method: str, bits: int | None):
    """(the tiny model in dtype, the full cache's layer-0 keys and values of a 300-token context, a decode-mode cache of
    `method` at `bits` (group size 8) that streamed the context in blocks of 20)."""
    from transformers import DynamicCache

    from kvcompress.integration import use_compressed_attention

    model = tiny().to(dtype)
    ctx, _ = _prompt(n=300)
    full = DynamicCache()
    with torch.inference_mode():
        model(ctx, past_key_values=full)
    cache = CompressedCache(model, method, mode="decode", budget=24, sink=2, window=8, kv_bits=bits,
                            kv_group_size=None if bits is None else 8)
    with torch.inference_mode(), use_compressed_attention(model):
        for block in ctx.split(20, 1):
            model(block, past_key_values=cache)
    return model, full.layers[0].keys, full.layers[0].values, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["keydiff", "adakv"])  # adakv (over SnapKV): the kept slots packed (`QuantizedRaggedSlots`)
def test_a_decode_stream_quantizes_each_slot_once_and_stores_only_codes(dtype, method):
    """Decode mode with kv_bits: every middle slot the stream holds is its key and value quantized once per slot (the
    layer-0 keys do not depend on compression, so they are checked against the full cache's), however many
    re-compressions it survived; the state stores the packed codes with a scale and a zero point per group."""
    from kvcompress.quantization import QuantizedRaggedSlots, QuantizedSlots

    model, keys0, values0, cache = _decode_layer0(dtype, method, 4)
    state = cache.layers[0].front.state
    assert isinstance(state.slots, QuantizedSlots) and state.slots.tensors[0].dtype == torch.uint8
    summary = state.summary()
    real = summary.positions >= 0  # AdaKV's heads keep different numbers of slots: the shorter ones padded
    keys, values, positions = summary.keys, summary.values, summary.positions.clamp_min(0)
    # between the target it compresses back to and the budget, which its room and the block being absorbed are within
    assert keys.dtype == dtype and stream_split(24, DEFAULT_SLACK)[0] <= real.sum(-1).float().mean() <= 24
    for x, original in ((keys, keys0), (values, values0)):
        expected = quantize(take_slots(original, positions), 4, 8, "token").dequantize()
        torch.testing.assert_close(x[real], expected[real], rtol=0, atol=0)
    d = keys0.shape[-1]
    per_slot = 2 * (d * 4 // 8 + 2 * (d // 8) * keys0.element_size())  # keys and values: codes, a scale and a zero per 8 channels
    capacity = state.slots.tensors[0].shape[2]  # slots allocated per head (room for the next blocks included)
    slots, counts = 2 * capacity, 0  # 2 KV heads
    if method == "adakv":  # packed kept slots (4 bytes of count per head) beside the buffer's room
        assert isinstance(state.kept, QuantizedRaggedSlots) and state.kept.keys.packed.dtype == torch.uint8
        slots, counts = slots + state.kept.positions.numel(), 2 * 4
    assert slots <= 2 * 24 and state.nbytes() == slots * per_slot + counts  # within the budget
    assert state.nbytes() <= slots * 2 * d * keys0.element_size() // 2 + counts  # at most half the same slots at full precision


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["express", "subgen", "clustergen", "balancekv", "hybrid"])
def test_a_native_decode_stream_stores_each_slot_quantized_once(method, dtype):
    """Decode mode with kv_bits on a native stream (`QuantizedState`; the hybrid's coreset too): every middle slot of
    layer 0 is a token's key and value quantized once per slot, bit for bit, after every halving, sampling, clustering
    and hand-over; the stream stores fewer bytes than the same stream at full precision."""
    stored = {}
    for bits in (None, 4):
        _, keys0, values0, cache = _decode_layer0(dtype, method, bits)
        stream = cache.layers[0].front
        stored[bits] = stream.nbytes()
    summary = stream.summary()
    middle = summary.positions[:, :, 2:-8]
    assert torch.equal(summary.positions[0, 0, :2], torch.arange(2)) and torch.equal(summary.positions[0, 0, -8:], torch.arange(292, 300))
    real = (middle >= 0)[..., None]
    # both KV heads hold slots: half the budget and more, but ClusterGen's, whose runs are shortened to the room its
    # stream leaves within the budget (8 tokens here, under one centre each), and lose slots to the quotas' rounding
    assert bool((real.sum(2) >= (4 if method == "clustergen" else 12)).all()), real.sum(2).flatten().tolist()
    for got, original in ((summary.keys, keys0), (summary.values, values0)):
        expected = quantize(take_slots(original, middle.clamp_min(0)), 4, 8, "token").dequantize()
        assert torch.equal(torch.where(real, got[:, :, 2:-8], 0), torch.where(real, expected, 0)), method
    assert stored[4] < stored[None], stored


def test_rows_known_before_keep_their_codes():
    """quantize_rows: a row equal bit for bit to a known dequantized row takes its codes, scale and zero point (quantizing
    a dequantized row again is not exact), any other row is quantized fresh."""
    from kvcompress.quantization import quantize_rows

    x = _x((1, 1, 400, 64), seed=3)
    first = quantize_rows(x, 8, 32)
    seen = first.dequantize()
    again = quantize_rows(seen, 8, 32)
    assert not torch.equal(again.scale, first.scale)  # why codes are reused: the second rounding moves scales
    new = _x((1, 1, 5, 64), seed=4)
    mixed = torch.cat([seen[:, :, 100:300].flip(2), new], 2)
    got = quantize_rows(mixed, 8, 32, known=[(seen, first)])
    for name in ("packed", "scale", "zero"):
        assert torch.equal(getattr(got, name)[:, :, :200], getattr(first, name)[:, :, 100:300].flip(2))
        assert torch.equal(getattr(got, name)[:, :, 200:], getattr(quantize_rows(new, 8, 32), name))


@pytest.mark.parametrize("method", ["snapkv", "adakv"])  # adakv: each row's heads packed (`QuantizedRaggedSummary`)
def test_a_padded_batch_quantized_answers_as_each_row_alone(method):
    model = tiny("qwen2")
    contexts = [_prompt(n=n, seed=s)[0] for n, s in ((180, 1), (120, 2))]
    _, question = _prompt(n=10)
    kw = dict(method=method, budget=30, sink=2, window=8, kv_bits=4, max_new_tokens=8, stop_at_eos=False)
    batch = generate_batch_ids(model, contexts, question, **kw)
    for ctx, res in zip(contexts, batch):
        assert res.token_ids == generate_ids(model, ctx, question, **kw).token_ids


# adakv: beams are rows of one context; layer 1's heads keep different numbers of slots (packed), layer 0's the same
@pytest.mark.parametrize("method,fronts", [("snapkv", [QuantizedSummary] * 2), ("adakv", [QuantizedSummary, QuantizedRaggedSummary])])
def test_beam_search_reorders_a_quantized_cache(method, fronts):
    model = tiny("qwen2")
    ctx, _ = _prompt(n=180, seed=1)
    cache = CompressedCache(model, method, budget=30, sink=2, window=8, kv_bits=4)
    out = model.generate(ctx, past_key_values=cache, max_new_tokens=6, num_beams=3, do_sample=False)
    assert out.shape == (1, 186) and [type(layer.front) for layer in cache.layers] == fronts


@pytest.mark.parametrize("mode", ["prefill", "chunked"])
def test_adakv_quantized_stores_each_head_packed_and_answers_as_generate(mode, tmp_path):
    """AdaKV's heads keep different numbers of slots: quantized, each stores only its own (`QuantizedRaggedSummary`),
    and the stored cache answers as one generate, and so does the cache saved and loaded."""
    from kvcompress.integration import answer_from_cache_ids, compress_context_ids

    model = tiny()
    ctx, question = _prompt(n=300)
    kw = dict(method="adakv", budget=40, sink=4, window=16, mode=mode, kv_bits=4, **blocks(mode))
    cache = compress_context_ids(model, ctx, **kw)
    for layer in cache.layers:
        assert isinstance(layer.front, QuantizedRaggedSummary), type(layer.front)
        assert layer.nbytes() == layer.front.nbytes() + layer.tail.nbytes()
    counts = torch.stack([layer.front.counts for layer in cache.layers])
    assert counts.max() > counts.min()  # some heads keep more than others: padded, they would store the longest's size
    reference = generate_ids(model, ctx, question, max_new_tokens=8, stop_at_eos=False, **kw)
    (here,) = answer_from_cache_ids(model, cache, [question], max_new_tokens=8, stop_at_eos=False)
    assert here.token_ids == reference.token_ids
    cache.save(tmp_path / "c.kvc")
    loaded = kvc.load_cache(tmp_path / "c.kvc", model)
    for mine, theirs in zip(cache.layers, loaded.layers):
        assert isinstance(theirs.front, QuantizedRaggedSummary) and theirs.nbytes() == mine.nbytes()
        for name in ("key_codes", "key_scale", "key_zero", "positions", "counts"):
            assert torch.equal(getattr(theirs.front, name), getattr(mine.front, name)), name
    (there,) = answer_from_cache_ids(model, loaded, [question], max_new_tokens=8, stop_at_eos=False)
    assert there.token_ids == reference.token_ids


def test_a_ragged_quantized_summary_whose_fields_disagree_is_refused_when_read():
    """What a damaged file could hold: counts that do not add up to the slots, a key group missing, codes too narrow
    for the bits, values of another length (`check_saved`); and bad arguments to `of`."""
    from dataclasses import replace

    q = QuantizedRaggedSummary.of(_ragged_summary(), 4, 32)
    q.check_saved()
    counts = q.counts.clone()
    counts[0, 0] += 1
    values = q.values
    for bad, message in [(replace(q, counts=counts), "add up"), (replace(q, key_scale=q.key_scale[1:], key_zero=q.key_zero[1:]), "groups"),
                         (replace(q, key_zero=q.key_zero[1:]), "groups"), (replace(q, bits=8), "codes"),
                         (replace(q, values=replace(values, **{k: getattr(values, k)[:, :, 1:] for k in ("packed", "scale", "zero")})), "values")]:
        with pytest.raises(ValueError, match=message):
            bad.check_saved()
    for bits, group_size, message in [(None, 32, "needs bits"), (3, 32, "kv_bits"), (4, 0, "group_size"), (4, 2.5, "group_size")]:
        with pytest.raises(ValueError, match=message):
            QuantizedRaggedSummary.of(_ragged_summary(), bits, group_size)


def test_ten_times_smaller_at_4_bits_and_ratio_075_on_4k_tokens(tmp_path):
    """The issue's arithmetic on a real cache, head_dim 64, bfloat16: a 4096-token context at compression_ratio=0.75
    and kv_bits=4 stores at most a tenth of the full cache's bytes, window, scales, zero points, positions and
    log-weights included, and so does its saved file (header, settings and token ids included). Per KV head and layer
    everything scales alike, so the ratio is the default model's (30 layers, 3 KV heads, head_dim 64) as well."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=8192)
    model = LlamaForCausalLM(config).eval().to(torch.bfloat16)
    ids = torch.randint(0, 96, (1, 4096), generator=torch.Generator().manual_seed(0))
    cache = kvc.integration.compress_context_ids(model, ids, method="snapkv", compression_ratio=0.75, kv_bits=4)
    full = 2 * 4 * 2 * 64 * 4096 * 2  # keys and values, 4 layers, 2 KV heads, bfloat16
    index = sum(layer.front.index_nbytes() + layer.tail.index_nbytes() for layer in cache.layers)
    assert cache.nbytes() + index <= full / 10, (cache.nbytes(), index, full)
    path = tmp_path / "doc.kvc"
    cache.save(path)
    assert path.stat().st_size <= full / 10, (path.stat().st_size, full)
    # the same arithmetic per KV head and layer: the quantized front (the middle), the bfloat16 sink and window, the positions
    # (int32 in the front; int64 and float32 log-weights in the exact tail)
    layer = cache.layers[0]
    front, sink_and_window, d = layer.front.num_slots, layer.tail.num_slots, 64
    assert front + sink_and_window == 1024 and sink_and_window == 4 + 64  # ceil(0.25 * 4096) kept
    codes = front * d * 4 // 8 * 2
    scales = (math.ceil(front / 32) * d + front * math.ceil(d / 32)) * 2 * 2  # a scale and a zero point, bfloat16
    exact = sink_and_window * d * 2 * 2
    assert layer.nbytes() == 2 * (codes + scales + exact)  # 2 KV heads
    per_head = codes + scales + exact + front * 4 + sink_and_window * 12
    assert layer.front.index_nbytes() + layer.tail.index_nbytes() == 2 * (per_head - codes - scales - exact)
    smollm2_full, smollm2_stored = 30 * 3 * (4096 * d * 2 * 2), 30 * 3 * per_head
    assert smollm2_stored / smollm2_full < 0.095, smollm2_stored / smollm2_full


def test_a_tensor_level_stream_stores_quantized_slots():
    """kvc.stream(kv_bits=...): the block-wise state holds packed codes, its summary is each slot quantized once per slot
    (keys and values alike), sink and window exact; a native stream is wrapped and stores codes between updates."""
    from kvcompress.methods.base import QuantizedState
    from kvcompress.quantization import QuantizedSlots

    keys, values = _x((1, 2, 200, 16), seed=1), _x((1, 2, 200, 16), seed=2)
    s = kvc.stream("knorm", budget=20, sink=2, window=4, kv_bits=4, kv_group_size=8)
    for start in range(0, 200, 25):
        s.update(keys[:, :, start : start + 25], values[:, :, start : start + 25])
    assert isinstance(s.state.slots, QuantizedSlots) and s.state.slots.tensors[0].shape[2] <= 20  # allocated within the budget
    summary = s.summary()
    middle = summary.positions[0, 0, 2:-4]
    assert torch.equal(summary.keys[:, :, :2], keys[:, :, :2]) and torch.equal(summary.values[:, :, -4:], values[:, :, -4:])
    for got, original in ((summary.keys, keys), (summary.values, values)):
        expected = quantize(take_slots(original, summary.positions[:, :, 2:-4]), 4, 8, "token").dequantize()
        torch.testing.assert_close(got[:, :, 2:-4], expected, rtol=0, atol=0)
    assert stream_split(20, DEFAULT_SLACK)[0] <= middle.numel() <= 20  # between the stream's target and its budget
    native = kvc.stream("express", budget=20, kv_bits=4, kv_group_size=8)
    for start in range(0, 200, 25):
        native.update(keys[:, :, start : start + 25], values[:, :, start : start + 25])
    assert isinstance(native.state, QuantizedState)
    assert all(q.packed.dtype == torch.uint8 for q in native.state.stored.values())
    assert all(t.stride() == (0,) * t.ndim for t in native.state.state.kv_tensors())  # placeholders between updates
    with pytest.raises(ValueError, match="BlockwiseState does not list its key and value tensors"):
        QuantizedState(kvc.stream("knorm", budget=20).state, 4, 8)  # a block-wise state quantizes its own buffer instead
    with pytest.raises(ValueError, match="kv_bits must be None"):
        kvc.stream("knorm", budget=20, kv_bits=3)
    with pytest.raises(ValueError, match="kv_group_size=8 groups quantized storage"):
        kvc.stream("knorm", budget=20, kv_group_size=8)


@pytest.mark.parametrize("method", ["express", "subgen", "clustergen", "balancekv", "knorm"])
def test_a_quantized_stream_takes_a_first_block_longer_than_its_budget(method):
    """kvc.stream(kv_bits=4) given one first block longer than sink + budget + window (a prompt chunk in decode mode):
    nothing was held exactly yet, so the whole block goes to the method's state, and its middle is each kept token
    quantized once per slot, within the budget."""
    keys, values = _x((1, 2, 200, 16), seed=3), _x((1, 2, 200, 16), seed=4)
    s = kvc.stream(method, budget=24, sink=2, window=4, kv_bits=4, kv_group_size=8, seed=0)
    s.update(keys, values)
    summary = s.summary()
    middle = summary.positions[:, :, 2:-4]
    real = middle >= 0
    assert 0 < int(real.sum(-1).max()) <= 24
    for got, original in ((summary.keys, keys), (summary.values, values)):
        expected = quantize(take_slots(original, middle.clamp_min(0)), 4, 8, "token").dequantize()
        assert torch.equal(torch.where(real[..., None], got[:, :, 2:-4], 0), torch.where(real[..., None], expected, 0)), method


@pytest.mark.cuda
def test_native_quantized_streams_and_a_saved_stream_run_on_cuda():
    """QuantizedState's row matching (torch.unique on bit patterns) and a saved stream's reload run unchanged on CUDA:
    as many slots as on the CPU, every middle slot a token quantized once; a stream saved on the CPU goes on on CUDA."""
    from kvcompress import cache_file

    keys, values, queries = _x((1, 2, 300, 16), seed=1), _x((1, 2, 300, 16), seed=2), _x((1, 4, 1, 16), seed=3)
    for name in ("express", "balancekv", "subgen", "hybrid"):
        summaries = []
        for device in ("cpu", "cuda"):
            s = kvc.stream(name, budget=24, sink=2, window=4, kv_bits=4, kv_group_size=8, seed=0)
            k, v, q = keys.to(device), values.to(device), queries.to(device)
            for start in range(0, 300, 20):
                s.update(k[:, :, start : start + 20], v[:, :, start : start + 20], q, pre_rope_keys=k[:, :, start : start + 20])
            summaries.append(s.summary())
        cpu, gpu = summaries
        assert gpu.keys.device.type == "cuda" and gpu.num_slots == cpu.num_slots, name
        middle = gpu.positions[:, :, 2:-4]
        real = (middle >= 0)[..., None]
        expected = quantize(take_slots(keys.cuda(), middle.clamp_min(0)), 4, 8, "token").dequantize()
        assert torch.equal(torch.where(real, gpu.keys[:, :, 2:-4], 0), torch.where(real, expected, 0)), name
    s = kvc.stream("keydiff", budget=24, sink=2, window=4, kv_bits=4, kv_group_size=8)
    s.update(keys[:, :, :200], values[:, :, :200])
    tensors, described = cache_file.state_tensors("s", s, {"method": s.method})
    back = cache_file.state_from(tensors, described, {"method": s.method}, "cuda")
    for stream, device in ((s, "cpu"), (back, "cuda")):
        stream.update(keys[:, :, 200:].to(device), values[:, :, 200:].to(device))
    assert back.summary().keys.device.type == "cuda" and torch.equal(back.summary().positions.cpu(), s.summary().positions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("colliding", [False, True])
def test_rows_are_found_by_their_bits(dtype, colliding, monkeypatch):
    """`_find_rows`: each row's index among the pool's rows of the same bits, -1 for a row the pool lacks (another bit
    pattern of the same value, -0.0 for 0.0, counts as another row); rows whose keys collide (every key equal here) fall
    back to comparing whole rows and find the same."""
    from kvcompress import quantization

    if colliding:
        monkeypatch.setattr(quantization, "_row_keys", lambda words: torch.zeros(words.shape[0], dtype=torch.long))
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(40, 16, generator=g).to(dtype)
    pool[7] = pool[3]  # a repeated row: either index is right
    pool[9] = 0.0
    rows = torch.cat([pool[[5, 3, 0, 39, 9]], torch.randn(3, 16, generator=g).to(dtype), -pool[9:10]])
    match = quantization._find_rows(rows, pool)
    assert match.dtype == torch.long and match[[0, 2, 3, 4]].tolist() == [5, 0, 39, 9] and int(match[1]) in (3, 7)
    assert match[5:].tolist() == [-1, -1, -1, -1]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 48])
def test_slots_in_memory_of_fill_the_bytes_of_full_precision_slots(bits, dtype, d):
    """`slots_in_memory_of`: m quantized slots per head, stored as a compressed context (keys per channel, values per
    slot) or a decode stream (both per slot), take at most the bytes of the full-precision slots they stand for, and
    leave less than two full-precision slots of them unused; split unevenly over a ragged front's heads (each head its
    own last, partial key group) they still fit the heads' bytes together."""
    from kvcompress.quantization import slots_in_memory_of

    size = torch.empty(0, dtype=dtype).element_size()

    def stored(count):
        x = _x((1, 1, count, d), dtype=dtype)
        return quantize(x, bits, 32, "channel").nbytes() + quantize(x, bits, 32, "token").nbytes()

    for full_slots in (2, 40, 137, 500):
        budget = full_slots * 2 * d * size
        m = slots_in_memory_of(full_slots, bits, 32, d, size, "channel")
        assert stored(m) <= budget < stored(m) + 2 * (2 * d * size), (full_slots, m, stored(m), budget)
        heads = [3 * m - 2 * (m // 3), m // 3, m // 3]  # three heads' runs, 3m slots in all
        assert sum(stored(c) for c in heads if c) <= 3 * budget
        m_slot = slots_in_memory_of(full_slots, bits, 32, d, size, "token")
        slot = quantize(_x((1, 1, m_slot, d), dtype=dtype), bits, 32, "token").nbytes()
        assert slot * 2 <= budget < (slot // m_slot) * 2 * (m_slot + 1)
    assert slots_in_memory_of(1, 4, 32, 64, 4, "channel") == 1  # at least one slot
    with pytest.raises(ValueError, match="keys_axis must be one of"):
        slots_in_memory_of(10, 4, 32, 64, 4, "rows")
    with pytest.raises(ValueError, match="needs bits"):
        slots_in_memory_of(10, None, None, 64, 4, "channel")


def test_the_budget_read_as_memory_is_checked_and_resolves_with_the_layers_shapes():
    """budget_unit: "tokens" or "memory"; with kv_bits and "memory" a layer's budget is the quantized slots that fit the
    full-precision middle's bytes (`slots_in_memory_of`, keys per channel in prefill mode, per slot in the streams), at
    most every middle token; a ratio of 0 or a budget of every token keeps full precision (`bits_for`). Without kv_bits
    the two units resolve alike."""
    from kvcompress.quantization import slots_in_memory_of

    tokens = CompressionOptions(method="snapkv", compression_ratio=0.9, kv_bits=4)
    memory = CompressionOptions(method="snapkv", compression_ratio=0.9, kv_bits=4, budget_unit="memory")
    assert tokens.budget_unit == "tokens" and CompressionOptions(**memory.to_dict()) == memory
    middle = tokens.budget_for(2048)
    assert memory.token_budget_for(2048) == middle == math.ceil(0.1 * 2048) - memory.sink - memory.window
    assert memory.budget_for(2048, 64, torch.float32) == slots_in_memory_of(middle, 4, 32, 64, 4, "channel") > 3 * middle
    assert memory.budget_for(2048, 64, torch.bfloat16) < memory.budget_for(2048, 64, torch.float32)
    for mode in ("chunked", "decode"):  # a stream quantizes each slot as it enters: keys per slot
        stream = CompressionOptions(method="snapkv", compression_ratio=0.9, kv_bits=4, budget_unit="memory", mode=mode)
        assert stream.budget_for(2048, 64, torch.float32) == slots_in_memory_of(middle, 4, 32, 64, 4, "token")
    every = 2048 - memory.sink - memory.window
    assert CompressionOptions(method="snapkv", compression_ratio=0.5, kv_bits=4, budget_unit="memory").budget_for(2048, 64, torch.float32) == every
    assert CompressionOptions(method="snapkv", budget=100, kv_bits=4, budget_unit="memory").budget_for(2048, 64, torch.float32) == \
        slots_in_memory_of(100, 4, 32, 64, 4, "channel")
    assert CompressionOptions(method="snapkv", compression_ratio=0.9, budget_unit="memory").budget_for(2048) == middle  # no kv_bits
    assert memory.bits_for(2048, 64, torch.float32) == 4 and tokens.bits_for(2048) == 4
    assert CompressionOptions(method="snapkv", compression_ratio=0.0, kv_bits=4, budget_unit="memory").bits_for(2048) is None
    assert CompressionOptions(method="snapkv", compression_ratio=0.0, kv_bits=4).bits_for(2048) == 4  # tokens: bits as asked
    with pytest.raises(ValueError, match="needs the layer's head_dim and dtype"):
        memory.budget_for(2048)
    with pytest.raises(ValueError, match=r"budget_unit must be one of \('tokens', 'memory'\).*got 'bytes'"):
        CompressionOptions(method="snapkv", compression_ratio=0.9, budget_unit="bytes")
    with pytest.raises(ValueError, match="method=None is the full cache: it takes no budget_unit"):
        CompressionOptions(method=None, budget_unit="tokens")


def test_auto_bits_store_8_bits_where_they_hold_half_the_context_else_4():
    """kv_bits="auto" (budget_unit "memory", mode "prefill"): each layer stores 8-bit slots where those that fit the bytes
    the ratio leaves hold at least half the context's middle tokens, else 4-bit slots (`options.AUTO_BITS`,
    `AUTO_MIN_SHARE`), as many as fit; the choice follows the bytes, so the dtype moves it. A saved cache's options build
    again; "auto" elsewhere is refused, naming what it takes; an unknown value names every accepted one."""
    from kvcompress.quantization import slots_in_memory_of

    def auto(ratio, **settings):
        return CompressionOptions(method="snapkv", compression_ratio=ratio, kv_bits="auto", **{"budget_unit": "memory", **settings})

    every = 2048 - auto(0.5).sink - auto(0.5).window
    for ratio, dtype, size in [(0.5, torch.float32, 4), (0.75, torch.float32, 4), (0.9, torch.float32, 4), (0.5, torch.bfloat16, 2),
                               (0.75, torch.bfloat16, 2), (0.9, torch.bfloat16, 2)]:
        options = auto(ratio)
        middle = options.token_budget_for(2048)
        in_8 = slots_in_memory_of(middle, 8, 32, 64, size, "channel")
        bits = 8 if 2 * in_8 >= every else 4
        assert options.storage_for(2048, 64, dtype) == (min(every, slots_in_memory_of(middle, bits, 32, 64, size, "channel")), bits)
    assert [auto(r).bits_for(2048, 64, torch.float32) for r in (0.5, 0.75, 0.9)] == [8, 8, 4]  # on the default model's shapes
    assert [auto(r).bits_for(2048, 64, torch.bfloat16) for r in (0.5, 0.75, 0.9)] == [8, 4, 4]
    assert auto(0.0).storage_for(2048, 64, torch.float32) == (every, None)  # nothing to remove: the full cache
    assert CompressionOptions(**auto(0.75).to_dict()) == auto(0.75) and auto(0.75, kv_group_size=16).kv_group_size == 16
    for settings in ({"budget_unit": "tokens"}, {"mode": "decode"}):
        with pytest.raises(ValueError, match=r"kv_bits='auto' picks the bits from the bytes the ratio leaves a prefilled context: it "
                                             r"takes budget_unit='memory' in mode 'prefill', got budget_unit="):
            auto(0.75, **settings)
    with pytest.raises(ValueError, match=r"kv_bits must be None \(full precision\), one of 8, 4, 2 .* or 'auto' .*got 'eight'"):
        CompressionOptions(method="snapkv", compression_ratio=0.75, kv_bits="eight", budget_unit="memory")
    with pytest.raises(ValueError, match=r"kv_bits must be None .*got 3"):
        CompressionOptions(method="snapkv", compression_ratio=0.75, kv_bits=3)


def test_a_cache_with_auto_bits_stores_within_the_bytes_the_ratio_leaves():
    """On the tiny model (head_dim 16, float32): kv_bits="auto" stores 8 bits at ratio 0.5 and 4 bits at 0.9, each within
    the bytes the ratio leaves the middle at full precision, and reports the bits it stored."""
    model = tiny()
    ctx, question = _prompt(n=300)
    for ratio, bits in ((0.5, 8), (0.9, 4)):
        settings = dict(method="snapkv", compression_ratio=ratio, sink=2, window=8, max_new_tokens=4, stop_at_eos=False)
        res = generate_ids(model, ctx, question, kv_bits="auto", budget_unit="memory", **settings)
        at_full_precision = generate_ids(model, ctx, question, **settings)
        assert res.kv_bits == bits and res.kv_bytes <= at_full_precision.kv_bytes, res.report()
        assert res.budget == CompressionOptions(method="snapkv", compression_ratio=ratio, sink=2, window=8, kv_bits=bits,
                                                budget_unit="memory").budget_for(ctx.shape[1], 16, torch.float32)


@pytest.mark.parametrize("mode", ["prefill", "chunked", "decode"])
def test_a_cache_read_as_memory_stores_within_the_bytes_the_ratio_leaves(mode):
    """On the tiny model (head_dim 16, float32) with kv_bits=4 and budget_unit "memory": each layer keeps the quantized
    slots `budget_for` resolves from its shapes, more tokens than the ratio in tokens keeps, in at most the bytes that
    ratio leaves the middle at full precision, and a stream at most those bytes while it streams (its peak: the slots
    quantized as they enter); at ratio 0 it is the full cache, token for token."""
    model = tiny()
    ctx, question = _prompt(n=300)
    settings = dict(method="snapkv", compression_ratio=0.75, kv_bits=4, budget_unit="memory", mode=mode, **blocks(mode))
    res = generate_ids(model, ctx, question, max_new_tokens=4, stop_at_eos=False, **settings)
    by_tokens = generate_ids(model, ctx, question, max_new_tokens=4, stop_at_eos=False, **{**settings, "budget_unit": "tokens"})
    options = CompressionOptions(**settings)
    streamed = ctx.shape[1] + question.shape[1] + 4 if mode == "decode" else ctx.shape[1]
    assert res.budget == options.budget_for(streamed, 16, torch.float32) > by_tokens.budget == options.token_budget_for(streamed)
    assert res.kv_bits == 4 and res.realised_compression_ratio < by_tokens.realised_compression_ratio
    settings.pop("kv_bits"), settings.pop("budget_unit")
    at_full_precision = generate_ids(model, ctx, question, max_new_tokens=4, stop_at_eos=False, **settings)
    assert by_tokens.kv_bytes < res.kv_bytes <= at_full_precision.kv_bytes < res.kv_bytes_full
    if mode != "prefill":  # a stream: the held slots quantized from the first, never more than full precision's peak
        assert res.peak_kv_bytes <= at_full_precision.peak_kv_bytes, (res.peak_kv_bytes, at_full_precision.peak_kv_bytes)
    exact = generate_ids(model, ctx, question, max_new_tokens=4, stop_at_eos=False,
                         **{**settings, "compression_ratio": 0.0, "kv_bits": 4, "budget_unit": "memory"})
    plain = generate_ids(model, ctx, question, max_new_tokens=4, stop_at_eos=False, method=None)
    assert exact.kv_bits is None and exact.token_ids == plain.token_ids and exact.kv_bytes == plain.kv_bytes


def test_a_snapshot_restored_into_a_fresh_cache_keeps_its_storage():
    """A chunked stream's snapshot taken mid-prompt and restored into a fresh cache stores the compressed context in the
    bits the options ask for when the prompt ends, as the cache it came from does (`CompressedLayer.kv_bits` travels with
    the snapshot)."""
    model = tiny()
    ctx, _ = _prompt(n=400)

    def run(fresh: bool):
        cache = CompressedCache(model, "keydiff", compression_ratio=0.5, mode="chunked", stream_length=400, kv_bits=4)
        with torch.no_grad(), kvc.integration.use_compressed_attention(model):
            for block in ctx[:, :200].split(32, 1):
                model(block, past_key_values=cache)
            if fresh:
                snapshot = cache.snapshot()
                cache = CompressedCache(model, cache.options, stream_length=400)
                cache.restore(snapshot)
            for block in ctx[:, 200:].split(32, 1):
                model(block, past_key_values=cache)
            cache.absorbing = False
        return type(cache.layers[0].front), cache.nbytes(), cache.kv_bits

    assert run(True) == run(False) == (QuantizedSummary, run(False)[1], 4)


def test_smallest_memory_budgets_and_mixed_rows_keep_within_the_memory_asked_for():
    """A budget read as memory that fits no more slots quantized than at full precision (one slot: its key group's scales
    alone outweigh it) stays at full precision rather than take more bytes; a padded batch whose rows would store other
    bits runs each row alone under `generate_batch_ids` (each row its solo answer) and is refused by one cache, naming
    the cause."""
    from kvcompress.integration import use_compressed_attention

    model = tiny().to(torch.bfloat16)
    ctx, question = _prompt(n=300)
    settings = dict(method="keydiff", budget=1, kv_bits=8, budget_unit="memory")
    res = generate_ids(model, ctx, question, max_new_tokens=2, stop_at_eos=False, **settings)
    plain = generate_ids(model, ctx, question, max_new_tokens=2, stop_at_eos=False, method="keydiff", budget=1)
    assert res.kv_bits is None and (res.budget, res.kv_bytes, res.token_ids) == (plain.budget, plain.kv_bytes, plain.token_ids)
    short = ctx[:, :180]
    batch = dict(method="snapkv", budget=150, kv_bits=2, budget_unit="memory")
    rows = generate_batch_ids(model, [ctx, short], question, max_new_tokens=4, stop_at_eos=False, **batch)
    alone = [generate_ids(model, c, question, max_new_tokens=4, stop_at_eos=False, **batch) for c in (ctx, short)]
    assert [r.token_ids for r in rows] == [r.token_ids for r in alone] and [r.kv_bits for r in alone] == [2, None]
    assert all(r.extra["batch_run"] == "one_by_one" for r in rows)
    padded = torch.cat([torch.full((1, 120), 0, dtype=ctx.dtype), short], 1)
    mask = torch.cat([torch.zeros(1, 120, dtype=torch.long), torch.ones(1, 180, dtype=torch.long)], 1)
    cache = CompressedCache(model, **batch)
    with torch.no_grad(), use_compressed_attention(model), pytest.raises(ValueError, match="store their contexts in different bits"):
        model(torch.cat([ctx, padded]), attention_mask=torch.cat([torch.ones(1, 300, dtype=torch.long), mask]), past_key_values=cache)
    # kv_bits="auto": rows of other lengths pick other bits, each at a quantized budget; one cache names that cause too
    short = ctx[:, :100]
    padded = torch.cat([torch.full((1, 200), 0, dtype=ctx.dtype), short], 1)
    mask = torch.cat([torch.zeros(1, 200, dtype=torch.long), torch.ones(1, 100, dtype=torch.long)], 1)
    cache = CompressedCache(model.float(), method="snapkv", compression_ratio=0.75, sink=2, window=8, kv_bits="auto", budget_unit="memory")
    with torch.no_grad(), use_compressed_attention(model), pytest.raises(
            ValueError, match=r"different bits \(\[4, 8\]\): a budget read as memory picks each row's storage from its own length"):
        model(torch.cat([ctx, padded]), attention_mask=torch.cat([torch.ones(1, 300, dtype=torch.long), mask]), past_key_values=cache)


def test_a_layer_that_keeps_none_of_its_middle_stores_it_quantized():
    """One budget shared over every layer (AdaKV's scope "model") can leave a layer no middle slot at all: its empty
    middle is quantized as no group (no codes, no scales), and the cache answers, saves and loads. Before, quantizing
    zero slots failed in `torch.cat` of no groups (the default on a 140-token context at ratio 0.5)."""
    for axis in ("channel", "token"):
        empty = quantize(torch.zeros(1, 2, 0, 16), 4, DEFAULT_GROUP_SIZE, axis)
        assert empty.dequantize().shape == (1, 2, 0, 16) and empty.nbytes() == 0
    model = tiny()
    ids, question = _prompt(n=120)[0], _prompt(n=6)[0]
    settings = dict(method="adakv", method_params={"scope": "model"}, kv_bits=4, budget=1, max_new_tokens=4, stop_at_eos=False)
    res = generate_ids(model, ids, question, **settings)
    assert len(res.token_ids) == 4 and min(res.slots_per_layer) >= 4 + 8  # the exact sink and window, at least


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_groups_at_the_end_of_float16s_range_dequantize_finite(bits, axis):
    """A scale rounded up to float16 put a group's top level past 65504: finite keys came back inf (and attention NaN)."""
    for low, high in ((-65504.0, 65504.0), (-30000.0, 65504.0), (-60000.0, 65472.0)):
        x = torch.zeros(1, 2, 32, 32, dtype=torch.float16)
        x[..., 0::2, :], x[..., 1::2, :] = low, high  # channel groups span both ends
        x[..., 0::2] = torch.where(x[..., 0::2] == low, high, low)  # token groups too
        back = quantize(x, bits, 32, axis).dequantize()
        assert torch.isfinite(back).all()
        assert float((back.float() - x.float()).abs().max()) <= (high - low) / ((1 << bits) - 1)  # within a step
    keys = torch.zeros(1, 2, 50, 32, dtype=torch.float16)
    keys[:, :, 7, 0::2], keys[:, :, 7, 1::2] = 65504.0, -65504.0  # one outlier token, through a stream's storage
    stream = kvc.stream("keydiff", budget=40, sink=0, window=4, kv_bits=bits)
    stream.update(keys, keys)
    assert torch.isfinite(stream.summary().keys).all()
