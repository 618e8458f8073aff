"""The public API: registry, parameter checks, sink/window handling, both compressor shapes for every method."""

import math

import pytest
import torch

import kvcompress as kvc
from kvcompress.methods.budget import DEFAULT_SLACK
from kvcompress.methods.registry import build_method
from kvcompress.methods.pyramidkv import layer_budget

BASELINES = ["streamingllm", "random", "knorm", "snapkv", "tova", "h2o", "pyramidkv"]


def _kv(n=300, b=1, hkv=3, hq=9, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hq, n, d, generator=g))


def _inputs(name, k, q):
    cls = build_method(name)
    return {"queries": q, "pre_rope_keys": k if cls.requirements.needs("pre_rope_keys") else None, "layer": (0, 1)}  # a lone layer: PyramidKV keeps `budget`


def test_registry_lists_the_baselines():
    assert set(BASELINES) <= set(kvc.methods())


@pytest.mark.parametrize("first", ["import kvcompress.methods.budget as budget", "import kvcompress as kvc; kvc.methods()"])
def test_kvc_methods_lists_the_methods_and_the_method_modules_import_by_their_full_names(first):
    """`kvc.methods` is the package `kvcompress.methods`, callable: `import kvcompress.methods.budget as budget` and
    `kvcompress.methods.budget.stream_split` work whichever is imported first (a fresh process each: the order matters)."""
    import subprocess
    import sys

    script = (f"{first}\nimport kvcompress as kvc\nimport kvcompress.methods.budget\nimport kvcompress.methods.budget as budget\n"
              "assert kvc.methods is kvcompress.methods and kvc.methods.budget is budget and kvcompress.methods.budget.stream_split\n"
              "from kvcompress import methods\nassert methods() == kvc.methods() and 'snapkv' in methods() and 'methods' in kvc.__all__\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", BASELINES)
def test_budget_sink_window_exact(name):
    k, v, q = _kv()
    s = kvc.compress(name, k, v, budget=50, sink=4, window=16, **_inputs(name, k, q))
    finite = torch.isfinite(s.log_weights).sum(-1)
    assert int(finite.max()) <= 4 + 50 + 16
    for h in range(3):
        kept = set(s.positions[0, h][torch.isfinite(s.log_weights[0, h])].tolist())
        assert set(range(4)) <= kept and set(range(284, 300)) <= kept
        # kept slots carry their own keys and values
        idx = s.positions[0, h]
        torch.testing.assert_close(s.keys[0, h], k[0, h, idx])
        torch.testing.assert_close(s.values[0, h], v[0, h, idx])


@pytest.mark.parametrize("name", BASELINES)
def test_stream_is_bounded_and_keeps_sink_window(name):
    k, v, q = _kv(n=1000)
    st = kvc.stream(name, budget=40, sink=4, window=16)
    for i in range(0, 1000, 64):
        st.update(k[:, :, i : i + 64], v[:, :, i : i + 64], queries=q[:, :, i : i + 64], layer_idx=0, num_layers=1)
        s = st.summary()
        assert s.num_slots <= 4 + 40 + math.ceil(DEFAULT_SLACK * 40) + 16  # sink + budget + slack + window
    pos = set(s.positions[0, 0].tolist())
    assert set(range(4)) <= pos and set(range(984, 1000)) <= pos


@pytest.mark.parametrize("name", BASELINES)
def test_ratio_zero_keeps_everything(name):
    k, v, q = _kv(n=120)
    s = kvc.compress(name, k, v, compression_ratio=0.0, **_inputs(name, k, q))
    assert s.num_slots == 120
    torch.testing.assert_close(s.keys, k)
    assert (s.log_weights == 0).all()


def test_compression_ratio_counts_every_token():
    k, v, q = _kv(n=200)
    s = kvc.compress("knorm", k, v, compression_ratio=0.75, sink=4, window=16)
    assert s.num_slots == math.ceil(0.25 * 200)


