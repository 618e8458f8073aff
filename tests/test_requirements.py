"""One method contract (`methods.requirements.Requirements`): a method declares what it needs once, wrappers compose by
object, the cache reads nothing else of a method, and a method that needs a new input (the layer's hidden states) is
added in one file plus its registration and runs in every mode it declares."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import kvcompress as kvc
from kvcompress.integration import generation
from kvcompress.methods import registry
from kvcompress.methods.adakv import AdaKV
from kvcompress.methods.base import ScoreMethod
from kvcompress.methods.kvzip import KVzip
from kvcompress.methods.requirements import Requirements
from kvcompress.methods.snapkv import SnapKV
from kvcompress.methods.tokens import Tokens
from test_integration import blocks

ROOT = Path(__file__).resolve().parents[1]


def test_requirements_are_checked_when_built():
    assert Requirements().modes == ("prefill", "chunked", "decode") and not Requirements().ragged
    assert Requirements(inputs=["queries"]).inputs == frozenset({"queries"})
    for bad, match in (({"inputs": {"keys"}}, "inputs must be among"), ({"budget_scope": "row"}, "budget_scope must be one of"),
                       ({"modes": ("decode", "prefill")}, "in that order"), ({"modes": ()}, "non-empty"),
                       ({"inputs": {"reconstruction"}, "modes": ("prefill",)}, "reads its queries"),
                       ({"inputs": {"queries", "reconstruction"}}, "mode 'prefill' only"),
                       ({"inputs": {"queries", "reconstruction", "hidden_states"}, "modes": ("prefill",)}, "queries only")):
        with pytest.raises(ValueError, match=match):
            Requirements(**bad)
    with pytest.raises(ValueError, match="unknown input"):
        Requirements().needs("keys")
    assert Requirements(budget_scope="model").modes == ("prefill", "chunked", "decode")  # streams share it by `layer_budget`


def test_adakv_holds_its_scorer_and_needs_what_it_needs():
    """Composition by object: AdaKV(scorer=KVzip(...)); by name through the registry (the command line, saved settings)."""
    chunked = AdaKV(scorer=KVzip(scoring="chunk", reconstruction_chunk_size=64), scope="model")
    assert chunked.requirements == Requirements(inputs={"queries", "reconstruction"}, budget_scope="model", modes=("prefill",))
    assert chunked.reconstruction_chunk_size == 64
    assert registry.build_method("adakv", scorer="kvzip", scorer_params={"scoring": "chunk", "reconstruction_chunk_size": 64},
                                 scope="model") == chunked
    assert AdaKV().scorer == SnapKV() and AdaKV().requirements.modes == ("prefill", "chunked", "decode")
    assert AdaKV(refit="log_weights").requirements.modes == ("prefill",)
    assert AdaKV(scorer=registry.build_method("random")).randomized and not AdaKV().randomized
    with pytest.raises(ValueError, match="scorer must be a score method"):
        AdaKV(scorer="kvzip")


def test_the_cache_reads_no_method_flag_and_the_public_ids_functions_take_no_model_step_inputs():
    cache = (ROOT / "kvcompress" / "cache.py").read_text(encoding="utf-8")
    assert set(re.findall(r"compressor\.(\w+)", cache)) == {"check_context", "check_model", "file_digests", "layer_budget"}  # calls into the method, no flag
    assert re.findall(r"\bmethod\.requirements\b", cache) == ["method.requirements"]  # read once, by CachePlan.of
    for name in ("generate_ids", "answer_log_probs_ids", "answer_questions_ids", "compress_context_ids", "generate_batch_ids"):
        parameters = inspect.signature(getattr(generation, name)).parameters
        assert not {"reconstruction_ids", "prefill_approx"} & set(parameters), name


@dataclass
class HiddenNorm(ScoreMethod):
    """Test-only: keeps the tokens whose hidden state (what the layer's attention received) has the largest norm, and
    records every bundle it scored (layer, positions, hidden states)."""

    name = "hidden_norm"
    requirements = Requirements(inputs={"hidden_states"})
    default_sink = 2
    default_window = 4
    seen = []  # (layer, positions [B, H, n], hidden states [B, H, n, d_model]) of every call, for the test

    def score(self, tokens: Tokens, generator: torch.Generator) -> torch.Tensor:
        HiddenNorm.seen.append((tokens.layer_idx, tokens.positions.clone(), tokens.hidden_states.clone()))
        return tokens.hidden_states.float().norm(dim=-1)


@pytest.fixture
def hidden_norm(monkeypatch):
    """HiddenNorm registered (on a copy of the registry, dropped after the test), its record emptied."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register(HiddenNorm)
    HiddenNorm.seen = []
    return HiddenNorm


def _attention_inputs(model, ids) -> dict[int, torch.Tensor]:
    """{layer: the hidden states [1, n, d_model] its attention module receives} in a plain forward of ids [1, n]."""
    got, handles = {}, []
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "scaling"):
            def keep(m, args, kwargs):
                got[m.layer_idx] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            handles.append(module.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return got


@pytest.mark.parametrize("mode", ["prefill", "chunked", "decode"])
def test_a_method_that_reads_hidden_states_gets_the_real_ones_in_every_mode(hidden_norm, tiny_checkpoint, mode):
    """The hidden states the method scores are the ones the model's attention received for the same tokens: every layer
    in prefill mode (the context's forward is exact), the first layer in the streaming modes (its input does not depend
    on compressed attention); and it compresses (keeps fewer tokens than it saw)."""
    model, tokenizer = kvc.load_model(tiny_checkpoint)
    context = "the hidden states of every token reach the method. " * 4
    res = kvc.generate(model, tokenizer, context, "what?", method="hidden_norm", compression_ratio=0.5, mode=mode, **blocks(mode),
                       max_new_tokens=6, progress=False, stop_at_eos=False)
    assert hidden_norm.seen and res.budget is not None and max(res.slots_per_layer) < res.prompt_tokens
    ids, _ = kvc.integration.build_prompt(tokenizer, context, "what?")
    full = _attention_inputs(model, torch.cat([ids, torch.tensor([res.token_ids])], 1) if mode == "decode" else ids)
    checked = 0
    for layer, positions, hidden in hidden_norm.seen:
        assert hidden.abs().sum() > 0
        if mode == "prefill" or layer == 0:
            want = full[layer][0][positions[0]]  # [H, n, d_model]: each head's tokens' hidden states
            assert torch.allclose(hidden[0], want, atol=1e-5), (mode, layer)
            checked += 1
    assert checked
