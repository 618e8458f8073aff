"""The ratio asked for is the memory used: a stream's working space (its slack, the block being absorbed, a native
stream's workspace) comes out of its budget, not on top of it (`methods.budget.stream_split`; docs/design.md, "Streams
hold tokens exactly until they pass the budget" and "Memory"). At a compression ratio r the stored KV bytes stay
within (1 - r) of the full cache's plus the exact sink and window at every step: after every update of a tensor
stream, after every forward of a chunked or decode cache, for every method that streams."""

import math

import pytest
import torch

import kvcompress as kvc
from registered import SHARED
from kvcompress.cache import CompressedCache, CompressedLayer
from kvcompress.integration import use_compressed_attention
from kvcompress.methods.budget import resolve_budget
from kvcompress.methods.registry import build_method
from test_integration import _prompt, tiny

# Ratios 0.5, 0.75 and 0.9: 0.75 in every test run, the others with the e2e tests (each streaming method at three ratios
# is slow)
RATIO_CASES = [pytest.param(0.5, marks=pytest.mark.e2e), 0.75, pytest.param(0.9, marks=pytest.mark.e2e)]
SINK, WINDOW = 4, 8
# Compactor's attention term needs every compressed token's own query, which a stream hands only with its block:
# its streams (and the hybrid's, which ranks with it) run with no exact window
NO_WINDOW = {"compactor", "hybrid"}


def _streaming(name: str) -> bool:
    try:
        build_method(name).check_mode("decode")
        build_method(name).new_stream(64, torch.Generator())
    except ValueError:
        return False
    return True


STREAMING = [name for name in SHARED if _streaming(name)]


def test_the_methods_that_stream_are_covered():
    assert {"adakv", "keydiff", "snapkv", "compactor", "hybrid", "express", "subgen", "clustergen", "balancekv"} <= set(STREAMING)


def _within(stored: int, n: int, ratio: float, per_token: int, heads: int) -> tuple[bool, str]:
    """Whether `stored` bytes fit (1 - ratio) of a full cache of n tokens plus sink and window (per_token: one token's KV
    bytes), and also the tighter bound the budget gives, ceil((1 - ratio)·n) tokens (sink and window included), plus a
    ragged store's 4-byte count per head."""
    full = n * per_token
    loose = (1 - ratio) * full + (SINK + WINDOW) * per_token
    tight = math.ceil((1 - ratio) * n - 1e-9) * per_token + 4 * heads
    return stored <= tight and stored <= loose, f"stored {stored} B, (1 - r)·full + sink + window {loose:.0f} B, budget {tight} B"


@pytest.mark.parametrize("method", STREAMING)
@pytest.mark.parametrize("ratio", RATIO_CASES)
def test_a_tensor_stream_stays_within_the_ratio_at_every_update(method, ratio):
    b, h, d, n = 1, 2, 16, 480
    g = torch.Generator().manual_seed(0)
    keys, values, queries, pre = (torch.randn(b, heads, n, d, generator=g) for heads in (h, h, 4, h))
    budget = resolve_budget(n, None, ratio, SINK, WINDOW)
    needs_pre = build_method(method).requirements.needs("pre_rope_keys")
    per_token = h * (3 if needs_pre else 2) * d * 4  # keys and values (and the pre-RoPE keys a stream then stores), fp32
    for block in (1, 7, 64):
        st = kvc.stream(method, budget=budget, sink=SINK, window=0 if method in NO_WINDOW else WINDOW, seed=0)
        for start in range(0, n, block):
            sl = slice(start, start + block)
            st.update(keys[:, :, sl], values[:, :, sl], queries[:, :, sl], pre_rope_keys=pre[:, :, sl] if needs_pre else None,
                      layer_idx=0, num_layers=1)
            ok, why = _within(st.nbytes(), n, ratio, int(per_token), h)
            assert ok, f"{method} at block {block}, after {min(sl.stop, n)} tokens: {why}"
            if hasattr(st.state, "peak_slots"):
                assert st.state.peak_slots <= budget


