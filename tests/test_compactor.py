"""Compactor (the Compactor paper): leverage routes, chunked non-causal attention, blend, streaming, errors."""

import math
import re

import pytest
import torch
from scipy.stats import spearmanr
from torch.utils._python_dispatch import TorchDispatchMode

import kvcompress as kvc
from kvcompress.methods import compactor as cm
from kvcompress.methods.base import make_generator
from kvcompress.methods.budget import DEFAULT_SLACK, stream_split
from kvcompress.methods.registry import build_method
from kvcompress.methods.tokens import Tokens


def _low_rank_keys(b=1, h=2, n=400, d=64, rank=24, seed=0):
    """Keys with a decaying spectrum plus a few heavy rows, like real pre-RoPE keys (anisotropic, outliers)."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(rank, d, generator=g)
    coef = torch.randn(b, h, n, rank, generator=g) * torch.logspace(0, -1.5, rank)
    keys = coef @ basis + 0.05 * torch.randn(b, h, n, d, generator=g)
    heavy = torch.randint(0, n, (8,), generator=g)
    keys[:, :, heavy] *= 4
    return keys


def _layer(n=300, hkv=3, hq=9, d=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    pre = _low_rank_keys(1, hkv, n, d, seed=seed)
    keys = pre + 0.3 * torch.randn(1, hkv, n, d, generator=g)
    values = torch.randn(1, hkv, n, d, generator=g)
    queries = torch.randn(1, hq, n, d, generator=g)
    return keys.to(dtype), values.to(dtype), queries.to(dtype), pre.to(dtype)


def test_exact_leverage_matches_definition_and_sums_to_rank():
    keys = _low_rank_keys(n=200, d=32, rank=32)
    lev = cm.exact_leverage(keys)
    u = torch.linalg.svd(keys[0, 0].double(), full_matrices=False).U
    torch.testing.assert_close(lev[0, 0].double(), u.pow(2).sum(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lev.sum(-1), torch.full((1, 2), 32.0), rtol=1e-4, atol=1e-4)
    rank_deficient = torch.cat([keys[..., :8], torch.zeros(1, 2, 200, 24)], -1)
    torch.testing.assert_close(cm.exact_leverage(rank_deficient).sum(-1), torch.full((1, 2), 8.0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("route", ["sketch", "qr", "eig"])
def test_srht_with_full_dimension_is_exact(route):
    # With p = d the SRHT is an orthogonal rotation, so every sketched route recovers exact leverage.
    keys = _low_rank_keys(n=300, d=32, rank=32)
    approx = cm.leverage_scores(keys, route, "srht", 32, make_generator(1))
    torch.testing.assert_close(approx, cm.exact_leverage(keys), rtol=1e-3, atol=1e-4)


def test_srht_pads_non_power_of_two_dims():
    keys = _low_rank_keys(n=200, d=48, rank=48)
    phi = cm.sketch_matrix(48, 64, "srht", make_generator(0))
    assert phi.shape == (48, 64)
    # K·Phi has the column space of K (Phi has full row rank), so the SVD route is exact; QR is not
    # rank-revealing and counts the 16 spurious directions too (seed App. C: the less robust route).
    approx = cm.leverage_scores(keys, "sketch", "srht", 64, make_generator(0))
    torch.testing.assert_close(approx, cm.exact_leverage(keys), rtol=1e-3, atol=1e-3)
    assert cm.leverage_scores(keys, "qr", "srht", 64, make_generator(0)).sum(-1).min() > 60


@pytest.mark.parametrize("route,sketch", [("sketch", "gaussian"), ("qr", "gaussian"), ("eig", "gaussian"), ("sketch", "srht")])
def test_sketched_leverage_ranks_like_exact(route, sketch):
    keys = _low_rank_keys(n=600, d=64, rank=24)
    exact = cm.exact_leverage(keys)
    approx = cm.leverage_scores(keys, route, sketch, 64, make_generator(3))
    for h in range(keys.shape[1]):
        rho = spearmanr(exact[0, h].numpy(), approx[0, h].numpy()).statistic
        assert rho >= 0.8, (route, sketch, h, rho)
        top = exact[0, h].topk(60).indices
        assert len(set(top.tolist()) & set(approx[0, h].topk(60).indices.tolist())) >= 30


def test_sketch_is_reproducible_from_the_generator():
    keys = _low_rank_keys()
    a = cm.leverage_scores(keys, "sketch", "gaussian", 16, make_generator(5))
    b = cm.leverage_scores(keys, "sketch", "gaussian", 16, make_generator(5))
    c = cm.leverage_scores(keys, "sketch", "gaussian", 16, make_generator(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_leverage_of_full_row_rank_keys_ranks_nothing():
    # 14 tokens, head dimension 16: every exact leverage score is 1; the sketch's come out 1 ± rounding, which must not
    # be standardised into a ranking that changes with the sketch drawn.
    keys = torch.randn(1, 2, 14, 16, generator=torch.Generator().manual_seed(0)) * 3
    for seed in (5, 6):
        lev = cm.leverage_scores(keys, "sketch", "gaussian", 64, make_generator(seed))
        assert (lev - 1).abs().max() < 1e-5 and lev.std(-1).max() > 0  # rounding only, and not exactly 1
        assert torch.equal(cm.standardise(lev), torch.zeros_like(lev))
    spread = torch.tensor([[1.0, 1.0 + 2e-3, 1.0 - 2e-3]])  # above rounding: still standardised
    assert torch.allclose(cm.standardise(spread), torch.tensor([[0.0, 1.2247, -1.2247]]), atol=1e-3)
    assert torch.equal(cm.standardise(torch.zeros(1, 3)), torch.zeros(1, 3))


def _dense_block_noncausal(queries, keys, scale, chunk):
    """Reference: the full n x n non-causal matrix with a block-diagonal chunk mask, column sums, GQA mean."""
    b, hq, n, d = queries.shape
    hkv = keys.shape[1]
    k = keys.repeat_interleave(hq // hkv, dim=1)
    logits = queries.double() @ k.double().transpose(-1, -2) * scale
    block = torch.arange(n) // chunk
    logits = logits.masked_fill(block[:, None] != block[None, :], float("-inf"))
    cols = torch.softmax(logits, -1).sum(-2)
    return cols.reshape(b, hkv, hq // hkv, n).mean(2)


@pytest.mark.parametrize("n,chunk", [(30, 8), (64, 16), (20, 64)])
def test_chunked_attention_equals_dense(n, chunk):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 6, n, 16, generator=g), torch.randn(2, 2, n, 16, generator=g)
    got = cm.chunked_noncausal_attention(q, k, 0.25, chunk)
    torch.testing.assert_close(got.double(), _dense_block_noncausal(q, k, 0.25, chunk), rtol=1e-5, atol=1e-5)
    if chunk >= n:  # one chunk: the plain non-causal column sums softmax(QK^T) of seed Sec. 3.3
        assert torch.allclose(got.sum(-1), torch.full((2, 2), float(n)), atol=1e-4)


@pytest.mark.parametrize("scale", [3.0, -3.0])
def test_chunked_attention_redoes_rows_shifted_when_totals_leave_float32(monkeypatch, scale):
    # logits up to about ±300: unshifted, some exponentials overflow (scale 3) or whole rows underflow (-3)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 4, 40, 8, generator=g) * 4, torch.randn(1, 2, 40, 8, generator=g) * 4
    calls = []
    column_sums = cm._chunk_column_sums
    monkeypatch.setattr(cm, "_chunk_column_sums", lambda *args, shifted: calls.append(shifted) or column_sums(*args, shifted=shifted))
    got = cm.chunked_noncausal_attention(q, k, scale, 16)
    assert calls == [False, True]
    torch.testing.assert_close(got.double(), _dense_block_noncausal(q, k, scale, 16), rtol=1e-5, atol=1e-5)
    calls.clear()
    cm.chunked_noncausal_attention(q, k, 0.05, 16)  # small logits: the unshifted rows are kept
    assert calls == [False]


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces (a CPU memory probe)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_scoring_8k_tokens_never_forms_an_n_by_n_matrix():
    n, hq, d = 8192, 2, 64
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 1, n, d, generator=g), torch.randn(1, 1, n, d, generator=g)
    tokens = Tokens(keys, values, torch.arange(n).expand(1, 1, n), torch.randn(1, hq, n, d, generator=g), keys, 0.125, query_positions=torch.arange(n))
    method = cm.Compactor()
    with _LargestTensor() as probe:
        scores = method.blend(method.attention_scores(tokens), keys, make_generator(0))
    assert scores.shape == (1, 1, n) and torch.isfinite(scores).all()
    # The biggest tensor an op returns is one chunk's logits (H_q x C x C) or a view of the queries (H_q x n x d).
    assert probe.largest <= max(hq * 256 * 256, hq * n * d)
    assert probe.largest < n * n // 16


def test_keeps_budget_and_key_outliers_without_attention():
    keys, values, queries, pre = _layer(n=200)
    pre[:, :, [50, 120]] = 0
    pre[:, :, 50, 0] = 40.0  # a direction no other key uses: leverage 1
    pre[:, :, 120, 1] = 40.0
    s = kvc.compress("compactor", keys, values, pre_rope_keys=pre, budget=20, attention=False)
    assert s.num_slots == 20
    for h in range(3):
        assert {50, 120} <= set(s.positions[0, h].tolist())


def test_blend_weights_and_ablations_change_the_choice():
    keys, values, queries, pre = _layer(n=500)
    kept = {}
    for name, params in {"full": {}, "lam0": {"leverage_weight": 0.0}, "no_a": {"attention": False}, "exact": {"leverage": "exact"}}.items():
        s = kvc.compress("compactor", keys, values, queries=queries, pre_rope_keys=pre, compression_ratio=0.5, **params)
        assert s.num_slots == 250 and (s.positions.diff(dim=-1) > 0).all()
        kept[name] = s.positions
    # lambda = 0 keeps exactly the top of z(a): the pooled, value-scaled chunk attention.
    method = cm.Compactor()
    tokens = Tokens(keys, values, torch.arange(500).expand(1, 3, 500), queries, pre, 1 / 8, query_positions=torch.arange(500))
    a = method.attention_scores(tokens)
    assert torch.equal(kept["lam0"], a.topk(250).indices.sort().values)
    assert not torch.equal(kept["full"], kept["no_a"]) and not torch.equal(kept["full"], kept["lam0"])


def test_default_is_reproducible_and_half_precision_is_finite():
    keys, values, queries, pre = _layer(n=400)
    a = kvc.compress("compactor", keys, values, queries=queries, pre_rope_keys=pre, budget=100, seed=7)
    b = kvc.compress("compactor", keys, values, queries=queries, pre_rope_keys=pre, budget=100, seed=7)
    assert torch.equal(a.positions, b.positions)
    big = [t * 300 for t in (keys, values, queries, pre)]  # logits far beyond float16 range
    for dtype in (torch.float16, torch.bfloat16):
        s = kvc.compress("compactor", *[t.to(dtype) for t in big[:2]], queries=big[2].to(dtype), pre_rope_keys=big[3].to(dtype), budget=100)
        assert s.keys.dtype == dtype and s.num_slots == 100
    method = cm.Compactor()
    tokens = Tokens(*[t.half() for t in big[:2]], torch.arange(400).expand(1, 3, 400), big[2].half(), big[3].half(), 1 / 8, query_positions=torch.arange(400))
    assert torch.isfinite(method.blend(method.attention_scores(tokens), tokens.pre_rope_keys, make_generator(0))).all()


def test_sink_and_window_are_exact_and_queries_are_matched_by_position():
    keys, values, queries, pre = _layer(n=300)
    s = kvc.compress("compactor", keys, values, queries=queries, pre_rope_keys=pre, budget=50, sink=4, window=16)
    assert s.num_slots == 70
    assert s.positions[0, 0, :4].tolist() == [0, 1, 2, 3] and s.positions[0, 0, -16:].tolist() == list(range(284, 300))
    # the middle (tokens 4..283) is scored with the queries of tokens 4..283
    middle = Tokens(keys[:, :, 4:284], values[:, :, 4:284], torch.arange(4, 284).expand(1, 3, 280), queries[:, :, 4:284], pre[:, :, 4:284], 1 / 8)
    middle.query_positions = torch.arange(4, 284)
    method = cm.Compactor()
    ref = method.blend(method.attention_scores(middle), middle.pre_rope_keys, make_generator(0)).topk(50).indices.sort().values + 4
    assert torch.equal(s.positions[:, :, 4:54], ref)


@pytest.mark.parametrize("attention", [True, False])
@pytest.mark.parametrize("n", [512, 300])
def test_one_shot_equals_the_one_block_stream(n, attention):
    """A stream whose buffer holds one whole block (budget n, the block scored on arrival) re-compresses it to its target
    when the next token does not fit: that is the one-shot algorithm at the target (128 for this slack), with the next
    token added after it; compact() gives back the room and changes no slot."""
    keys, values, queries, pre = _layer(n=n + 1)
    slack = n / 128 - 1
    assert stream_split(n, slack) == (128, n - 128)
    block = slice(0, n)
    one = kvc.compress("compactor", keys[:, :, block], values[:, :, block], queries=queries[:, :, block], pre_rope_keys=pre[:, :, block],
                       budget=128, attention=attention, seed=2)
    st = kvc.stream("compactor", budget=n, attention=attention, seed=2, slack=slack)
    st.update(keys[:, :, block], values[:, :, block], queries[:, :, block], pre_rope_keys=pre[:, :, block])
    assert torch.equal(st.summary().positions, torch.arange(n).expand(1, 3, n))  # it fits the budget: held as it is
    st.update(keys[:, :, n:], values[:, :, n:], queries[:, :, n:], pre_rope_keys=pre[:, :, n:])
    streamed = st.summary()
    st.compact()
    assert torch.equal(st.summary().positions, streamed.positions) and st.state.slots.length == 129
    for a, b in ((one.positions, streamed.positions), (one.keys, streamed.keys), (one.values, streamed.values), (one.log_weights, streamed.log_weights)):
        assert torch.equal(a, b[:, :, :128])
    assert torch.equal(streamed.positions[:, :, 128], torch.full((1, 3), n)) and torch.equal(streamed.keys[:, :, 128], keys[:, :, n])


def _held_after(blocks: list[int], budget: int, target: int) -> int:
    """Slots a block-wise stream holds per head after absorbing blocks of these sizes: what is held is compressed back
    to `target` whenever the rest of a block does not fit the budget, and the block goes in in pieces that fit."""
    held = 0
    for rest in blocks:
        while rest:
            if held + rest > budget and held > target:
                held = target
            piece = min(rest, budget - held)
            held, rest = held + piece, rest - piece
    return held


def test_stream_stays_bounded_and_stores_scores_and_pre_rope_keys():
    keys, values, queries, pre = _layer(n=512)
    st = kvc.stream("compactor", budget=128)
    target, _ = stream_split(128, DEFAULT_SLACK)
    for start in range(0, 512, 256):
        sl = slice(start, start + 256)
        st.update(keys[:, :, sl], values[:, :, sl], queries[:, :, sl], pre_rope_keys=pre[:, :, sl])
        assert st.summary().num_slots <= 128 and st.state.peak_slots <= 128  # the block goes in in pieces within the budget
        held = _held_after([256] * (start // 256 + 1), 128, target)
        assert st.state.slots.view()[4].shape == (1, 3, held)  # the raw attention score of each held token
    assert st.nbytes() > st.summary().nbytes()  # pre-RoPE keys and scores are stored too


def test_errors_name_the_problem():
    keys, values, queries, pre = _layer(n=100)
    with pytest.raises(ValueError, match="pre_rope_keys"):
        kvc.compress("compactor", keys, values, queries=queries, budget=10)
    with pytest.raises(ValueError, match="queries"):
        kvc.compress("compactor", keys, values, pre_rope_keys=pre, budget=10)
    with pytest.raises(ValueError, match="query of every token"):
        kvc.compress("compactor", keys, values, queries=queries[:, :, -32:], pre_rope_keys=pre, budget=10)
    with pytest.raises(ValueError, match="window must be 0"):  # tokens would leave the window without their queries
        kvc.stream("compactor", budget=10, window=8)
    for bad in ({"leverage": "svd"}, {"sketch": "sparse"}, {"sketch_dim": 0}, {"chunk_size": 2.5}, {"kernel_size": 4}, {"leverage_weight": -1.0}, {"leverage_weight": math.nan}, {"attention": "yes"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            kvc.compress("compactor", keys, values, queries=queries, pre_rope_keys=pre, budget=10, **bad)


@pytest.fixture(scope="module")
def real_layers():
    """The default model and its shared prefill (every layer) of ~600 tokens of real prose."""
    from kvcompress.eval.capture import prose_text
    from kvcompress.eval.prefill_replay import SharedPrefill

    model, tok = kvc.load_model()
    ids = tok(prose_text(3000), add_special_tokens=False, return_tensors="pt")["input_ids"][:, :600]
    return model, tok, SharedPrefill(model, ids)


def _floored_exact_leverage(keys: torch.Tensor) -> torch.Tensor:
    """Exact leverage (float64 SVD of the keys themselves) with the sketch route's floor sigma^2 >= 1e-6·max."""
    u, s, _ = torch.linalg.svd(keys.double(), full_matrices=False)
    s2 = s.square()
    floored = torch.maximum(s2, cm._SIGMA2_FLOOR * s2.amax(-1, keepdim=True))
    return (u.square() * (s2 / floored)[..., None, :]).sum(-1)


