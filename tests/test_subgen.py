"""SubGen (seed 001, Alg. 1): Lemma 1 and 2 invariants, memory bound, estimator accuracy, API."""

import math

import pytest
import torch
from scipy import stats

import kvcompress as kvc
from kvcompress.methods.base import Tokens, make_generator
from kvcompress.methods.subgen import SubGen

torch.set_num_threads(1)


def blobs(n, d=16, clusters=8, spread=0.05, sep=4.0, heads=2, seed=0):
    """Keys [1, heads, n, d] drawn around `clusters` well-separated centres, with their labels [heads, n]."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(heads, clusters, d, generator=g) * sep
    labels = torch.randint(0, clusters, (heads, n), generator=g)
    keys = centres.gather(1, labels[..., None].expand(-1, -1, d)) + spread * torch.randn(heads, n, d, generator=g)
    values = torch.randn(1, heads, n, d, generator=g)
    return keys[None], values, labels


def run_stream(keys, values, blocks, budget, seed=0, **params):
    """Feed the SubGen state directly (no sink/window) in blocks of the given sizes."""
    state = SubGen(**params).new_stream(budget, make_generator(seed))
    n = keys.shape[2]
    pos = torch.arange(n).expand(keys.shape[:3])
    start = 0
    for size in blocks:
        stop = min(n, start + size)
        state.absorb(Tokens(keys[:, :, start:stop], values[:, :, start:stop], pos[:, :, start:stop]))
        start = stop
    assert start == n
    return state


def block_sizes(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    sizes, total = [], 0
    while total < n:
        sizes.append(int(torch.randint(1, 40, (1,), generator=g)))
        total += sizes[-1]
    return sizes


def test_lemma2_counts_centres_and_samples_match_true_clusters():
    keys, values, labels = blobs(300)
    state = run_stream(keys, values, block_sizes(300), budget=200, s=8, t=6, delta=1.0, max_clusters=32)
    heads = keys.shape[1]
    for h in range(heads):
        m = int(state.num_clusters[0, h])
        assert m == len(labels[h].unique())
        for c in range(m):
            centre_pos = int(torch.nonzero((state.centres[h, c] == keys[0, h]).all(-1))[0])
            label = labels[h, centre_pos]
            members = (labels[h] == label).nonzero().squeeze(-1)
            assert centre_pos == int(members[0]), "a cluster's centre is its first key"
            assert int(state.counts[h, c]) == len(members), "n_i equals the cluster's size"
            assert torch.isin(state.sample_pos[h, c], members).all(), "samples come from the cluster"
            assert torch.equal(state.sample_keys[h, c], keys[0, h, state.sample_pos[h, c]])
        assert int(state.counts[h].sum()) == 300


def test_cap_merges_keep_counts_exact_and_samples_inside_merged_clusters():
    keys, values, labels = blobs(400, clusters=12)
    cap = 5
    state = run_stream(keys, values, block_sizes(400, seed=3), budget=8 + 128 * cap, s=8, t=128, max_clusters=cap)
    for h in range(keys.shape[1]):
        m = int(state.num_clusters[0, h])
        assert 1 <= m <= cap
        assert int(state.counts[h].sum()) == 400
        covered = []
        for c in range(m):
            sample_labels = labels[h, state.sample_pos[h, c]].unique()
            sizes = sum(int((labels[h] == lab).sum()) for lab in sample_labels)
            assert sizes == int(state.counts[h, c]), "a merged cluster counts exactly the true clusters it absorbed"
            covered += sample_labels.tolist()
        assert sorted(covered) == sorted(labels[h].unique().tolist()), "each true cluster lies in one merged cluster"
        assert float(state.delta[h]) > 0


def test_lemma1_value_norm_reservoir_distribution():
    """Each of the s slots holds token i with probability ‖v_i‖² / μ: chi-square over 20000 slots, p > 1e-3."""
    g = torch.Generator().manual_seed(5)
    n, s = 12, 20000
    values = (torch.rand(n, generator=g) * 3 + 0.1)[None, None, :, None] * torch.nn.functional.normalize(torch.randn(1, 1, n, 4, generator=g), dim=-1)
    keys = torch.randn(1, 1, n, 4, generator=g)
    sq = values.pow(2).sum(-1).flatten().double()
    for blocks in ([1] * n, [3, 1, 6, 2], [n]):
        state = run_stream(keys, values, blocks, budget=s + 4, s=s, t=4)
        assert torch.allclose(state.mu, sq.sum()[None])
        observed = torch.bincount(state.num_pos.flatten(), minlength=n).double()
        expected = sq / sq.sum() * s
        assert stats.chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3
        assert (observed / s - sq / sq.sum()).abs().max() < 0.015


def test_lemma2_cluster_reservoir_is_uniform_over_members():
    """One cluster (δ large): each of t = 20000 slots is uniform over the n members: chi-square, p > 1e-3."""
    g = torch.Generator().manual_seed(6)
    n, t = 10, 20000
    keys = 0.1 * torch.randn(1, 1, n, 4, generator=g)
    values = torch.randn(1, 1, n, 4, generator=g)
    for blocks in ([1] * n, [1, 2, 3, 4], [n]):
        state = run_stream(keys, values, blocks, budget=t + 1, s=1, t=t, delta=10.0, max_clusters=1)
        assert int(state.counts[0, 0]) == n
        observed = torch.bincount(state.sample_pos[0, 0], minlength=n).double()
        assert stats.chisquare(observed.numpy()).pvalue > 1e-3
        assert (observed / t - 1 / n).abs().max() < 0.015


def test_merge_keeps_samples_uniform_over_the_union():
    """Clusters of 3 and 7 keys merged by the cap: the merged slots pick each of the 10 keys with probability 1/10."""
    n, t = 10, 20000
    keys = torch.zeros(1, 1, n + 2, 2)
    keys[0, 0, 3:n, 0] = 1.0
    keys[0, 0, :n, 1] = torch.arange(n) * 1e-3
    keys[0, 0, n:, 0] = torch.tensor([50.0, 51.0])
    values = torch.ones(1, 1, n + 2, 2)
    state = run_stream(keys, values, [1] * (n + 2), budget=1 + 3 * t, s=1, t=t, delta=0.5, max_clusters=3)
    assert state.counts[0].tolist() == [n, 2, 0]
    assert set(state.sample_pos[0, 1].tolist()) == {n, n + 1}
    observed = torch.bincount(state.sample_pos[0, 0], minlength=n).double()
    assert stats.chisquare(observed.numpy()).pvalue > 1e-3


def test_memory_is_bounded_by_clusters_not_stream_length():
    """O(d (m t + s)): on a clusterable stream m stays at the 8 true clusters while n grows 8x, and so do the bytes."""
    s, t, d = 32, 8, 16
    sizes = {}
    for n in (256, 2048):
        keys, values, _ = blobs(n, d=d)
        state = run_stream(keys, values, [64] * (n // 64), budget=s + t * 64, s=s, t=t, delta=1.0, max_clusters=64)
        m = int(state.num_clusters.max())
        assert m == 8
        sizes[n] = state.nbytes()
        assert sizes[n] <= 3 * keys.element_size() * keys.shape[1] * d * (m * t + s)
    assert sizes[256] == sizes[2048]


def test_default_delta_comes_from_the_data_and_respects_the_cap():
    keys, values, labels = blobs(600, clusters=6)
    budget = 64 + 4 * 16
    state = run_stream(keys, values, [50] * 12, budget=budget)
    assert (state.num_clusters <= 16).all() and (state.num_clusters >= 6).all()
    assert (state.delta > 0).all()
    summary = state.summary()
    occupied = torch.isfinite(summary.log_weights).sum(-1) + torch.isfinite(summary.normalizer.log_weights).sum(-1)
    assert (occupied <= budget).all()
    assert torch.allclose(summary.normalizer.log_weights.exp().sum(-1), torch.full((1, 2), 600.0))


def test_small_stream_is_exact_in_the_denominator():
    """Fewer distinct keys than the cap and t = 1: every key is its own cluster, so the normalizer is the exact key set."""
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(1, 2, 20, 8, generator=g)
    values = torch.randn(1, 2, 20, 8, generator=g)
    summary = run_stream(keys, values, [7, 13], budget=64, s=32, t=1, max_clusters=32).summary()
    norm = summary.normalizer
    assert torch.equal(norm.log_weights[..., :20], torch.zeros(1, 2, 20))
    assert torch.equal(norm.keys[..., :20, :], keys)


def test_estimate_improves_with_s_and_t():
    keys, values, _ = blobs(1024, d=16, spread=0.4, sep=1.0)
    q = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(9))
    exact = kvc.exact_attention(q, keys, values)
    scale = 1 / math.sqrt(16)

    def errors(s, t):
        num, den = [], []
        for seed in range(4):
            summ = kvc.compress("subgen", keys, values, budget=s + t * 16, sink=0, window=0, seed=seed, s=s, t=t, delta=2.0, max_clusters=16)
            num.append(kvc.relative_error(kvc.weighted_attention(q, summ), exact))
            norm = summ.normalizer
            logits = torch.einsum("bhqd,bhnd->bhqn", q.reshape(1, 2, 32, 16), norm.keys) * scale + norm.log_weights[:, :, None]
            exact_den = torch.einsum("bhqd,bhnd->bhqn", q.reshape(1, 2, 32, 16), keys) * scale
            den.append(float((logits.logsumexp(-1) - exact_den.logsumexp(-1)).abs().mean()))
        return sum(num) / 4, sum(den) / 4

    small, large = errors(8, 1), errors(256, 16)
    assert large[0] < 0.5 * small[0]
    assert large[1] < 0.5 * small[1]


def test_stream_api_window_enters_the_normalizer_exactly_and_is_reproducible():
    keys, values, _ = blobs(300)
    outs = []
    for _ in range(2):
        st = kvc.stream("subgen", budget=64, seed=3)
        for start in range(0, 300, 37):
            st.update(keys[:, :, start : start + 37], values[:, :, start : start + 37])
        outs.append(st.summary())
    a, b = outs
    assert torch.equal(a.keys, b.keys) and torch.equal(a.normalizer.keys, b.normalizer.keys)
    window = a.normalizer.positions[..., -64:]
    assert torch.equal(window, torch.arange(236, 300).expand(1, 2, 64))
    assert torch.equal(a.normalizer.log_weights[..., -64:], torch.zeros(1, 2, 64))
    assert math.isclose(float(a.normalizer.log_weights.exp().sum(-1)[0, 0]), 300.0, rel_tol=1e-5)
    assert kvc.methods().count("subgen") == 1


def test_half_precision_does_not_overflow():
    keys, values, _ = blobs(256, sep=40.0)
    keys, values = (keys * 10).half(), (values * 200).half()
    summ = kvc.compress("subgen", keys, values, budget=64, sink=0, window=16)
    assert summ.keys.dtype == torch.float16
    assert torch.isfinite(summ.log_weights[summ.positions >= 0]).all()
    out = kvc.weighted_attention(torch.randn(1, 2, 4, 16).half(), summ)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    "params, budget, match",
    [
        ({"t": 0}, 64, "t must be an integer >= 1"),
        ({"s": -1}, 64, "s must be an integer >= 1"),
        ({"delta": -0.5}, 64, "delta must be a finite number >= 0"),
        ({"delta": float("nan")}, 64, "delta must be a finite number >= 0"),
        ({"max_clusters": 0}, 64, "max_clusters must be an integer >= 1"),
        ({"s": 60, "t": 8}, 64, "s \\+ t \\* max_clusters <= budget"),
        ({"max_clusters": 100}, 64, "s \\+ t \\* max_clusters <= budget"),
    ],
)
def test_bad_parameters_raise(params, budget, match):
    keys, values, _ = blobs(200)
    with pytest.raises(ValueError, match=match):
        kvc.compress("subgen", keys, values, budget=budget, **params)


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_generate_on_the_default_model(default_model, mode):
    """SubGen through kvc.generate: the cache stores s numerator slots + the window, the normalizer
    its cluster samples, all within the budget, and fewer bytes than the full cache."""
    from kvcompress.eval.tasks import line_retrieval

    model, tok = default_model
    sample = line_retrieval(target_tokens=400, depth=0.5, seed=0, tokenizer=tok)
    budget = 96
    res = kvc.generate(model, tok, sample.context, sample.question, method="subgen", budget=budget, mode=mode,
                       max_new_tokens=4, progress=False)
    assert len(res.token_ids) >= 1 and res.budget == budget
    assert res.kv_bytes < res.kv_bytes_full
    s = budget // 2
    exact_after = res.prompt_tokens - res.context_tokens + len(res.token_ids) - 1
    assert max(res.slots_per_layer) <= s + 64 + (exact_after if mode == "prefill" else 0)


def test_chunked_queries_over_a_normalizer_match_one_chunk(monkeypatch):
    """weighted_attention splits long query blocks into chunks (non-contiguous slices): same result with a normalizer."""
    import kvcompress.attention as attention

    keys, values, _ = blobs(300)
    summ = kvc.compress("subgen", keys, values, budget=64, window=16)
    q = torch.randn(1, 4, 40, 16, generator=torch.Generator().manual_seed(4))
    qpos = torch.arange(260, 300)
    whole = attention.weighted_attention(q, summ, query_positions=qpos)
    monkeypatch.setattr(attention, "_MAX_LOGITS", 2000)
    assert torch.allclose(attention.weighted_attention(q, summ, query_positions=qpos), whole, atol=1e-6)