def _compressed_bytes(cache: CompressedCache) -> int:
    return sum(layer.nbytes() for layer in cache.layers if isinstance(layer, CompressedLayer))


@pytest.mark.parametrize("mode", ["chunked", "decode"])
@pytest.mark.parametrize("method", STREAMING)
@pytest.mark.parametrize("ratio", RATIO_CASES)
def test_a_streaming_cache_stays_within_the_ratio_after_every_forward(method, mode, ratio):
    model = tiny()
    n = 240
    ctx, _ = _prompt(n=n)
    config = model.config
    per_token = config.num_hidden_layers * config.num_key_value_heads * 2 * (config.hidden_size // config.num_attention_heads) * 4
    block = 24 if mode == "chunked" else 1
    window = 0 if method in NO_WINDOW else WINDOW
    cache = CompressedCache(model, method, compression_ratio=ratio, sink=SINK, window=window, mode=mode, stream_length=n)
    with use_compressed_attention(model), torch.no_grad():
        for start in range(0, n, block):
            model(ctx[:, start : start + block], past_key_values=cache)
            _check_cache(cache, method, n, ratio, window, per_token, f"{method} {mode} at ratio {ratio}, after {start + block} tokens")
        if mode == "chunked":
            cache.absorbing = False
            _check_cache(cache, method, n, ratio, window, per_token, f"{method} chunked at ratio {ratio}, compacted")


def _check_cache(cache: CompressedCache, method: str, n: int, ratio: float, window: int, per_token: int, where: str) -> None:
    """The cache's stored bytes within the ratio (`_within`, over every layer together: PyramidKV's lower layers keep more
    than the budget and its deeper layers less)."""
    layers = [layer for layer in cache.layers if isinstance(layer, CompressedLayer)]
    ok, why = _within(_compressed_bytes(cache), n, ratio, per_token, len(layers) * cache.saved_dims["H"])
    assert ok, f"{where}: {why}"


@pytest.mark.parametrize("mode", ["chunked", "decode"])
@pytest.mark.parametrize("ratio", RATIO_CASES)
def test_generation_keeps_the_default_within_the_ratio(tiny_default_scorer, mode, ratio):
    """Through the generation entry point (`generate_ids`, what `kvc.generate` runs; the default method: AdaKV over
    KVzap, stored ragged while it streams; on the tiny model a random scorer of its shapes stands for the shipped one): the peak KV bytes of the whole generation stay within the ratio of the
    full cache's, sink and window included (chunked: plus the question and answer, which follow the prompt exactly),
    plus the block a forward takes. A cache's peak counts that block beside what it stores (`CompressedLayer.update`):
    its keys and values are the forward's own, which its attention reads before the stream absorbs them, as a full
    cache's forward holds them; once absorbed the stream is back within its budget."""
    from kvcompress.integration.generation import generate_ids

    model = tiny()
    ctx, question = _prompt(n=300)
    new = 4
    out = generate_ids(model, ctx, question, compression_ratio=ratio, mode=mode, sink=SINK, window=WINDOW, max_new_tokens=new,
                       chunk_size=32, stop_at_eos=False)
    config = model.config
    per_token = config.num_hidden_layers * config.num_key_value_heads * 2 * (config.hidden_size // config.num_attention_heads) * 4
    total = ctx.shape[1] + question.shape[1] + new
    streamed = total if mode == "decode" else ctx.shape[1]
    allowance = (total - streamed) * per_token  # chunked: the question and the answer stay exact after the prompt
    counts = 4 * config.num_hidden_layers * config.num_key_value_heads
    kept = math.ceil((1 - ratio) * streamed - 1e-9)  # sink + middle budget + window (`resolve_budget`)
    block = 32  # chunk_size: the prompt's blocks, the largest a forward takes
    assert kept <= (1 - ratio) * streamed + SINK + WINDOW
    assert out.peak_kv_bytes <= (kept + block) * per_token + allowance + counts, (out.peak_kv_bytes, kept, block)