@pytest.mark.e2e
def test_sketched_leverage_tracks_exact_on_real_keys(real_layers):
    # Every layer and KV head of the default model. Layer 0's pre-RoPE keys are nearly rank-deficient
    # (condition number ~1e8, 20-27 of 64 singular values below 1e-3 of the largest on ~1k-token
    # contexts): plain exact leverage counts those near-null directions as fully as the others, while
    # the sketch route floors sigma^2 at 1e-6 of its largest (seed App. C), so on layer 0 it tracks
    # plain exact leverage only at Spearman ~0.5-0.8 (measured in benchmarks/compactor_ablation.py).
    # Against exact leverage with the same floor (the quantity the sketch estimates) every head is
    # >= 0.8, and against plain exact leverage every head of layers 1-29 is.
    _, _, shared = real_layers
    for layer in sorted(shared.captured):
        pre = shared.pre_rope_keys(layer)
        plain = cm.exact_leverage(pre)
        floored = _floored_exact_leverage(pre)
        approx = cm.leverage_scores(pre, "sketch", "gaussian", 64, make_generator(layer))
        for h in range(pre.shape[1]):
            rho_floored = spearmanr(floored[0, h].numpy(), approx[0, h].numpy()).statistic
            assert rho_floored >= 0.8, (layer, h, rho_floored)
            if layer > 0:
                rho = spearmanr(plain[0, h].numpy(), approx[0, h].numpy()).statistic
                assert rho >= 0.8, (layer, h, rho)


