"""KeyDiff (the KeyDiff paper): anchor score, ablations, block prompt processing bound, end-to-end needle test."""

import math

import pytest
import torch
import torch.nn.functional as F

import kvcompress as kvc
from kvcompress.methods.budget import stream_split
from kvcompress.methods import keydiff as kd
from kvcompress.methods.budget import DEFAULT_SLACK


def _keys(b=1, h=2, n=300, d=16, seed=0, unit=False, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, n, d, generator=g) + 0.8  # a shared direction, as real keys have
    if unit:
        return F.normalize(k, dim=-1)
    return k * torch.exp(spread * torch.randn(b, h, n, 1, generator=g))


def _kept(keys, budget, **params):
    s = kvc.compress("keydiff", keys, torch.zeros_like(keys), budget=budget, **params)
    return s.positions


def _overlap(a, b):
    """Mean over heads of |A ∩ B| / |A| for kept-position sets [B,H,k]."""
    fractions = [
        len(set(x.tolist()) & set(y.tolist())) / x.numel()
        for x, y in zip(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]))
    ]
    return sum(fractions) / len(fractions)


def test_registered_with_seed_defaults():
    assert "keydiff" in kvc.methods()
    cls = kd.KeyDiff
    assert (cls.default_sink, cls.default_window) == (0, 0)
    assert not cls.requirements.needs("queries") and not cls.requirements.needs("pre_rope_keys")


def test_score_matches_the_formula():
    keys = _keys(n=40)
    k = keys[0, 1]
    unit = k / k.norm(dim=-1, keepdim=True)
    anchor = unit.mean(0)
    expected = torch.tensor([-float(ki @ anchor / (ki.norm() * anchor.norm())) for ki in k])
    got = kd.KeyDiff().score(_tokens(keys), None)[0, 1]
    assert torch.allclose(got, expected, atol=1e-5)
    top = set(expected.topk(10).indices.tolist())
    assert set(_kept(keys, 10)[0, 1].tolist()) == top


def _tokens(keys):
    from kvcompress.methods.tokens import Tokens

    b, h, n, _ = keys.shape
    return Tokens(keys, torch.zeros_like(keys), torch.arange(n).expand(b, h, n))


def test_keeps_distinct_keys_over_near_duplicates():
    g = torch.Generator().manual_seed(3)
    common = torch.randn(16, generator=g)
    crowd = common + 0.05 * torch.randn(200, 16, generator=g)
    outliers = torch.randn(8, 16, generator=g) - common
    keys = torch.cat([crowd[:100], outliers, crowd[100:]])[None, None]
    for metric in kd.METRICS:
        kept = _kept(keys, 8, metric=metric)[0, 0]
        assert set(kept.tolist()) == set(range(100, 108)), metric


def test_no_n_by_n_matrix_for_anchor_score():
    # 60k tokens: an n x n float32 matrix would need 14 GB; the O(n·d) score takes milliseconds.
    keys = torch.randn(1, 1, 60_000, 8)
    s = kvc.compress("keydiff", keys, keys, budget=100)
    assert s.num_slots == 100