def test_random_is_reproducible_and_seeded():
    k, v, _ = _kv()
    a = kvc.compress("random", k, v, budget=30, seed=1)
    b = kvc.compress("random", k, v, budget=30, seed=1)
    c = kvc.compress("random", k, v, budget=30, seed=2)
    assert torch.equal(a.positions, b.positions) and not torch.equal(a.positions, c.positions)
    w = kvc.compress("random", k, v, budget=30, sink=0, window=0, weighted=True)
    torch.testing.assert_close(w.total_weight(), torch.full((1, 3), 300.0, dtype=torch.float64))


def test_streamingllm_keeps_most_recent():
    k, v, _ = _kv(n=100)
    s = kvc.compress("streamingllm", k, v, budget=10, sink=4, window=6)
    assert s.positions[0, 0].tolist() == list(range(4)) + list(range(84, 100))


def test_snapkv_keeps_what_the_last_queries_attend_to():
    k, v, q = _kv(n=200, d=16)
    q = q.clone()
    q[:, :, -32:] = 0
    q[:, :, -32:] += 8 * k[:, :, 77].repeat_interleave(3, dim=1)[:, :, None, :] / k[:, :, 77].norm(dim=-1, keepdim=True).repeat_interleave(3, dim=1)[:, :, None, :]
    s = kvc.compress("snapkv", k, v, queries=q, budget=10, sink=0, window=0, kernel_size=1)
    assert (s.positions == 77).any(-1).all()


def test_pyramidkv_layer_budgets_average_to_budget():
    budgets = [layer_budget(100, layer, 30, 20.0) for layer in range(30)]
    assert budgets[0] > budgets[-1] and abs(sum(budgets) / 30 - 100) < 1.0
    k, v, q = _kv(n=400)
    low = kvc.compress("pyramidkv", k, v, queries=q, budget=100, sink=0, window=0, layer=(0, 30))
    high = kvc.compress("pyramidkv", k, v, queries=q, budget=100, sink=0, window=0, layer=(29, 30))
    assert low.num_slots == budgets[0] and high.num_slots == budgets[-1]


def test_h2o_is_causal_when_queries_match_tokens():
    k, v, q = _kv(n=50)
    s = kvc.compress("h2o", k, v, queries=q, budget=5, sink=0, window=0)
    # The first token receives the full attention of query 0: it is a heavy hitter under causal scoring.
    assert (s.positions[..., 0] == 0).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"compression_ratio": 1.0}, r"compression_ratio must be in \[0, 1\)"),
        ({"compression_ratio": -0.1}, r"compression_ratio must be in \[0, 1\)"),
        ({"compression_ratio": float("nan")}, r"compression_ratio must be in \[0, 1\)"),
        ({"budget": 0}, "budget must be an integer >= 1"),
        ({"budget": 10, "compression_ratio": 0.5}, "exactly one of budget"),
        ({}, "exactly one of budget"),
        ({"budget": 10, "sink": -1}, "sink must be an integer >= 0"),
        ({"budget": 10, "bogus": 3}, r"has no parameter\(s\) \['bogus'\]"),
        ({"compression_ratio": 0.99, "sink": 4, "window": 16}, "does not leave room beyond sink"),
    ],
)
def test_bad_parameters_are_named(kwargs, match):
    k, v, _ = _kv()
    with pytest.raises(ValueError, match=match):
        kvc.compress("knorm", k, v, **kwargs)


def test_unknown_method_lists_known_ones():
    k, v, _ = _kv()
    with pytest.raises(ValueError, match="unknown method 'nope'; known methods: .*knorm.*snapkv"):
        kvc.compress("nope", k, v, budget=3)


def test_bad_tensors_are_named():
    k, v, q = _kv()
    bad = k.clone()
    bad[0, 0, 3, 0] = float("nan")
    with pytest.raises(ValueError, match="keys contain NaN"):
        kvc.compress("knorm", bad, v, budget=3)
    with pytest.raises(ValueError, match="empty context"):
        kvc.compress("knorm", k[:, :, :0], v[:, :, :0], budget=3)
    with pytest.raises(ValueError, match="keys must hold at least one batch row and one KV head"):
        kvc.compress("knorm", k[:0], v[:0], budget=3)
    with pytest.raises(ValueError, match="values must have the keys' dtype torch.float32, got tensor .* float16"):
        kvc.compress("knorm", k, v.half(), budget=3)
    with pytest.raises(ValueError, match=r"scores tokens with queries: pass queries"):
        kvc.compress("snapkv", k, v, budget=3)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        kvc.compress("snapkv", k, v, queries=q[:, :4], budget=3)


