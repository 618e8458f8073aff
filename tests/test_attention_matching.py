"""Attention matching (Zweiger et al., "Fast KV Compaction via Attention Matching", arXiv:2602.16284): AdaKV's kept
slots refitted (`refit`) so they attend as the whole middle did for the scorer's queries."""

import sys

import pytest
import torch

import kvcompress as kvc
from kvcompress.integration import compress_context_ids, generate_ids
from kvcompress.methods.adakv import AdaKV, padded_index
from kvcompress.methods.kvzip import KVzip
from kvcompress.methods.snapkv import SnapKV
from kvcompress.methods.attention_matching import MIN_WEIGHT, _gram, fit_log_weights, kept_attention, refit_kept
from kvcompress.methods.registry import build_method
from kvcompress.methods.tokens import Tokens

from test_integration import _prompt, tiny

SCALE = 16 ** -0.5


def _tokens(n=200, d=16, group=2, queries=300, seed=0, dtype=torch.float32):
    """Keys near 12 centres per head (real keys cluster; a kept subset can stand for the rest only if they do)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(1, 2, 12, d, generator=g) * 2
    keys = centres.gather(2, torch.randint(12, (1, 2, n, 1), generator=g).expand(-1, -1, -1, d))
    keys = keys + 0.3 * torch.randn(1, 2, n, d, generator=g)
    values = torch.randn(1, 2, n, d, generator=g)
    q = torch.randn(1, 2 * group, queries, d, generator=g) * 2
    positions = torch.arange(n).expand(1, 2, n)
    return Tokens(keys.to(dtype), values.to(dtype), positions, queries=q.to(dtype), scale=SCALE)


def _middle(summary, queries):
    """(log mass [B, H_kv, r], output [B, H_kv, r, d]) of the middle `summary` for queries [B, H_q, q, d]."""
    b, hkv = summary.keys.shape[:2]
    rows = queries.float().reshape(b, hkv, -1, queries.shape[-1])
    logits = rows @ summary.keys.float().transpose(-1, -2) * SCALE + summary.log_weights.unsqueeze(2)
    return logits.logsumexp(-1), logits.softmax(-1) @ summary.values.float()


def test_keeping_every_token_fits_weight_one_and_the_tokens_own_values():
    """With every token kept the fit has nothing to restore: each weight is 1 (log-weight 0) and each value its own."""
    tokens = _tokens(n=40)
    log_weights, values = refit_kept(tokens, *padded_index(torch.ones(1, 2, 40, dtype=torch.bool)), tokens.values, values=True)
    torch.testing.assert_close(log_weights, torch.zeros(1, 2, 40), atol=2e-3, rtol=0)
    torch.testing.assert_close(values, tokens.values, atol=5e-3, rtol=0)


@pytest.mark.parametrize("refit", ["log_weights", "log_weights_values"])
def test_refitting_brings_the_reference_queries_attention_closer_to_the_whole_middle(refit):
    """For the queries it was fitted on, and for fresh queries like them, the refitted slots' mass is nearer the whole
    middle's (the squared relative error the fit minimises) than the plain kept tokens'; with values refitted, so is
    the attention output. The keys, positions and the number of slots are the plain kept tokens'."""
    tokens = _tokens()
    fresh = torch.randn(tokens.queries.shape, generator=torch.Generator().manual_seed(1)) * 2
    plain = AdaKV(scorer=SnapKV()).compress(tokens, 30, torch.Generator())
    fitted = AdaKV(scorer=SnapKV(), refit=refit).compress(tokens, 30, torch.Generator())
    assert torch.equal(fitted.keys, plain.keys) and torch.equal(fitted.positions, plain.positions)
    assert torch.equal(torch.isfinite(fitted.log_weights), torch.isfinite(plain.log_weights))
    assert (fitted.log_weights[torch.isfinite(fitted.log_weights)] >= torch.tensor(MIN_WEIGHT).log() - 1e-6).all()
    whole = tokens.exact()
    for queries in (tokens.queries, fresh):
        full_mass, full_out = _middle(whole, queries)
        plain_mass, plain_out = _middle(plain, queries)
        fitted_mass, fitted_out = _middle(fitted, queries)
        assert ((fitted_mass - full_mass).exp() - 1).square().mean() < 0.8 * ((plain_mass - full_mass).exp() - 1).square().mean()
        if refit == "log_weights_values":
            assert (fitted_out - full_out).norm(dim=-1).mean() < 0.8 * (plain_out - full_out).norm(dim=-1).mean()
        else:
            assert torch.equal(fitted.values, plain.values)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_with_large_keys_stays_finite(dtype):
    tokens = _tokens(dtype=dtype)
    tokens.keys.mul_(30)
    s = AdaKV(scorer=SnapKV(), refit="log_weights_values").compress(tokens, 30, torch.Generator())
    assert s.values.dtype == dtype
    assert torch.isfinite(s.values).all()
    assert torch.isfinite(s.log_weights[torch.isfinite(s.log_weights)]).all() and not torch.isnan(s.log_weights).any()