@pytest.mark.e2e  # slow; every streaming method's stored bytes stay within its budget in tests/test_stream_memory.py
@pytest.mark.parametrize("sink,window", [(0, 0), (4, 32)])
def test_stream_16k_tokens_stays_within_sink_budget_block_window(sink, window):
    """KeyDiff's block prompt processing (Eq. 6): keep N', add a block of B, evict back to N'. Here the block comes out
    of the budget: a stream of budget N' + B and slack 0 keeps at most N' + B slots (the block included) at every step,
    and compresses back to its target when the next block does not fit."""
    budget, block = 256, 128
    g = torch.Generator().manual_seed(0)
    st = kvc.stream("keydiff", budget=budget, sink=sink, window=window, slack=0)
    bound = sink + budget + window
    for i in range(16_384 // block):
        keys = torch.randn(1, 2, block, 16, generator=g)
        st.update(keys, keys)
        summary = st.summary()
        assert summary.num_slots <= bound and st.state.peak_slots <= budget
        assert st.nbytes() <= bound * 2 * 2 * 16 * 4  # 2 heads, a key and a value of 16 float32 each per slot
    assert st.state.peak_slots == budget
    assert int(summary.positions.max()) == 16_383
    if sink:
        assert summary.positions[0, 0, :sink].tolist() == list(range(sink))


def test_one_shot_block_size_equals_the_stream():
    keys = _keys(n=700)
    values = torch.randn_like(keys)
    st = kvc.stream("keydiff", budget=100)
    for i in range(0, 700, 128):
        st.update(keys[:, :, i : i + 128], values[:, :, i : i + 128])
    st.compact()
    s = kvc.compress("keydiff", keys, values, budget=100, block_size=128)
    assert torch.equal(s.positions, st.summary().positions)
    assert torch.equal(s.values, st.summary().values)
    one = kvc.compress("keydiff", keys, values, budget=100)
    assert not torch.equal(one.positions, s.positions)


def test_mean_anchor_equals_pairwise_objective():
    # Σ_j cos(k_i, k_j) = n·‖μ(K̂)‖·cos(k_i, μ(K̂)): the O(n·d) score ranks exactly as Eq. 7, any norms.
    keys = _keys(b=2, h=3, n=300, spread=1.0)
    assert torch.equal(_kept(keys, 60), _kept(keys, 60, anchor="pairwise"))
    # dot metric: Σ_j <k_i, k_j> = n·<k_i, μ(K)>, the raw-key mean anchor.
    assert torch.equal(_kept(keys, 60, metric="dot", normalize_anchor=False), _kept(keys, 60, anchor="pairwise", metric="dot"))


def test_raw_mean_anchor_exact_on_unit_keys_and_close_otherwise():
    # The seed's cheaper anchor μ(K) coincides with μ(K̂) on unit-norm keys...
    unit = _keys(b=2, h=3, n=300, unit=True)
    assert torch.equal(_kept(unit, 60, normalize_anchor=False), _kept(unit, 60, anchor="pairwise"))
    # ...and picks a close set when norms vary over e^±1 (overlap measured 0.93-0.94 for data seeds
    # 0-2; the median anchor 0.96): asserted above 0.85 / 0.9.
    keys = _keys(b=2, h=3, n=300, spread=1.0)
    exact = _kept(keys, 60, anchor="pairwise")
    assert _overlap(_kept(keys, 60, normalize_anchor=False), exact) >= 0.85
    assert _overlap(_kept(keys, 60, anchor="median"), exact) >= 0.9


def test_euclidean_pairwise_keeps_far_tokens():
    keys = _keys(n=200)
    far = _kept(keys, 20, anchor="pairwise", metric="euclidean")
    mean_dist = torch.cdist(keys, keys).sum(-1)
    assert torch.equal(far, mean_dist.topk(20, dim=-1).indices.sort(-1).values)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_large_keys_do_not_overflow(dtype):
    keys = _keys(n=200) * 400  # squares of entries exceed the float16 range
    if dtype == torch.float16:
        assert not torch.isfinite((keys.to(dtype) ** 2).sum(-1)).all()
    for anchor in kd.ANCHORS:
        for metric in kd.METRICS:
            scores = kd.KeyDiff(anchor=anchor, metric=metric).score(_tokens(keys.to(dtype)), None)
            assert torch.isfinite(scores).all() and scores.dtype == torch.float32
    s = kvc.compress("keydiff", keys.to(dtype), keys.to(dtype), budget=50)
    assert s.keys.dtype == dtype
    assert _overlap(s.positions, _kept(keys, 50)) >= 0.9


def test_bad_parameters():
    keys = _keys(n=50)
    with pytest.raises(ValueError, match="anchor"):
        kvc.compress("keydiff", keys, keys, budget=10, anchor="max")
    with pytest.raises(ValueError, match="metric"):
        kvc.compress("keydiff", keys, keys, budget=10, metric="manhattan")
    with pytest.raises(ValueError, match="block_size"):
        kvc.compress("keydiff", keys, keys, budget=10, block_size=0)
    with pytest.raises(ValueError, match="normalize_anchor"):
        kvc.compress("keydiff", keys, keys, budget=10, normalize_anchor="yes")


def test_pairwise_refuses_large_inputs(monkeypatch):
    monkeypatch.setattr(kd, "PAIRWISE_MAX_TOKENS", 64)
    keys = _keys(n=100)
    with pytest.raises(ValueError, match="pairwise.*at most 64"):
        kvc.compress("keydiff", keys, keys, budget=10, anchor="pairwise")
    st = kvc.stream("keydiff", budget=32, anchor="pairwise")
    for i in range(0, 100, 16):
        st.update(keys[:, :, i : i + 16], keys[:, :, i : i + 16])
        assert st.summary().num_slots <= 32  # the slack comes out of the budget
    st.compact()
    assert stream_split(32, DEFAULT_SLACK)[0] <= st.summary().num_slots <= 32


def test_compression_ratio_and_exact_sink_window():
    keys = _keys(n=400)
    s = kvc.compress("keydiff", keys, keys, compression_ratio=0.75, sink=4, window=16)
    assert s.num_slots == 100
    assert s.positions[0, 0, :4].tolist() == [0, 1, 2, 3]
    assert s.positions[0, 0, -16:].tolist() == list(range(384, 400))


# End-to-end: chunked prefill (B = 128), 512 stored tokens per head, ~4k-token needle haystack.
NEEDLE_DEPTHS = [i / 9 for i in range(10)]
E2E_TOTAL = 512


def needle_accuracy(model, tokenizer, method, total=E2E_TOTAL, target_tokens=4000, depths=NEEDLE_DEPTHS, seed=0):
    """(needles answered, answers) of `method` in chunked mode with `total` stored middle+sink+window tokens per head."""
    from kvcompress.methods.registry import default_sink_window
    from kvcompress.eval import tasks

    sink, window = default_sink_window(method, None, None)
    answers = []
    for i, depth in enumerate(depths):
        sample = tasks.niah_single(target_tokens, depth, seed=seed + i, tokenizer=tokenizer)
        res = kvc.generate(
            model, tokenizer, sample.context, sample.question, method=method, budget=total - sink - window,
            mode="chunked", chunk_size=128, max_new_tokens=24, progress=False,
        )
        answers.append((depth, tasks.score(sample, res.text), res.text))
    return sum(a[1] for a in answers), answers


def sign_test_p(wins: int, losses: int) -> float:
    """One-sided sign test over paired samples (ties dropped): P(X >= wins), X ~ Binomial(wins + losses, 1/2); 1 with no pairs."""
    n = wins + losses
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2**n


# The README's figure (KeyDiff 9/10, StreamingLLM 2/10, SnapKV 1/10, measured 2026-11-25): one needle of slack below it.
NEEDLE_MIN_KEYDIFF = 8


@pytest.mark.e2e
def test_keydiff_needles_beat_streamingllm_and_snapkv(default_model):
    """Chunked mode, 512 stored tokens per head, ~4k-token filler haystack, 10 depths (one sample each), the same
    samples for every method: KeyDiff keeps at least NEEDLE_MIN_KEYDIFF of the 10 needles, more than StreamingLLM
    and more than SnapKV, winning enough of the 10 pairs against each for a one-sided sign test at p < 0.05."""
    model, tokenizer = default_model
    hits = {}
    for method in ["keydiff", "streamingllm", "snapkv"]:
        _, answers = needle_accuracy(model, tokenizer, method)
        hits[method] = [score for _, score, _ in answers]
        print(method, f"{sum(hits[method]):.0f}/10", [(round(d, 2), s) for d, s, _ in answers])
    assert sum(hits["keydiff"]) >= NEEDLE_MIN_KEYDIFF, hits
    for other in ("streamingllm", "snapkv"):
        wins = sum(k > o for k, o in zip(hits["keydiff"], hits[other]))
        losses = sum(k < o for k, o in zip(hits["keydiff"], hits[other]))
        assert sum(hits["keydiff"]) > sum(hits[other]), (other, hits)
        assert sign_test_p(wins, losses) < 0.05, (other, wins, losses, hits)