def test_cli_method_parameters_are_parsed():
    from kvcompress.commands.common import parse_params

    assert parse_params(["anchor=median", "block_size=128", "beta=2.5", "weighted=true"]) == {
        "anchor": "median", "block_size": 128, "beta": 2.5, "weighted": True,
    }
    # None, where a parameter's documented setting is None (ClusterGen's block_size, BalanceKV's step); "none" stays text
    assert parse_params(["block_size=None", "refit=none"]) == {"block_size": None, "refit": "none"}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_params(["anchor"])
    # a dotted name sets a parameter's own parameters (AdaKV's scorer's)
    assert parse_params(["scorer=kvzap", "scorer_params.scorer=my.safetensors", "scorer_params.threshold=-6"]) == {
        "scorer": "kvzap", "scorer_params": {"scorer": "my.safetensors", "threshold": -6}}
    for bad in (["a.=1"], [".a=1"], ["a=1", "a.b=2"], ["a.b=2", "a=1"]):
        with pytest.raises(ValueError, match="NAME=VALUE|both as a value and as parameters"):
            parse_params(bad)


def test_positions_that_queries_cannot_take_are_refused():
    """Per-row positions [B, H_kv, n] placed every row's queries at row 0's positions: a query-aware method kept other
    tokens for a shifted row than for the same row alone. Negative positions read as empty slots (SubGen)."""
    g = torch.Generator().manual_seed(0)
    k, v, q = torch.randn(2, 2, 40, 8, generator=g), torch.randn(2, 2, 40, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    shifted = torch.stack([torch.arange(40), torch.arange(1000, 1040)])[:, None].expand(2, 2, 40)
    with pytest.raises(ValueError, match="positions differ between batch rows or KV heads"):
        kvc.compress("snapkv", k, v, queries=q, budget=6, positions=shifted)
    same = torch.arange(40).expand(2, 2, 40).clone()  # given whole, but one set of positions: accepted
    assert torch.equal(kvc.compress("snapkv", k, v, queries=q, budget=6, positions=same).positions,
                       kvc.compress("snapkv", k, v, queries=q, budget=6).positions)
    kvc.compress("keydiff", k, v, queries=q, budget=6, positions=shifted)  # reads no queries: any positions
    kvc.compress("compactor", k, v, queries=q, pre_rope_keys=k, budget=6, positions=shifted, attention=False)  # nor this
    with pytest.raises(ValueError, match="positions must be >= 0"):
        kvc.compress("subgen", k, v, budget=8, positions=torch.arange(-20, 20))


def test_a_refused_stream_update_leaves_the_stream_as_it_was():
    g = torch.Generator().manual_seed(1)
    k, v, q = torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g)
    st = kvc.stream("snapkv", budget=4, sink=0, window=3)
    st.update(k[:, :, :3], v[:, :, :3], q[:, :, :3])
    with pytest.raises(ValueError, match="scores tokens with queries"):
        st.update(k[:, :, 3:], v[:, :, 3:])  # tokens leave the window without their queries
    assert st.seen == 3 and st.summary().positions[0, 0].tolist() == [0, 1, 2]
    st.update(k[:, :, 3:], v[:, :, 3:], q[:, :, 3:])
    assert st.seen == 10 and st.summary().num_slots <= 4 + 3
    # Compactor finds a missing query of a token it compresses only when it scores: checked before the block is taken
    st = kvc.stream("compactor", budget=4, sink=0, window=0)
    st.update(k[:, :, :3], v[:, :, :3], q[:, :, :3], pre_rope_keys=k[:, :, :3])
    with pytest.raises(ValueError, match="compactor's attention term needs the query of every token"):
        st.update(k[:, :, 3:], v[:, :, 3:], q[:, :, 8:], pre_rope_keys=k[:, :, 3:])
    assert st.seen == 3