def test_in_a_cache_the_refitted_slots_are_stored_and_a_budget_above_the_context_is_the_full_cache():
    model = tiny()
    ctx, question = _prompt(n=200)
    options = dict(method="adakv", sink=2, window=8, refit="log_weights_values")
    cache = compress_context_ids(model, ctx, budget=40, **options)
    stored = [layer.stored() for layer in cache.layers]
    assert all(int(torch.isfinite(s.log_weights).sum()) == 2 * (2 + 8 + 40) for s in stored)
    assert any((s.log_weights.abs() > 1e-3).any() for s in stored)
    full = generate_ids(model, ctx, question, method=None, max_new_tokens=8, stop_at_eos=False)
    wide = generate_ids(model, ctx, question, budget=500, max_new_tokens=8, stop_at_eos=False, **options)
    assert wide.token_ids == full.token_ids
    narrow = generate_ids(model, ctx, question, budget=40, max_new_tokens=8, stop_at_eos=False, **options)
    assert len(narrow.token_ids) == 8


def test_bad_refits_are_refused_by_name():
    for bad in ("values", None, 1):
        with pytest.raises(ValueError, match="refit must be one of"):
            build_method("adakv", refit=bad)
    with pytest.raises(ValueError, match="scorer 'knorm' takes none"):
        build_method("adakv", scorer="knorm", refit="log_weights")
    with pytest.raises(ValueError, match="cannot be combined with evicted_slots=2"):
        build_method("adakv", refit="log_weights", evicted_slots=2)
    with pytest.raises(ValueError, match="refit='log_weights' has no stream"):
        kvc.stream("adakv", budget=8, refit="log_weights")
    model = tiny()
    ctx, question = _prompt(n=100)
    for mode in ("chunked", "decode"):
        with pytest.raises(ValueError, match=f"refit='log_weights' runs in mode 'prefill' only, got mode='{mode}'"):
            generate_ids(model, ctx, question, method="adakv", budget=20, mode=mode, refit="log_weights", max_new_tokens=2)


def test_the_mass_fit_reaches_the_non_negative_least_squares_optimum():
    """Each head's weights are the non-negative least-squares solution of Σ_j kept_ij w_j ≈ 1 (scipy's active-set
    solver as the reference), up to the floor `MIN_WEIGHT`: the fitted objective is within 1 % of the optimum's."""
    from scipy.optimize import nnls

    tokens = _tokens()
    kept_mask, _, _ = AdaKV(scorer=SnapKV()).allocate(tokens, 30, torch.Generator())
    index, real = padded_index(kept_mask)
    kept, _ = kept_attention(tokens, index, real, outputs=False)
    weights = fit_log_weights(kept, real).exp()
    for head in range(2):
        count = int(real[0, head].sum())
        columns = kept[0, head, :, :count].double()
        fitted = (columns @ weights[0, head, :count].double() - 1).square().sum()
        optimum = nnls(columns.numpy(), torch.ones(columns.shape[0], dtype=torch.float64).numpy())[1] ** 2
        assert optimum <= fitted <= 1.01 * optimum + 1e-6


