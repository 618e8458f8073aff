"""The library's results do not depend on torch's default dtype: every method, one-shot and streamed, gives the same
keys, values, log-weights and positions, bit for bit and in the inputs' dtype (log-weights float32), for float32
inputs under `torch.set_default_dtype(torch.float64)` or bfloat16, and for bfloat16 inputs under float64, as under the
float32 default (tensors the library
makes itself, buffers, scores and seeded draws alike, carry their own dtype)."""

import pytest
import torch

import kvcompress as kvc

SEED = 3
ARGS = dict(budget=24, sink=2, window=8, seed=SEED)


def _layer(n=160, h=2, hq=4, d=16, d_model=None, seed=0):
    """float32 keys, values, queries, pre-RoPE keys (and hidden states [1, h, n, d_model] when d_model is given)."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float32)
    layer = [draw(1, h, n, d), draw(1, h, n, d), draw(1, hq, n, d), draw(1, h, n, d)]
    return (*layer, draw(1, 1, n, d_model).expand(1, h, n, d_model) if d_model else None)


def _inputs(method, dtype):
    if method == "kvzap":
        # the shipped scorer reads SmolLM2-135M's hidden states: 3 KV heads, d_model 576 (still small tensors)
        layer, position = _layer(h=3, hq=9, d_model=576), (0, 30)
    else:
        layer, position = _layer(), ((0, 2) if method == "pyramidkv" else None)
    return tuple(None if t is None else t.to(dtype) for t in layer), position


def _compressed(method, dtype):
    (keys, values, queries, pre, hidden), layer = _inputs(method, dtype)
    extra = {"layer": layer} if layer else {}
    return kvc.compress(method, keys, values, queries, pre_rope_keys=pre, hidden_states=hidden, **ARGS, **extra)


def _streamed(method, dtype):
    (keys, values, queries, pre, hidden), layer = _inputs(method, dtype)
    window = 0 if method in ("compactor", "hybrid") else ARGS["window"]  # they score a token with its own query
    st = kvc.stream(method, ARGS["budget"], ARGS["sink"], window, seed=SEED)
    layer_idx, num_layers = layer if layer else (0, 1)
    for start in range(0, keys.shape[2], 24):
        sl = slice(start, start + 24)
        st.update(keys[:, :, sl], values[:, :, sl], queries[:, :, sl], pre_rope_keys=pre[:, :, sl], layer_idx=layer_idx,
                  num_layers=num_layers, hidden_states=None if hidden is None else hidden[:, :, sl])
    return st.summary()


def _under_default(default, run, method, dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        return run(method, dtype)
    finally:
        torch.set_default_dtype(before)


RUNS = [("compress", _compressed, m) for m in kvc.methods()] + \
       [("stream", _streamed, m) for m in kvc.methods() if m != "kvzip"]  # KVzip has no stream


@pytest.mark.parametrize("default, dtype", [(torch.float64, torch.float32), (torch.bfloat16, torch.float32),
                                            (torch.float64, torch.bfloat16)], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("mode, run, method", RUNS, ids=[f"{mode}-{m}" for mode, _, m in RUNS])
def test_results_do_not_depend_on_the_default_dtype(default, dtype, mode, run, method):
    """The same inputs (of `dtype`) and seed give the same summary, bit for bit, under `default` as under float32."""
    assert torch.get_default_dtype() == torch.float32
    reference = run(method, dtype)
    got = _under_default(default, run, method, dtype)
    assert torch.get_default_dtype() == torch.float32
    for name in ("keys", "values", "log_weights", "positions"):
        want, have = getattr(reference, name), getattr(got, name)
        assert have.dtype == want.dtype, f"{name}: {have.dtype} under {default}, {want.dtype} under float32"
        assert torch.equal(have, want), f"{name} differ under {default}"
    assert (got.keys.dtype, got.values.dtype, got.log_weights.dtype) == (dtype, dtype, torch.float32)
