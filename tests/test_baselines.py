"""Baselines as their papers define them: attention-mass scorers (SnapKV, PyramidKV, H2O, TOVA),
PyramidKV's clamped budgets and ExpectedAttention's Gaussian expectation."""

import itertools
import math

import pytest
import torch

import kvcompress as kvc
from kvcompress.methods.base import first_true
from kvcompress.methods.registry import build_method, get_method_class
from kvcompress.methods.tokens import attention_mass, Tokens
from kvcompress.methods.pyramidkv import layer_budget

torch.set_num_threads(1)


def layer(n=120, hkv=3, group=3, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, hkv, n, d, generator=g)
    v = torch.randn(1, hkv, n, d, generator=g)
    q = 2.0 * torch.randn(1, hkv * group, n, d, generator=g)
    return k, v, q


def reference_mass(q, k, scale, query_positions, average="group"):
    """[1, H_kv, n]: column sums of the causal softmax over all n keys, averaged over a GQA group or the layer."""
    hkv, n = k.shape[1], k.shape[2]
    logits = torch.einsum("bhqd,bhnd->bhqn", q.double(), k.repeat_interleave(q.shape[1] // hkv, 1).double()) * scale
    hidden = torch.arange(n)[None, :] > query_positions[:, None]
    mass = logits.masked_fill(hidden, float("-inf")).softmax(-1).sum(2)
    mass = mass.reshape(1, hkv, -1, n).mean(2)
    return mass.mean(1, keepdim=True).expand_as(mass) if average == "layer" else mass


@pytest.mark.parametrize("average, key_scale", [("group", 1.0), ("layer", 1.0), ("group", 50.0)])
def test_attention_mass_softmax_runs_over_every_key_sink_and_window_included(average, key_scale):
    """The middle's scores are its columns of the full causal softmax, sink and window keys in the denominator
    (keys x50: logits far beyond float32's exp range take the max-shifted path)."""
    k, v, q = layer()
    k = k * key_scale
    n, sink, window, scale = k.shape[2], 8, 20, 0.3
    pos = torch.arange(n).expand(1, 3, n)
    whole = Tokens(k, v, pos, q, scale=scale, query_positions=torch.arange(n))
    middle = whole.slice(sink, n - window)
    exact = torch.cat([torch.arange(sink), torch.arange(n - window, n)])
    middle.exact_keys, middle.exact_positions = k[:, :, exact], exact.expand(1, 3, -1)
    expected = reference_mass(q, k, scale, torch.arange(n), average)[..., sink : n - window]
    got = attention_mass(middle, average=average, max_logits=5000)  # several query chunks
    assert torch.allclose(got.double(), expected, atol=1e-5)
    without = attention_mass(whole.slice(sink, n - window), average=average)
    assert not torch.allclose(without.double(), expected, atol=1e-3), "the sink and window must change the scores"


@pytest.mark.parametrize("method, last", [("h2o", None), ("snapkv", 32), ("tova", 1)])
def test_scorers_keep_the_top_of_the_full_softmax(method, last):
    k, v, q = layer(n=160, seed=1)
    n, sink, window, budget = 160, 4, 16, 30
    qpos = torch.arange(n)[-last:] if last else torch.arange(n)
    average = "layer" if method == "tova" else "group"
    mass = reference_mass(q[:, :, qpos], k, 0.25, qpos, average)[..., sink : n - window]
    params = {"kernel_size": 1} if method == "snapkv" else {}
    s = kvc.compress(method, k, v, queries=q, budget=budget, sink=sink, window=window, scale=0.25, **params)
    kept = s.positions[..., sink : sink + budget].sort(-1).values
    assert torch.equal(kept, (mass.topk(budget, -1).indices + sink).sort(-1).values)


def test_tova_averages_over_all_heads_of_the_layer_and_per_group_on_request():
    k, v, q = layer(n=100, seed=2)
    layer_wide = kvc.compress("tova", k, v, queries=q, budget=10, sink=0, window=0)
    assert all(torch.equal(layer_wide.positions[0, 0], layer_wide.positions[0, h]) for h in range(3))
    mass = reference_mass(q[:, :, -1:], k, 0.25, torch.tensor([99]), "group")
    per_group = kvc.compress("tova", k, v, queries=q, budget=10, sink=0, window=0, average="group")
    assert torch.equal(per_group.positions, mass.topk(10, -1).indices.sort(-1).values)
    assert not torch.equal(per_group.positions, layer_wide.positions)
    with pytest.raises(ValueError, match="average must be one of"):
        kvc.compress("tova", k, v, queries=q, budget=10, average="head")


def test_tova_defaults_rank_every_token_by_the_last_query_of_the_layer():
    """TOVA as its paper defines it: no protected sink or window, so at a compression ratio every token, the
    scoring query's own included, competes; the kept ones are the ceil((1 - r)·n) with the highest attention of
    the last query (softmax over every key), averaged over all heads of the layer."""
    k, v, q = layer(n=101, seed=4)
    n, ratio = k.shape[2], 0.75
    s = kvc.compress("tova", k, v, queries=q, compression_ratio=ratio, scale=0.25)
    kept = math.ceil((1 - ratio) * n)
    mass = reference_mass(q[:, :, -1:], k, 0.25, torch.tensor([n - 1]), "layer")
    expected = mass.topk(kept, -1).indices.sort(-1).values
    assert torch.equal(s.positions, expected)
    assert not {0, n - 1} <= set(expected[0, 0].tolist()), "this case shows that neither end of the context is protected"


def test_stream_scores_see_the_sink_and_the_window():
    """In a stream, tokens leaving the window are scored with the sink and the tokens still in the window."""
    k, v, q = layer(n=96, seed=3)
    seen = []
    cls = get_method_class("h2o")
    original = cls.score

    def spy(self, tokens, generator):
        seen.append((tokens.positions[0, 0].clone(), tokens.exact_positions[0, 0].clone()))
        return original(self, tokens, generator)

    cls.score = spy
    try:
        st = kvc.stream("h2o", budget=8, sink=4, window=16)
        for start in range(0, 96, 32):
            st.update(k[:, :, start : start + 32], v[:, :, start : start + 32], q[:, :, start : start + 32])
    finally:
        cls.score = original
    _, exact = seen[-1]
    assert torch.equal(exact, torch.cat([torch.arange(4), torch.arange(80, 96)]))


def test_pyramidkv_clamps_budgets_and_redistributes_the_excess():
    layers, budget = 30, 100
    free = [layer_budget(budget, i, layers, 20.0) for i in range(layers)]
    assert max(free) > 150
    clamped = [layer_budget(budget, i, layers, 20.0, available=150) for i in range(layers)]
    assert max(clamped) == 150 and clamped == sorted(clamped, reverse=True)
    assert abs(sum(clamped) / layers - budget) < 1.0, "the excess goes to the deeper layers"
    assert [layer_budget(budget, i, layers, 20.0, available=1000) for i in range(layers)] == free
    k, v, q = layer(n=190, seed=4)
    kept = [kvc.compress("pyramidkv", k, v, queries=q, budget=budget, sink=4, window=36, layer=(i, layers)).num_slots - 40
            for i in (0, 29)]
    assert kept == [clamped[0], clamped[29]]


def test_expected_attention_is_the_gaussian_expectation_of_exp_scores():
    """Queries drawn from N(μ, Σ): scores match the Monte-Carlo mean of exp(s<q,k>) normalised over the keys."""
    g = torch.Generator().manual_seed(5)
    d, n, samples = 8, 40, 200_000
    k = torch.randn(1, 1, n, d, generator=g)
    v = torch.randn(1, 1, n, d, generator=g)
    mix = 0.4 * torch.randn(d, d, generator=g)
    mu = torch.randn(d, generator=g)
    q = (mu + torch.randn(samples, d, generator=g) @ mix.T)[None, None]
    s = 1 / math.sqrt(d)
    monte_carlo = (torch.einsum("qd,nd->qn", q[0, 0].double(), k[0, 0].double()) * s).exp().mean(0)
    monte_carlo = monte_carlo / monte_carlo.sum()
    method = get_method_class("expected_attention")(n_future_positions=samples, use_vnorm=False)
    tokens = Tokens(k, v, torch.arange(n).expand(1, 1, n), q, scale=s)
    score = method.score(tokens, torch.Generator())
    assert torch.allclose(score[0, 0].double(), monte_carlo, rtol=0.03)
    with_norm = get_method_class("expected_attention")(n_future_positions=samples).score(tokens, torch.Generator())
    assert torch.allclose(with_norm, score * v.norm(dim=-1))
    mean_only = get_method_class("expected_attention")(n_future_positions=samples, use_covariance=False, use_vnorm=False)
    assert torch.allclose(mean_only.score(tokens, torch.Generator())[0, 0], (k[0, 0] @ q[0, 0].mean(0) * s).softmax(-1), atol=1e-6)


@pytest.mark.parametrize("use_covariance", [True, False])
def test_expected_attention_per_query_head_with_gqa_and_exact_keys(use_covariance):
    """Each query head's own Gaussian expectation, softmax over the tokens and the exact keys, mean over the GQA group."""
    g = torch.Generator().manual_seed(6)
    b, hkv, group, n, m, d, future = 2, 3, 4, 30, 5, 8, 12
    k, v = torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    q = torch.randn(b, hkv * group, 20, d, generator=g)
    exact = torch.randn(b, hkv, m, d, generator=g)
    s = 0.3
    tokens = Tokens(k, v, torch.arange(n).expand(b, hkv, n), q, scale=s, exact_keys=exact,
                    exact_positions=torch.arange(n, n + m).expand(b, hkv, m))
    got = get_method_class("expected_attention")(n_future_positions=future, use_covariance=use_covariance).score(tokens, torch.Generator())
    want = torch.zeros(b, hkv, n, dtype=torch.float64)
    for i, h in itertools.product(range(b), range(hkv * group)):
        recent = q[i, h, -future:].double()
        mu, centred = recent.mean(0), recent - recent.mean(0)
        keys = torch.cat([k[i, h // group], exact[i, h // group]]).double()
        logits = s * keys @ mu
        if use_covariance:
            logits += 0.5 * s * s * ((keys @ (centred.T @ centred / future)) * keys).sum(-1)
        want[i, h // group] += logits.softmax(0)[:n] / group
    assert torch.allclose(got.double(), want * v.double().norm(dim=-1), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("params, match", [
    ({"n_future_positions": 0}, "n_future_positions must be an integer >= 1"),
    ({"use_covariance": 1}, "use_covariance must be True or False"),
    ({"epsilon": -1.0}, "epsilon must be a finite number >= 0"),
    ({"epsilon": float("inf")}, "epsilon must be a finite number >= 0"),
    ({"epsilon": 5.0, "use_vnorm": False}, "epsilon=5.0 is added to the scores before the value-norm scaling, which use_vnorm=False leaves out"),
])
def test_expected_attention_rejects_bad_parameters(params, match):
    k, v, q = layer(n=50)
    with pytest.raises(ValueError, match=match):
        kvc.compress("expected_attention", k, v, queries=q, budget=10, **params)


def test_expected_attention_through_the_api_keeps_budget_and_sink():
    k, v, q = layer(n=200, seed=6)
    s = kvc.compress("expected_attention", k, v, queries=q, budget=50, sink=4, window=8)
    assert s.num_slots == 62 and s.positions[0, 0, :4].tolist() == [0, 1, 2, 3]
    assert "expected_attention" in kvc.methods()


@pytest.mark.parametrize("beta", ["x", [1], True, 0.5, float("nan")])
def test_pyramidkv_refuses_a_beta_that_is_not_a_finite_number_from_one(beta):
    with pytest.raises(ValueError, match=r"beta must be a finite number >= 1 \(the ratio of the first layer's budget to the last's\), got"):
        build_method("pyramidkv", beta=beta)


def test_keydiff_pairwise_refuses_an_anchor_it_does_not_build():
    with pytest.raises(ValueError, match="normalize_anchor=False builds an anchor vector from the raw keys, which anchor='pairwise'"):
        build_method("keydiff", anchor="pairwise", normalize_anchor=False)
    assert build_method("keydiff", anchor="median", normalize_anchor=False).normalize_anchor is False


def test_pyramidkv_without_its_layer_is_an_error_not_snapkv():
    k, v, q = (torch.randn(1, 2, 200, 16) for _ in range(3))
    with pytest.raises(ValueError, match=r"pyramidkv.*layer=\(layer_idx, num_layers\)"):
        kvc.compress("pyramidkv", k, v, queries=q, budget=50)
    with pytest.raises(ValueError, match=r"layer must be \(layer_idx, num_layers\)"):
        kvc.compress("pyramidkv", k, v, queries=q, budget=50, layer=(3, 2))
    lone = kvc.compress("pyramidkv", k, v, queries=q, budget=50, layer=(0, 1))
    assert torch.equal(lone.positions, kvc.compress("snapkv", k, v, queries=q, budget=50).positions)  # one layer: nothing to redistribute
    deep = kvc.compress("pyramidkv", k, v, queries=q, budget=50, layer=(5, 6))
    assert deep.num_slots < lone.num_slots


@pytest.mark.parametrize("kept", [5, 12])
def test_first_true_gives_the_first_trues_in_order_by_sort_and_by_nonzero_when_the_count_is_exact(kept):
    """The first `count` Trues of each row, ascending: by the stable sort whatever each row holds, and by `nonzero`
    (exact=True) when every row holds exactly `count`."""
    g = torch.Generator().manual_seed(0)
    count = 5
    scores = torch.rand(2, 3, 40, generator=g)
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, scores.topk(kept, dim=-1).indices, True)
    expected = torch.tensor([[[i for i in range(40) if row[i]][:count] for row in head] for head in mask.tolist()])
    assert torch.equal(first_true(mask, count), expected)
    if kept == count:
        assert torch.equal(first_true(mask, count, exact=True), expected)


def test_pyramidkv_streams_lower_layers_keep_what_they_hold_at_compact():
    """A lower layer keeps its larger share while it streams, with the slack beside it; compact() (the end of a chunked
    prompt) gives back the buffer's spare room and keeps every slot held, as every other stream's compact() does (it
    dropped the slots past the share)."""
    from kvcompress.methods.registry import get_method_class

    g = torch.Generator().manual_seed(0)
    state = get_method_class("pyramidkv")().new_stream(32, torch.Generator().manual_seed(0))
    for start in range(0, 300, 25):
        k, v, q = torch.randn(1, 2, 25, 16, generator=g), torch.randn(1, 2, 25, 16, generator=g), torch.randn(1, 4, 25, 16, generator=g)
        state.absorb(Tokens(keys=k, values=v, positions=torch.arange(start, start + 25).expand(1, 2, 25), queries=q, scale=0.25,
                            query_positions=torch.arange(start, start + 25), layer_idx=0, num_layers=12))
    held = state.slots.length
    assert state.budget < held <= state.limit + state.slack_slots and held > state.limit  # its share and some of the slack
    before = state.summary()
    state.compact()
    after = state.summary()
    assert state.slots.length == held and state.nbytes() == after.nbytes()  # no spare room left
    assert torch.equal(after.positions, before.positions) and torch.equal(after.keys, before.keys)