def test_the_gram_products_formed_block_by_block_above_the_diagonal_are_each_heads_whole_product():
    """Heads keep ragged numbers of slots (a prefix each, zero columns after): each head's Gram matrix is its own
    columns' product, formed in blocks on and above the diagonal and mirrored (GRAM_BLOCK 256: one to three blocks
    here, the last partial); the rest is 0."""
    g = torch.Generator().manual_seed(3)
    counts = torch.tensor([[600, 300, 257, 0]])
    real = torch.arange(600) < counts.unsqueeze(-1)
    matrix = torch.rand(1, 4, 50, 600, generator=g) * real.unsqueeze(2)
    gram = _gram(matrix, real)
    expected = (matrix.double().transpose(-1, -2) @ matrix.double()).float()
    torch.testing.assert_close(gram, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("refit", ["log_weights", "log_weights_values"])
@pytest.mark.parametrize("reference_queries", [16384, 70])
def test_kvzips_normalisers_handed_to_the_refit_give_the_fit_formed_without_them(refit, reference_queries, monkeypatch):
    """KVzip forms every reconstruction query's log-sum-exp over the middle while scoring (its normaliser also spans the
    exact keys and the forward's own, which the middle's does not) and AdaKV hands it to the refit; the slots are
    those of a refit that forms the normalisers itself, also when only every k-th query is a reference query."""
    monkeypatch.setattr(sys.modules["kvcompress.methods.attention_matching"], "REFERENCE_QUERIES", reference_queries)
    plain = _tokens()
    g = torch.Generator().manual_seed(5)
    tokens = Tokens(plain.keys, plain.values, plain.positions, queries=plain.queries, scale=SCALE,
                    exact_keys=torch.randn(1, 2, 6, 16, generator=g), extra_lse=torch.randn(1, 4, 300, generator=g))
    method = AdaKV(scorer=KVzip(), refit=refit)
    kept, _, middle_lse = method.allocate(tokens, 30, torch.Generator())
    assert middle_lse is not None and middle_lse.shape == (1, 2, 600)
    handed = method.compress(tokens, 30, torch.Generator())
    formed = method.summary(tokens, kept)  # no normalisers given: the refit forms them
    assert torch.equal(handed.keys, formed.keys) and torch.equal(handed.positions, formed.positions)
    torch.testing.assert_close(handed.log_weights, formed.log_weights, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(handed.values, formed.values, atol=1e-4, rtol=1e-4)
    assert (handed.log_weights[torch.isfinite(handed.log_weights)].abs() > 1e-2).any()  # a fit that moved the weights


@pytest.mark.cuda
@pytest.mark.parametrize("refit", ["log_weights", "log_weights_values"])
def test_cuda_refit_stays_on_the_device_and_matches_the_cpu_fit(refit):
    """The fit is batched tensor code: on a GPU it keeps every tensor there and gives the CPU's slots in float32;
    in bfloat16 it stays finite."""
    tokens = _tokens()
    on_cpu = AdaKV(scorer=SnapKV(), refit=refit).compress(tokens, 30, torch.Generator())
    moved = Tokens(*(t.cuda() for t in (tokens.keys, tokens.values, tokens.positions)), queries=tokens.queries.cuda(), scale=SCALE)
    on_gpu = AdaKV(scorer=SnapKV(), refit=refit).compress(moved, 30, torch.Generator())
    assert on_gpu.keys.is_cuda and on_gpu.values.is_cuda and on_gpu.log_weights.is_cuda
    assert torch.equal(on_gpu.positions.cpu(), on_cpu.positions)
    torch.testing.assert_close(on_gpu.log_weights.cpu(), on_cpu.log_weights, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(on_gpu.values.cpu(), on_cpu.values, atol=1e-3, rtol=1e-3)
    half = Tokens(*(t.to(torch.bfloat16) for t in (moved.keys, moved.values)), moved.positions,
                  queries=moved.queries.to(torch.bfloat16), scale=SCALE)
    s = AdaKV(scorer=SnapKV(), refit=refit).compress(half, 30, torch.Generator())
    assert s.values.dtype == torch.bfloat16 and torch.isfinite(s.values).all()
    assert not torch.isnan(s.log_weights).any()


@pytest.mark.parametrize("width", [130, 160, 200])
def test_the_values_fit_solves_its_normal_equations_at_two_threads(width):
    """The values' fit at 2 threads (CI's) on the widths where the CPU build's batched LU solve returned garbage or
    raised: every head's fitted values satisfy its ridged normal equations, as a solve of that head alone does."""
    from kvcompress.methods.attention_matching import VALUE_RIDGE, fit_values

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(width)
        kept = torch.rand(1, 3, 4 * width, width, generator=g) ** 4 / width
        real = torch.ones(1, 3, width, dtype=torch.bool)
        real[0, 1, width // 2 :] = False
        kept = kept * real.unsqueeze(2)
        local, own = torch.randn(1, 3, 4 * width, 16, generator=g), torch.randn(1, 3, width, 16, generator=g)
        log_weights = torch.zeros(1, 3, width).masked_fill(~real, float("-inf"))
        fitted = fit_values(kept, local, own, real, log_weights)
    finally:
        torch.set_num_threads(threads)
    assert torch.isfinite(fitted).all()
    attention = kept * log_weights.exp().unsqueeze(2)
    attention = attention / attention.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    for head in range(3):
        count = int(real[0, head].sum())
        a = attention[0, head, :, :count].double()
        gram = a.T @ a
        ridge = VALUE_RIDGE * (a.square().sum(0).sum() / width)  # the mean diagonal over the head's padded width
        want = torch.linalg.solve(gram + ridge * torch.eye(count, dtype=torch.float64),
                                  a.T @ local[0, head].double() + ridge * own[0, head, :count].double())
        assert torch.allclose(fitted[0, head, :count].double(), want, rtol=1e-4, atol=1e-4), head
        assert (fitted[0, head, count:] == 0).all()