@pytest.mark.e2e
def test_generate_with_compactor_matches_the_shared_prefill_replay(real_layers):
    import math as _math

    from kvcompress.eval import tasks
    from kvcompress.eval.prefill_replay import SharedPrefill
    from kvcompress.integration.model import build_prompt

    model, tok, _ = real_layers
    sample = tasks.generate_sample("niah_single", target_tokens=300, seed=0, tokenizer=tok)
    res = kvc.generate(model, tok, sample.context, sample.question, method="compactor", compression_ratio=0.5, max_new_tokens=12, progress=False)
    context_ids, question_ids = build_prompt(tok, sample.context, sample.question)
    n = context_ids.shape[1]
    # the context keeps ceil(0.5 n) tokens per head; question and answer follow exactly
    assert res.slots_per_layer == [_math.ceil(0.5 * n) + question_ids.shape[1] + len(res.token_ids) - 1] * 30
    replay = SharedPrefill(model, context_ids).answer_ids(question_ids, "compactor", 0.5, max_new_tokens=12)
    assert replay == res.token_ids


def test_leverage_weight_without_the_attention_term_is_refused_not_ignored():
    """attention=False scores by z(o) alone: a leverage_weight was accepted and silently did nothing."""
    with pytest.raises(ValueError, match=r"leverage_weight=0.5 weighs leverage against the attention term, which attention=False leaves out"):
        build_method("compactor", attention=False, leverage_weight=0.5)
    assert build_method("compactor", attention=False).leverage_weight == 0.3
    assert build_method("compactor").leverage_weight == 0.3
    assert build_method("compactor", leverage_weight=0.5).leverage_weight == 0.5
    with pytest.raises(ValueError, match="leverage_weight must be a finite number >= 0"):
        build_method("compactor", leverage_weight=-1.0)


@pytest.mark.parametrize("params, unused", [
    ({"attention": False, "chunk_size": 7}, "chunk_size=7"),
    ({"attention": False, "kernel_size": 31}, "kernel_size=31"),
    ({"leverage": "exact", "sketch": "srht"}, "sketch='srht'"),
    ({"leverage": "exact", "sketch_dim": 3}, "sketch_dim=3"),
])
def test_settings_that_cannot_act_are_refused_not_ignored(params, unused):
    with pytest.raises(ValueError, match=f"{re.escape(unused)} cannot act with attention="):
        build_method("compactor", **params)
    build_method("compactor", **{k: v for k, v in params.items() if k in ("attention", "leverage")})
