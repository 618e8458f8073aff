"""weighted_attention against SDPA and the defining properties of log-weights and normalizers."""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import kvcompress as kvc
from kvcompress.summary import KVSummary, Normalizer, _slot_rows, concat, take_slots


def _qkv(b=2, hq=6, hkv=3, nq=7, n=11, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    return q, k, v


def test_equals_sdpa_non_causal():
    q, k, v = _qkv()
    out = kvc.weighted_attention(q, KVSummary.exact(k, v, torch.arange(11)))
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_equals_sdpa_causal_with_positions():
    q, k, v = _qkv(nq=11, n=11)
    out = kvc.weighted_attention(q, KVSummary.exact(k, v, torch.arange(11)), query_positions=torch.arange(11))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_causal_block_after_prefix_and_custom_scale():
    q, k, v = _qkv(nq=4, n=11)
    qpos = torch.arange(7, 11)
    out = kvc.weighted_attention(q, KVSummary.exact(k, v, torch.arange(11)), scale=0.3, query_positions=qpos)
    mask = torch.arange(11)[None, :] <= qpos[:, None]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_log_weight_log2_equals_duplicate_token():
    q, k, v = _qkv(b=1, n=5)
    log_weights = torch.zeros(1, 3, 5)
    log_weights[..., 2] = math.log(2.0)
    weighted = KVSummary(k, v, log_weights, torch.arange(5).expand(1, 3, 5))
    dup = KVSummary.exact(torch.cat([k, k[:, :, 2:3]], 2), torch.cat([v, v[:, :, 2:3]], 2), torch.tensor([0, 1, 2, 3, 4, 2]))
    torch.testing.assert_close(kvc.weighted_attention(q, weighted), kvc.weighted_attention(q, dup), atol=1e-5, rtol=1e-5)


def test_minus_inf_slots_change_nothing():
    q, k, v = _qkv(b=1, n=5)
    base = KVSummary.exact(k, v, torch.arange(5))
    junk = KVSummary(torch.randn(1, 3, 3, 8) * 100, torch.randn(1, 3, 3, 8) * 100, torch.full((1, 3, 3), float("-inf")), torch.tensor([0, 1, 2]).expand(1, 3, 3))
    torch.testing.assert_close(kvc.weighted_attention(q, concat([base, junk])), kvc.weighted_attention(q, base))


def test_normalizer_used_for_denominator_only():
    q, k, v = _qkv(b=1, nq=3, n=5)
    num = replace(KVSummary.exact(k[:, :, :2], v[:, :, :2], torch.arange(2)), eviction_only=False)
    num.normalizer = Normalizer(k, torch.zeros(1, 3, 5), torch.arange(5).expand(1, 3, 5))
    out = kvc.weighted_attention(q, num)
    kq = q.reshape(1, 3, 2, 3, 8)
    logits = torch.einsum("bhgqd,bhnd->bhgqn", kq, k) / math.sqrt(8)
    expected = torch.einsum("bhgqn,bhnd->bhgqd", logits[..., :2].exp(), v[:, :, :2]) / logits.exp().sum(-1, keepdim=True)
    torch.testing.assert_close(out, expected.reshape(1, 6, 3, 8), atol=1e-5, rtol=1e-5)
    # The same slots with their own normalizer give the ordinary softmax.
    same = KVSummary.exact(k, v, torch.arange(5))
    same = replace(same, normalizer=same.as_normalizer(), eviction_only=False)
    torch.testing.assert_close(kvc.weighted_attention(q, same), kvc.weighted_attention(q, KVSummary.exact(k, v, torch.arange(5))))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_large_logits_are_finite(dtype):
    q, k, v = _qkv(dtype=dtype)
    q, k = q * 200, k * 200  # logits ~ 1e5: exp overflows in any precision without log-space
    s = KVSummary.exact(k, v, torch.arange(11))
    out = kvc.weighted_attention(q, s)
    assert out.dtype == dtype and torch.isfinite(out).all()
    s = replace(s, normalizer=s.as_normalizer(), eviction_only=False)
    assert torch.isfinite(kvc.weighted_attention(q, s)).all()
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("held", [0, 1, 40])
def test_causal_tail_equals_query_positions_with_weights_and_empty_slots(held, dtype):
    """A block over held weighted slots (on the CPU: two flash calls merged by log-sum-exp) is the one masked softmax:
    a head with no finite held slot, a padded first token in the block and a query that sees nothing included."""
    nq = 6
    n = held + nq
    q, k, v = _qkv(nq=nq, n=n, seed=3, dtype=dtype)
    log_weights = torch.rand(2, 3, n, generator=torch.Generator().manual_seed(4)).log1p() * 3
    log_weights[..., held:] = 0.0
    log_weights[0, 1, :held] = float("-inf")  # every held slot of a head empty
    log_weights[1, :, held] = float("-inf")  # the block's first token padding: its query sees no slot when nothing is held
    s = KVSummary(k, v, log_weights, torch.arange(n).expand(2, 3, n))
    tail = kvc.weighted_attention(q, s, causal_tail=True)
    ref = kvc.weighted_attention(q.float(), s.to(torch.float32), query_positions=torch.arange(held, n))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(tail.float(), ref, atol=tol, rtol=tol)
    assert tail.dtype == dtype and torch.isfinite(tail).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nq", [1, 6])
@pytest.mark.parametrize("weighted", [False, True])
def test_packed_slots_are_attended_where_they_are_stored(nq, weighted, dtype):
    """`packed_then_causal_attention` (each packed head's run attended as stored, the parts merged by log-sum-exp) is
    the causal-tail attention over the packed slots unpacked before the summary: heads that keep different numbers of
    slots, one that keeps none, weighted packed slots, and a summary of held slots before the block included (weighted:
    one head's held slots there all empty, so that a decode step's query, q = 1, sees only its own slot of it)."""
    from kvcompress.attention import packed_then_causal_attention
    from kvcompress.ragged import RaggedSummary, concat_parts

    q, k, v = _qkv(nq=nq, n=30 + 4 + nq, seed=5, dtype=dtype)
    g = torch.Generator().manual_seed(6)
    log_weights = torch.rand(2, 3, 30, generator=g).log1p() if weighted else torch.zeros(2, 3, 30)
    log_weights[torch.rand(2, 3, 30, generator=g) < 0.4] = float("-inf")
    log_weights[1, 2] = float("-inf")  # a head that keeps nothing
    packed = RaggedSummary.of(KVSummary(k[:, :, :30], v[:, :, :30], log_weights, torch.arange(30).expand(2, 3, 30)))
    assert (packed.log_weights is None) != weighted and int(packed.counts[1, 2]) == 0
    rest = KVSummary.exact(k[:, :, 30:], v[:, :, 30:], torch.arange(30, 34 + nq))
    if weighted:
        rest_weights = rest.log_weights.clone()
        rest_weights[0, 1, :4] = float("-inf")
        rest = KVSummary(rest.keys, rest.values, rest_weights, rest.positions)
    got = packed_then_causal_attention(q, [packed], rest)
    want = kvc.weighted_attention(q.float(), concat_parts([packed, rest]).to(torch.float32), causal_tail=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert got.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_causal_tail_with_other_value_dims_and_float64(dtype):
    """Causal-tail attention takes values of another head dim than the keys' (the CPU flash kernel cannot: the masked
    path serves them) and keeps float64 at float64 accuracy, as the same causality given by positions does."""
    q, k, _ = _qkv(nq=3, n=10, seed=7, dtype=dtype)
    v = torch.randn(2, 3, 10, 5, generator=torch.Generator().manual_seed(8), dtype=dtype)
    log_weights = torch.rand(2, 3, 10, generator=torch.Generator().manual_seed(9), dtype=torch.float64).log1p().float()
    for s in (KVSummary.exact(k, v, torch.arange(10)), KVSummary(k, v, log_weights, torch.arange(10).expand(2, 3, 10))):
        tail = kvc.weighted_attention(q, s, causal_tail=True)
        ref = kvc.weighted_attention(q, s, query_positions=torch.arange(7, 10))
        assert tail.shape == (2, 6, 3, 5) and tail.dtype == dtype
        torch.testing.assert_close(tail, ref, atol=1e-12 if dtype == torch.float64 else 1e-5, rtol=0)
    exact = kvc.exact_attention(q, k, v, causal_offset=7)
    torch.testing.assert_close(exact, kvc.weighted_attention(q, KVSummary.exact(k, v, torch.arange(10)), query_positions=torch.arange(7, 10)))


def test_bad_causality_and_summary_parts_are_refused():
    q, k, v = _qkv(nq=2, n=6)
    s = KVSummary.exact(k, v, torch.arange(6))
    with pytest.raises(ValueError, match="query_positions must be an integer tensor .* got tensor \\[2\\] bool"):
        kvc.weighted_attention(q, s, query_positions=torch.tensor([True, True]))
    with pytest.raises(ValueError, match="causal_tail must be True or False, got 'no'"):
        kvc.weighted_attention(q, s, causal_tail="no")
    lw, pos = torch.zeros(2, 3, 6), torch.arange(6).expand(2, 3, 6)
    with pytest.raises(ValueError, match="normalizer keys \\(2, 3, 6, 4\\)"):
        KVSummary(k, v, lw, pos, Normalizer(torch.randn(2, 3, 6, 4), lw, pos))
    with pytest.raises(ValueError, match="normalizer keys .* log_weights \\(2, 3, 3\\)"):
        KVSummary(k, v, lw, pos, Normalizer(k, lw[:, :, :3], pos))
    with pytest.raises(ValueError, match="positions must be an integer tensor \\[n\\] = \\[6\\]"):
        KVSummary.exact(k, v, torch.arange(7))
    with pytest.raises(ValueError, match="keys must be a tensor, got a list"):
        KVSummary(k.tolist(), v, lw, pos)
    with pytest.raises(ValueError, match="eviction_only must be True or False, got 'yes'"):
        KVSummary(k, v, lw, pos, eviction_only="yes")
    with pytest.raises(ValueError, match="normalizer must be a Normalizer or None, got a tuple"):
        KVSummary(k, v, lw, pos, (k, lw, pos))
    with pytest.raises(ValueError, match="normalizer keys and log_weights must be floating and its positions int64"):
        KVSummary(k, v, lw, pos, Normalizer(k, lw, pos.float()))
    with pytest.raises(ValueError, match="one device, got keys on cpu, .*log_weights on meta"):
        KVSummary(k, v, lw.to("meta"), pos)
    with pytest.raises(ValueError, match="concat's parts must share .* part 1 keys tensor \\[2, 3, 6, 8\\] float16"):
        concat([s, s.to(torch.float16)])
    with pytest.raises(ValueError, match="concat's parts must share"):
        concat([s, KVSummary.exact(k[:, :2], v[:, :2], torch.arange(6))])


def test_query_chunking_matches_unchunked(monkeypatch):
    import kvcompress.attention as attention

    q, k, v = _qkv(nq=50, n=40)
    s = KVSummary.exact(k, v, torch.arange(40))
    full = kvc.weighted_attention(q, s, query_positions=torch.arange(50))
    monkeypatch.setattr(attention, "_MAX_LOGITS", 2 * 6 * 40 * 3)  # three queries per chunk
    torch.testing.assert_close(kvc.weighted_attention(q, s, query_positions=torch.arange(50)), full)


def test_head_mismatch_is_an_error():
    q, k, v = _qkv(hq=4, hkv=3)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        kvc.weighted_attention(q, KVSummary.exact(k, v, torch.arange(11)))


def test_slots_are_gathered_from_the_storage_without_copying_it():
    buffer = torch.randn(2, 3, 50, 4)
    model_layout = torch.randn(2, 50, 3, 4).transpose(1, 2)  # a transposed projection: [B,n,H,d] in memory
    positions = torch.arange(50).expand(2, 3, 50)
    index = torch.randint(0, 30, (2, 3, 7))
    views = (buffer[:, :, :30], buffer[:, :, 5:35], model_layout[:, :, :30], model_layout[:, 1:, 3:33], positions[:, :, :30], buffer[:1, 2:])
    for held in views:
        rows, _, _ = _slot_rows(held)
        assert rows.data_ptr() == held.data_ptr()  # a view of the storage, not a copy
        sub = index[: held.shape[0], : held.shape[1]]
        assert torch.equal(take_slots(held, sub), take_slots(held.contiguous(), sub))
    rows, head_rows, slot_rows = _slot_rows(buffer[:, :, :30])
    assert slot_rows == 1 and head_rows.flatten().tolist() == [0, 50, 100, 150, 200, 250]
    rows, head_rows, slot_rows = _slot_rows(model_layout)
    assert slot_rows == 3 and head_rows.flatten().tolist() == [0, 1, 2, 150, 151, 152]
    odd = torch.randn(2, 3, 50, 8)[..., ::2]  # each slot's channels are strided: copied once
    assert torch.equal(take_slots(odd, index), take_slots(odd.contiguous(), index))
