"""Seed 003's prefill recipe: Express computes the context's cache, then an eviction method compresses it."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvcompress.eval.capture import capture_qkv
from kvcompress.integration import generate_ids
from kvcompress.integration.prefill_approx import approximate_prefill

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)


def _tiny():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL)).eval()


def _prompt(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (1, n), generator=g), torch.randint(0, 96, (1, 6), generator=g)


def test_express_holding_every_token_reproduces_the_exact_prefill():
    """150 tokens fit the Express cache exactly (32 + 32 + 86 < 512 slots): the record equals an exact prefill's
    capture, and generation with the recipe equals generation after an exact prefill."""
    model = _tiny()
    ctx, question = _prompt(150)
    record = approximate_prefill(model, ctx, chunk_size=32)
    exact = capture_qkv(model, ctx)
    for layer, tensors in exact.items():
        for got, want in zip(record[layer], tensors):
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
    for method in ("snapkv", "streamingllm", "pyramidkv"):
        plain = generate_ids(model, ctx, question, method=method, compression_ratio=0.5, max_new_tokens=8, stop_at_eos=False)
        recipe = generate_ids(model, ctx, question, method=method, compression_ratio=0.5, max_new_tokens=8, stop_at_eos=False,
                              prefill_approx="express", chunk_size=32)
        assert recipe.token_ids == plain.token_ids
        assert recipe.slots_per_layer == plain.slots_per_layer


def test_capture_and_the_express_record_run_no_language_model_head():
    """Both are kept for their attention inputs only: the head runs on no position (transformers' `logits_to_keep`, an
    empty index) instead of building [n, vocabulary] logits that nothing reads."""
    model = _tiny()
    ctx, _ = _prompt(150)
    rows = []
    hook = model.lm_head.register_forward_hook(lambda module, inputs, output: rows.append(inputs[0].shape[1]))
    try:
        capture_qkv(model, ctx)
        approximate_prefill(model, ctx, chunk_size=32)
    finally:
        hook.remove()
    assert rows == [0] * (1 + 5), rows  # one forward for the capture, one per 32-token block for the record


def test_express_attention_changes_later_layers_only():
    """With an Express cache of 8 middle slots over 400 tokens, layer 0's keys and values (computed before any
    attention) are the exact ones, layer 1's differ: its input went through approximate attention."""
    model = _tiny()
    ctx, _ = _prompt(400)
    record = approximate_prefill(model, ctx, budget=8, chunk_size=32)
    exact = capture_qkv(model, ctx)
    assert torch.allclose(record[0][1], exact[0][1], atol=1e-5) and torch.allclose(record[0][2], exact[0][2], atol=1e-5)
    assert record[1][1].shape == exact[1][1].shape
    tail = slice(32 + 32 + 8 + 32, None)  # tokens whose chunk could not see every earlier token exactly
    assert not torch.allclose(record[1][1][:, :, tail], exact[1][1][:, :, tail], atol=1e-3)
    again = approximate_prefill(model, ctx, budget=8, chunk_size=32)
    assert all(torch.equal(a, b) for a, b in zip(record[1], again[1]))


@pytest.mark.parametrize(
    "kwargs, match",
    [({"prefill_approx": "hyper"}, "prefill_approx"), ({"prefill_approx": "express", "mode": "chunked", "budget": 16}, "mode='prefill'"),
     ({"prefill_approx": "express", "method": None}, "full cache: it takes no prefill_approx"),
     ({"prefill_approx": "express", "method": "kvzip"}, "nor an approximate one"),
     ({"prefill_approx": "express", "compress_question": True}, "compress_question")],
)
def test_bad_recipe_arguments(kwargs, match):
    model = _tiny()
    ctx, question = _prompt(60)
    args = {"method": "snapkv", "compression_ratio": 0.5} | kwargs
    if args.get("budget") is not None or args["method"] is None:  # the full cache takes no size
        args.pop("compression_ratio")
    with pytest.raises(ValueError, match=match):
        generate_ids(model, ctx, question, max_new_tokens=2, **args)


def test_approximate_prefill_rejects_bad_sizes():
    model = _tiny()
    ctx, _ = _prompt(40)
    for kwargs, match in (({"budget": 0}, "budget"), ({"chunk_size": 0}, "chunk_size"), ({"prefill_approx": "exact"}, "prefill_approx")):
        with pytest.raises(ValueError, match=match):
            approximate_prefill(model, ctx, **kwargs)


def test_what_the_approximate_prefill_cannot_record_is_refused_before_it_runs():
    """KVzap's methods (the default's among them) ran the whole approximate prefill and then failed for the hidden states
    it does not record; a model with sliding-window layers failed with a message about padding, or recorded keys its
    windows never saw; bad context ids failed inside torch."""
    import sys

    from kvcompress.options import CompressionOptions

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from test_hf import _ids, tiny

    for method in ("default", "kvzap"):
        with pytest.raises(ValueError, match="prefill_approx='express' records each layer's queries, keys and values, and method"):
            CompressionOptions.build(method=method, compression_ratio=0.9, prefill_approx="express")
    with pytest.raises(ValueError, match=r"layers \[0\] of this model attend over a sliding window"):
        approximate_prefill(tiny("gemma3"), _ids(100))
    model = tiny("llama")
    for bad in (_ids(100)[:, :0], _ids(100)[0], _ids(100).float()):
        with pytest.raises(ValueError, match="context_ids must be an integer tensor"):
            approximate_prefill(model, bad)
