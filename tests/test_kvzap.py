"""KVzap (`methods.kvzap`): the surrogate file format and its errors, the fit, `kvcompress train-scorer` end to end on a
tiny model, and the method in every mode scoring each token once, from the hidden state its layer computed."""

from __future__ import annotations

import copy
import json
import platform
import re
from dataclasses import replace

import pytest
import torch

import kvcompress as kvc
from kvcompress.cli import main
from kvcompress.methods import kvzap
from kvcompress.methods.kvzap import KVzap, Surrogate, SurrogateError, fit_surrogate, load_surrogate, spearman
from kvcompress.methods.registry import build_method
from kvcompress.methods.stream import Stream
from kvcompress.methods.tokens import Tokens
from test_requirements import _attention_inputs
from test_integration import blocks


def _surrogate(kind="linear", layers=(0, 1), heads=2, width=8, hidden=4) -> Surrogate:
    g = torch.Generator().manual_seed(0)
    h = 1 if kind == "linear" else hidden
    w1, b1 = torch.randn(len(layers), heads, width, h, generator=g), torch.randn(len(layers), heads, h, generator=g)
    w2 = torch.randn(len(layers), heads, h, 1, generator=g) if kind == "mlp" else None
    b2 = torch.randn(len(layers), heads, 1, generator=g) if kind == "mlp" else None
    return Surrogate(kind, tuple(layers), w1, b1, w2, b2, "tiny", {"seed": 0})


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_scorer_file_round_trips_and_predicts_per_head(tmp_path, kind):
    s = _surrogate(kind)
    s.save(tmp_path / "s.safetensors")
    for again in range(3):  # the same bytes each time: the file's metadata in sorted order, not a hash map's
        s.save(tmp_path / "again.safetensors")
        assert (tmp_path / "again.safetensors").read_bytes() == (tmp_path / "s.safetensors").read_bytes()
    t = Surrogate.load(tmp_path / "s.safetensors")
    assert (t.kind, t.layers, t.model, t.meta) == (kind, (0, 1), "tiny", {"seed": 0})
    x = torch.randn(1, 2, 5, 8)
    out = t.predict(x, 1)
    assert out.shape == (1, 2, 5)
    torch.testing.assert_close(out, s.predict(x, 1))
    first = x[0, 0] @ s.first_weight[1, 0] + s.first_bias[1, 0]  # head 0 of layer 1 by hand
    want = first if kind == "linear" else torch.nn.functional.gelu(first) @ s.second_weight[1, 0] + s.second_bias[1, 0]
    torch.testing.assert_close(out[0, 0], want.squeeze(-1))


def test_a_missing_or_wrong_scorer_file_is_a_clear_error(tmp_path):
    with pytest.raises(SurrogateError, match=r"does not exist.*kvcompress train-scorer"):
        build_method("kvzap", scorer=str(tmp_path / "none.safetensors"))
    with pytest.raises(SurrogateError, match=r"is a directory; train one with `kvcompress train-scorer"):
        Surrogate.load(tmp_path)  # it said "does not exist"
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(SurrogateError, match=r"not a readable safetensors file .*train one with `kvcompress train-scorer"):
        Surrogate.load(bad)
    from safetensors.torch import save_file

    s = _surrogate()
    header = {"format": kvzap.SURROGATE_FORMAT, "version": str(kvzap.SURROGATE_VERSION), "kind": "linear", "layers": "[0, 1]", "model": "m", "meta": "{}"}
    tensors = {"first_weight": s.first_weight, "first_bias": s.first_bias}
    for edit, match in (({"format": "x"}, "format 'x'"), ({"version": "9"}, "version '9'"), ({"kind": "tree"}, "kind 'tree'"),
                        ({"layers": "[0]"}, "do not fit 1 layers"), ({"layers": "[0, 0]"}, "distinct layer indices")):
        save_file(tensors, str(bad), metadata={**header, **edit})
        with pytest.raises(SurrogateError, match=rf"{match}.*train one with `kvcompress train-scorer"):
            Surrogate.load(bad)
    save_file({**tensors, "first_bias": torch.full_like(s.first_bias, float("nan"))}, str(bad), metadata=header)
    with pytest.raises(SurrogateError, match="finite"):
        Surrogate.load(bad)
    with pytest.raises(SurrogateError, match=r"reads hidden states of width 8 for 2 KV heads, got 3 heads of width 8.*train-scorer"):
        s.predict(torch.randn(1, 3, 4, 8), 0)
    with pytest.raises(SurrogateError, match="no surrogate for layer 5"):
        s.predict(torch.randn(1, 2, 4, 8), 5)
    for bad_value in (float("nan"), True, "high"):
        with pytest.raises(ValueError, match="threshold must be a finite number \\(a log-score"):
            KVzap(threshold=bad_value)


def test_the_shipped_weights_load_offline_and_fit_the_default_model():
    s = load_surrogate("default")
    assert s.kv_heads == 3 and s.input_width == 576 and len(s.layers) == 30  # SmolLM2-135M: 30 layers, 3 KV heads, d_model 576
    assert s.meta["training_text"] == "eval.capture.SCORER_TRAINING_MODULES" and min(s.meta["tuning_spearman"].values()) > 0.3
    assert s.score_quantiles.shape == (30, kvzap.SCORE_QUANTILES)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_the_fit_recovers_a_planted_score_and_is_seeded(kind):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(600, 6, generator=g) * 3 + 1
    truth = torch.stack([x @ torch.randn(6, generator=g), torch.tanh(x[:, 0]) * 2 - x[:, 1]])  # [H=2, N]
    fitted = fit_surrogate({0: x}, {0: truth}, kind, steps=300, seed=0)
    predicted = fitted.predict(x[None, None].expand(1, 2, -1, -1), 0)[0]
    assert spearman(predicted[0], truth[0]) > 0.99 and spearman(predicted[1], truth[1]) > 0.85
    again = fit_surrogate({0: x}, {0: truth}, kind, steps=300, seed=0)
    assert torch.equal(again.first_weight, fitted.first_weight)
    quantiles = fitted.score_quantiles  # of its predictions on the training inputs
    assert quantiles.shape == (1, kvzap.SCORE_QUANTILES) and bool((quantiles.diff() >= 0).all())
    assert quantiles[0, 0] == pytest.approx(float(predicted.min()), abs=1e-4) and quantiles[0, -1] == pytest.approx(float(predicted.max()), abs=1e-4)
    with pytest.raises(ValueError, match="kind must be one of"):
        fit_surrogate({0: x}, {0: truth}, "tree")


def _with_quantiles(rows: list[list[float]]) -> Surrogate:
    return replace(_surrogate(layers=tuple(range(len(rows)))), score_quantiles=torch.tensor(rows))


def test_layer_shares_follow_each_layers_scores_and_average_one():
    """Layer 0's scores spread evenly over [0, 1], layer 1's over [1, 2]: keeping a quarter of all tokens ranked together
    takes the top half of layer 1 (threshold 1.5) and none of layer 0, so the shares are 0 and 2; keeping everything,
    1 and 1; keeping three quarters, the top half of layer 0 and all of layer 1."""
    s = _with_quantiles([torch.linspace(0, 1, 9).tolist(), torch.linspace(1, 2, 9).tolist()])
    for fraction, want in ((0.25, {0: 0.0, 1: 2.0}), (1.0, {0: 1.0, 1: 1.0}), (0.75, {0: 2 / 3, 1: 4 / 3})):
        got = s.layer_shares(fraction)
        assert got == pytest.approx(want, abs=1e-6), fraction
    three = _with_quantiles([[0, 1, 2], [-5, -1, 0], [0.5, 0.5, 3]])
    assert sum(three.layer_shares(0.1).values()) == pytest.approx(3.0)
    for bad in (0, 1.5, True, "half"):
        with pytest.raises(ValueError, match="kept_fraction must be a number in"):
            s.layer_shares(bad)
    with pytest.raises(SurrogateError, match="records no score quantiles.*train-scorer"):
        _surrogate().layer_shares(0.5)


def test_a_files_score_quantiles_round_trip_and_are_checked(tmp_path):
    from safetensors.torch import save_file

    s = _with_quantiles([[0, 1, 2], [1, 2, 3]])
    s.save(tmp_path / "s.safetensors")
    assert torch.equal(Surrogate.load(tmp_path / "s.safetensors").score_quantiles, s.score_quantiles)
    header = {"format": kvzap.SURROGATE_FORMAT, "version": str(kvzap.SURROGATE_VERSION), "kind": "linear", "layers": "[0, 1]", "model": "m", "meta": "{}"}
    tensors = {"first_weight": s.first_weight, "first_bias": s.first_bias}
    for quantiles in (torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0]]), torch.zeros(3, 4), torch.tensor([[0.0, float("inf")]] * 2)):
        save_file({**tensors, "score_quantiles": quantiles}, str(tmp_path / "bad.safetensors"), metadata=header)
        with pytest.raises(SurrogateError, match="score_quantiles must be"):
            Surrogate.load(tmp_path / "bad.safetensors")


def test_scope_model_streams_give_each_layer_its_share_of_the_budget(tmp_path):
    """AdaKV(scope="model") over KVzap in a stream: layer budgets 2 + floor((budget - 2)·share), share =
    alpha + (1 - alpha)·the scorer's layer share at the kept fraction, so they sum to at most L·budget; scope "layer"
    keeps the budget in every layer. Without score quantiles, or without the stream's length, it is a clear error."""
    from kvcompress.methods.adakv import AdaKV

    s = _with_quantiles([torch.linspace(0, 1, 9).tolist(), torch.linspace(1, 2, 9).tolist()])
    s.save(tmp_path / "q.safetensors")
    method = AdaKV(scorer=KVzap(scorer=str(tmp_path / "q.safetensors")), scope="model", alpha_safeguard=0.2)
    assert "chunked" in method.requirements.modes and method.requirements.budget_scope == "model"
    budgets = [method.layer_budget(102, layer, middle_length=408) for layer in (0, 1)]  # keeps a quarter: shares 0 and 2
    assert budgets == [2 + 20, 2 + 180] and sum(budgets) <= 2 * 102
    assert AdaKV(scorer=method.scorer, scope="layer").layer_budget(102, 0, 408) == 102
    with pytest.raises(ValueError, match="stream_length"):
        method.layer_budget(102, 0, None)
    _surrogate().save(tmp_path / "plain.safetensors")
    plain = AdaKV(scorer=KVzap(scorer=str(tmp_path / "plain.safetensors")), scope="model")
    assert plain.requirements.modes == ("prefill",)
    with pytest.raises(ValueError, match=r"scope='model' runs in mode 'prefill' only.*knows no per-layer shares"):
        plain.check_mode("chunked")


def test_spearman_is_one_for_monotone_and_minus_one_for_reversed():
    a = torch.randn(3, 50)
    assert spearman(a, a.exp()) == pytest.approx(1.0) and spearman(a, -a) == pytest.approx(-1.0)


@pytest.fixture(scope="module")
def tiny_scorer(tiny_checkpoint, tmp_path_factory):
    """A scorer trained by the command line on the tiny model (KVzip's scores of its training contexts, fitted)."""
    out = tmp_path_factory.mktemp("scorer") / "tiny.safetensors"
    assert main(["train-scorer", "--model", str(tiny_checkpoint), "--tokens", "96", "--contexts", "2", "--out", str(out)]) == 0
    return out


def test_training_contexts_are_as_many_as_asked_or_an_error_says_how_many_fit(tiny_checkpoint):
    from kvcompress.integration.scorer_training import text_contexts

    _, tokenizer = kvc.load_model(tiny_checkpoint)
    paragraphs = [f"Paragraph {i} says something about the weather." for i in range(12)]  # ~48 byte tokens each
    assert len(text_contexts(tokenizer, paragraphs, 100, 4, seed=0)) == 4
    with pytest.raises(ValueError, match=r"--contexts 9: the text \(12 paragraphs\) fills 4 contexts of 100 tokens; ask for at most 4"):
        text_contexts(tokenizer, paragraphs, 100, 9, seed=0)
    with pytest.raises(ValueError, match=r"--tokens 10000: the text \(12 paragraphs\) fills no context of 10000 tokens \(it holds about \d+ tokens\)"):
        text_contexts(tokenizer, paragraphs, 10000, 1, seed=0, flag="--tuning-contexts")


def test_train_scorer_runs_end_to_end_and_records_how(tiny_scorer, tiny_checkpoint, capsys):
    s = Surrogate.load(tiny_scorer)
    assert s.kind == "linear" and s.layers == (0, 1) and s.kv_heads == 2 and s.input_width == 64
    assert s.meta["seed"] == 0 and s.meta["contexts"] == 2 and s.meta["training_tokens"] > 100 and set(s.meta["tuning_spearman"]) == {"0", "1"}
    assert all(-1 <= v <= 1 for v in s.meta["tuning_spearman"].values()) and s.meta["seconds"] > 0
    assert s.score_quantiles.shape == (2, kvzap.SCORE_QUANTILES) and sum(s.layer_shares(0.5).values()) == pytest.approx(2.0)
    # the training text is this Python's docstrings: the file names the Python and the token ids it read
    from kvcompress.eval.capture import DOCSTRING_MODULES, SCORER_TRAINING_MODULES, docstring_paragraphs
    from kvcompress.integration.model import token_ids_sha256
    from kvcompress.integration.scorer_training import text_contexts

    held_apart = set(docstring_paragraphs(DOCSTRING_MODULES))
    text = [p for p in docstring_paragraphs(SCORER_TRAINING_MODULES) if p not in held_apart]
    contexts = text_contexts(kvc.load_model(tiny_checkpoint)[1], text, 96, 2, seed=0)
    assert s.meta["python"] == platform.python_version() and s.meta["training_tokens_sha256"] == token_ids_sha256(*contexts)
    assert token_ids_sha256(*contexts) != token_ids_sha256(*contexts[::-1]) != token_ids_sha256(torch.cat(contexts, 1))


def test_train_scorer_refuses_a_missing_directory(tmp_path, capsys):
    assert main(["train-scorer", "--out", str(tmp_path / "no" / "s.safetensors")]) != 0
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["prefill", "chunked", "decode"])
def test_kvzap_runs_in_every_mode_within_budget_and_is_the_full_cache_at_ratio_zero(tiny_checkpoint, tiny_scorer, mode):
    model, tokenizer = kvc.load_model(tiny_checkpoint)
    context = "A token is scored once, when it enters the cache, from its hidden state. " * 6
    common = dict(mode=mode, **blocks(mode), max_new_tokens=6, progress=False, stop_at_eos=False)
    full = kvc.generate(model, tokenizer, context, "what?", method=None, **common)
    exact = kvc.generate(model, tokenizer, context, "what?", method="kvzap", method_params={"scorer": str(tiny_scorer)},
                         compression_ratio=0.0, **common)
    assert exact.token_ids == full.token_ids
    half = kvc.generate(model, tokenizer, context, "what?", method="kvzap", method_params={"scorer": str(tiny_scorer)},
                        compression_ratio=0.5, **common)
    assert max(half.slots_per_layer) < half.prompt_tokens and half.realised_compression_ratio > 0.3


def test_prefill_keeps_the_tokens_the_surrogate_ranks_highest(tiny_checkpoint, tiny_scorer):
    """In prefill mode the kept middle is each head's top `budget` by the surrogate's prediction from the hidden states
    the model's attention received (no second forward)."""
    from kvcompress.cache import CompressedLayer
    from kvcompress.integration import build_prompt, compress_context_ids

    model, tokenizer = kvc.load_model(tiny_checkpoint)
    ids, _ = build_prompt(tokenizer, "every hidden state is scored by the surrogate. " * 5, "q")
    cache = compress_context_ids(model, ids, method="kvzap", method_params={"scorer": str(tiny_scorer)}, budget=20, sink=4, window=8)
    hidden = _attention_inputs(model, ids)
    surrogate = load_surrogate(str(tiny_scorer))
    n = ids.shape[1]
    for i, layer in enumerate(cache.layers):
        assert isinstance(layer, CompressedLayer)
        scores = surrogate.predict(hidden[i][:, None].expand(1, 2, -1, -1), i)[0, :, 4 : n - 8]  # [H, middle]
        want = scores.topk(20, -1).indices.sort(-1).values + 4
        kept = layer.stored().positions[0, :, 4 : 4 + 20]
        assert torch.equal(kept, want), i


def test_a_stream_scores_on_entry_and_never_keeps_hidden_states():
    s = _surrogate(layers=(0,), width=16)
    method = KVzap.__new__(KVzap)  # the shipped scorer is the default model's: give this one the test surrogate
    method.scorer, method.threshold, method.surrogate = "test", None, s
    st = Stream(method, 8, 2, 2, torch.Generator())
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 40, 16, generator=g)
    keys, values = torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g)
    for start in range(0, 40, 5):
        sl = slice(start, start + 5)
        st.update(keys[:, :, sl], values[:, :, sl], layer_idx=0, num_layers=1, hidden_states=hidden[:, None, sl].expand(1, 2, -1, -1))
        assert st.state.slots.width == 4  # keys, values, positions and the entry scores: no hidden states held
        assert st.nbytes() <= (2 + 8 + 2) * 2 * 2 * 8 * 4
    st.compact()
    kept = st.summary().positions[0, :, 2:-2]
    scores = s.predict(hidden[:, None].expand(1, 2, -1, -1), 0)[0]
    for head in range(2):  # every kept token outscores... at least the lowest-scoring middle token
        assert scores[head, kept[head]].min() >= scores[head, 2:38].min()


def test_the_threshold_keeps_what_scores_above_it_within_the_budget():
    s = _surrogate(layers=(0,), width=16)
    method = KVzap.__new__(KVzap)
    method.scorer, method.threshold, method.surrogate = "test", 0.0, s
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 2, 60, 16, generator=g)
    tokens = Tokens(torch.randn(1, 2, 60, 8), torch.randn(1, 2, 60, 8), torch.arange(60).expand(1, 2, 60), layer_idx=0, num_layers=1,
                    hidden_states=hidden)
    scores = s.predict(hidden, 0)
    summary = method.compress(tokens, 40, torch.Generator())
    for head in range(2):
        kept = summary.positions[0, head][torch.isfinite(summary.log_weights[0, head])]
        above = (scores[0, head] >= 0).nonzero().squeeze(1)
        want = above if len(above) <= 40 else scores[0, head].topk(40).indices.sort().values
        assert torch.equal(kept, want)
    assert method.requirements.budget_scope == "layer" and set(method.requirements.modes) == {"prefill", "chunked", "decode"}


@pytest.mark.parametrize("budget", [10, 40])
@pytest.mark.parametrize("block", [1, 7, 25])
def test_a_threshold_stream_keeps_what_one_pass_over_every_token_keeps(budget, block):
    """KVzap's threshold in a stream (`ThresholdState`): after every block, each head holds exactly what `compress` keeps
    of the tokens that have left the window so far (at most `budget`, each scoring at least the threshold), stored packed;
    a stream refuses a slack, and its state round-trips a save and load."""
    from kvcompress.methods.kvzap import ThresholdState
    from kvcompress.saved_state import Instance, decode, encode

    s = _surrogate(layers=(0,), width=16)
    method = KVzap.__new__(KVzap)
    method.scorer, method.threshold, method.surrogate = "test", 0.0, s
    g = torch.Generator().manual_seed(1)
    n, sink, window = 90, 2, 4
    hidden = torch.randn(1, 2, n, 16, generator=g)
    keys, values = torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)
    st = Stream(method, budget, sink, window, torch.Generator())
    assert isinstance(st.state, ThresholdState)
    for start in range(0, n, block):
        sl = slice(start, min(n, start + block))
        st.update(keys[:, :, sl], values[:, :, sl], layer_idx=0, num_layers=1, hidden_states=hidden[:, :, sl])
        left = max(0, sl.stop - window)  # tokens that have left the window (the sink included)
        if left <= sink:
            continue
        middle = Tokens(keys[:, :, sink:left], values[:, :, sink:left], torch.arange(sink, left).expand(1, 2, -1), layer_idx=0,
                        num_layers=1, hidden_states=hidden[:, :, sink:left])
        want = method.compress(middle, budget, torch.Generator())
        got = st.state.summary()
        for head in range(2):
            real = torch.isfinite(want.log_weights[0, head])
            kept = want.positions[0, head][real]
            assert torch.equal(got.positions[0, head][torch.isfinite(got.log_weights[0, head])], kept), (start, head)
            assert torch.equal(got.keys[0, head][: len(kept)], keys[0, head, kept])
        assert int(st.state.kept.counts.max()) <= budget and st.state.nbytes() == st.state.kept.nbytes()
    spec = Instance("kvzap_threshold_state")
    tensors, description = encode(spec, st.state, "state", {"method": method})
    again = decode(spec, description, tensors, dims={"B": 1, "H": 2, "D": 8}, links={"method": method}, device="cpu", path="state")
    assert torch.equal(again.summary().keys, st.state.summary().keys) and torch.equal(again.kept_scores, st.state.kept_scores)
    with pytest.raises(ValueError, match="slack"):
        Stream(method, budget, sink, window, torch.Generator(), slack=0.5)


def test_a_threshold_stream_refuses_positions_past_int32_rather_than_wrapping_them():
    """The kept positions are stored as int32 (a ragged summary); one past 2**31 - 1 is refused, as AdaKV's stream
    refuses it, rather than wrapped to a negative position."""
    s = _surrogate(layers=(0,), width=16)
    method = KVzap.__new__(KVzap)
    method.scorer, method.threshold, method.surrogate = "test", -100.0, s
    st = Stream(method, 8, 0, 0, torch.Generator())
    first = 2**31 - 20
    keys = torch.randn(1, 2, 40, 8)
    with pytest.raises(ValueError, match="do not fit the int32"):
        st.update(keys, keys, positions=torch.arange(first, first + 40), layer_idx=0, num_layers=1,
                  hidden_states=torch.randn(1, 2, 40, 16))


@pytest.mark.parametrize("mode", ["prefill", "chunked", "decode"])
def test_a_threshold_decides_alone_at_ratio_zero_in_every_mode(tiny_checkpoint, tiny_scorer, mode):
    """`method="kvzap", method_params={"threshold": t}` in every mode, with no budget: at a threshold no score reaches, the
    middle is dropped; at one every score passes, with no budget (ratio 0), the answer is the full cache's; in between, the
    realised ratio rises with the threshold; with kv_bits the kept slots are stored quantized."""
    model, tokenizer = kvc.load_model(tiny_checkpoint)
    context = "A token is scored once, when it enters the cache, from its hidden state. " * 6
    common = dict(mode=mode, **blocks(mode), max_new_tokens=6, progress=False, stop_at_eos=False, sink=4, window=8)
    full = kvc.generate(model, tokenizer, context, "what?", method=None, **{k: v for k, v in common.items() if k not in ("sink", "window")})

    def run(threshold, ratio, **more):
        return kvc.generate(model, tokenizer, context, "what?", method="kvzap", compression_ratio=ratio,
                            method_params={"scorer": str(tiny_scorer), "threshold": threshold}, **common, **more)

    # two thresholds inside the scores of this context: the scorer is trained on the running Python's docstrings, so its
    # scores depend on that Python
    from kvcompress.integration import build_prompt
    from kvcompress.integration.scorer_training import record_scoring_pairs

    hidden = record_scoring_pairs(model, tokenizer, build_prompt(tokenizer, context, "what?")[0]).hidden
    quantiles = kvzap.score_quantiles(Surrogate.load(tiny_scorer), hidden, levels=11)  # [layers, 11]: every tenth
    low, high = quantiles[:, 3].median().item(), quantiles[:, 7].median().item()
    runs = [run(threshold, 0.0) for threshold in (-1e9, low, high, 1e9)]
    assert runs[0].token_ids == full.token_ids and runs[0].realised_compression_ratio == 0.0
    stored = [r.kv_bytes for r in runs]
    assert stored[0] > stored[1] > stored[2] > stored[3], stored
    assert runs[-1].realised_compression_ratio > 0.8  # the sink, the window and (decode) the last tokens are left
    assert 0.0 < runs[1].realised_compression_ratio < runs[2].realised_compression_ratio < runs[3].realised_compression_ratio
    assert run(low, 0.0, kv_bits=4).kv_bytes < stored[1]  # the kept slots stored in 4 bits


def test_the_default_method_is_adakv_over_kvzap_in_every_mode_and_takes_no_parameters(tiny_default_scorer):
    """method=DEFAULT (what no method gives) resolves, when the options are built, to the mode's DEFAULT_METHODS entry:
    AdaKV over KVzap's scores with a 5 % floor per head, one budget over every layer's heads (in the streaming modes each
    layer's learned share of it, re-compressed at slack 0.1), stored quantized, the ratio read as memory (in prefill mode
    its bits picked from the bytes the ratio leaves, in the streams 8 bits); it runs in every mode with no reconstruction
    forward."""
    from kvcompress.integration import generate_ids
    from kvcompress.options import DEFAULT, DEFAULT_METHODS, CompressionOptions
    from test_integration import _prompt, tiny

    prefill = CompressionOptions(compression_ratio=0.5)
    assert kvc.CompressedCache(tiny(), compression_ratio=0.5).options == prefill  # a cache with no method named
    assert (prefill.method, prefill.method_params, prefill.sink, prefill.window, prefill.kv_bits, prefill.kv_group_size,
            prefill.budget_unit) == ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05}, 4, 64, "auto", 32, "memory")
    assert CompressionOptions(compression_ratio=0.5, kv_bits=8).kv_bits == 8  # bits given replace the default's
    assert CompressionOptions(compression_ratio=0.5, kv_bits=4, budget_unit="tokens").storage_for(2048, 64, torch.float32)[1] == 4
    with pytest.raises(ValueError, match=r"budget_unit='tokens' with 'default' in mode 'prefill': its bits are picked from the memory "
                                         r"the ratio leaves \(kv_bits='auto'\); pass kv_bits \(8, 4 or 2\)"):
        CompressionOptions(compression_ratio=0.5, budget_unit="tokens")  # a unit alone: the default's bits need memory
    assert CompressionOptions(compression_ratio=0.5, kv_group_size=16).kv_group_size == 16  # groups for the default's bits
    with pytest.raises(ValueError, match="kv_group_size=16 groups quantized storage: it takes kv_bits"):
        CompressionOptions(method="keydiff", compression_ratio=0.5, kv_group_size=16, mode="chunked")  # full precision
    assert CompressionOptions(compression_ratio=0.5, kv_group_size=16, mode="chunked").kv_group_size == 16  # the default's 8 bits
    assert prefill.compressor.requirements.needs("hidden_states") and prefill.compressor.requirements.budget_scope == "model"
    assert not prefill.compressor.requirements.needs("reconstruction")
    assert CompressionOptions(**prefill.to_dict()) == prefill  # what a saved cache records builds the same options
    assert CompressionOptions(compression_ratio=0.5, window=16).window == 16  # a window given replaces the default's
    with pytest.raises(ValueError, match=r"and method parameters \['scorer'\] need a registered method: 'default' in mode 'prefill' is 'adakv'"):
        CompressionOptions.build(compression_ratio=0.5, scorer="snapkv")
    model = tiny()
    ctx, question = _prompt(n=200)
    for mode in ("prefill", "chunked", "decode"):
        options = CompressionOptions(method=DEFAULT, compression_ratio=0.5, mode=mode)
        assert (options.method, options.method_params) == DEFAULT_METHODS[mode][:2] and options.compressor.scope == "model"
        assert options.compressor.scorer.name == "kvzap" and mode in options.compressor.requirements.modes
        assert options.slack == (None if mode == "prefill" else 0.1)
        assert (options.kv_bits, options.budget_unit) == ("auto" if mode == "prefill" else 8, "memory")
        res = generate_ids(model, ctx, question, compression_ratio=0.5, mode=mode, max_new_tokens=2, stop_at_eos=False)
        assert res.method == "adakv" and "reconstruction" not in res.extra and res.kv_bits == 8
        # more tokens quantized than the method keeps at full precision in the mode (a stream at its own slack) ...
        at_full_precision = generate_ids(model, ctx, question, method="adakv", method_params=DEFAULT_METHODS[mode][1],
                                         compression_ratio=0.5, mode=mode, max_new_tokens=2, stop_at_eos=False,
                                         slack=DEFAULT_METHODS[mode][2].get("slack"))
        assert res.realised_compression_ratio < at_full_precision.realised_compression_ratio
        # ... in at most the bytes of the ratio's whole budget at full precision, which prefill mode keeps (its later
        # tokens exact as chunked mode's; a stream compacted to its target may keep fewer; decode mode streams them too:
        # test_quantization.py's test_a_cache_read_as_memory_stores_within_the_bytes_the_ratio_leaves)
        if mode != "decode":
            whole_budget = generate_ids(model, ctx, question, method="adakv", method_params=DEFAULT_METHODS[mode][1],
                                        compression_ratio=0.5, max_new_tokens=2, stop_at_eos=False)
            assert res.kv_bytes <= whole_budget.kv_bytes


def test_the_default_on_a_model_without_a_scorer_is_an_error_naming_train_scorer():
    """The shipped scorer fits the default model only: the default method on another model's shapes is refused when its
    cache is built, naming the command that trains a scorer and how to name another method."""
    from kvcompress.integration import generate_ids
    from test_integration import _prompt, tiny

    ctx, question = _prompt(n=200)
    with pytest.raises(SurrogateError, match=r"the KVzap scorer '.*smollm2-135m-kvzap.safetensors' \(trained on model .*the default: "
                                             r"AdaKV over them\).*kvcompress train-scorer.*another method"):
        generate_ids(tiny(), ctx, question, compression_ratio=0.5, max_new_tokens=2)


def test_a_compressed_cache_of_kvzap_runs_inside_model_generate_and_leaves_no_hook(tiny_checkpoint, tiny_scorer):
    """`CompressedCache(model, "kvzap", scorer=FILE)` passed to a plain `model.generate`: the cache has the model keep
    each attention module's input hidden states for the attention function (`model_support.keep_hidden_states`), so the
    answer is the one `kvc.generate` gives; the hooks go when the cache does."""
    import gc

    from kvcompress.integration import generate_ids

    model, _ = kvc.load_model(tiny_checkpoint)
    g = torch.Generator().manual_seed(3)
    ctx, question = torch.randint(0, 200, (1, 160), generator=g), torch.randint(0, 200, (1, 6), generator=g)
    settings = dict(budget=24, method_params={"scorer": str(tiny_scorer)})
    cache = kvc.CompressedCache(model, "kvzap", **settings)
    out = model.generate(torch.cat([ctx, question], 1), past_key_values=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert max(cache.slots_per_layer()) < 166
    want = generate_ids(model, ctx, question, method="kvzap", max_new_tokens=4, stop_at_eos=False, **settings)
    assert out[0, 166:].tolist() == want.token_ids
    del cache
    gc.collect()
    copied = copy.deepcopy(kvc.CompressedCache(model, "kvzap", **settings))  # its original goes at once: the copy keeps the hooks
    gc.collect()
    again = model.generate(torch.cat([ctx, question], 1), past_key_values=copied, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert torch.equal(again, out)
    del copied
    gc.collect()
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_a_live_kvzap_cache_leaves_other_caches_as_they_are(tiny_checkpoint, tiny_scorer):
    """While a KVzap cache lives, the model keeps every attention module's input hidden states (its hooks); another
    cache whose method reads none takes none: a chunked Compactor answer stores what it stores alone, and a stream
    survives the KVzap cache going (its hooks removed) between two of its blocks."""
    import gc

    model, tokenizer = kvc.load_model(tiny_checkpoint)
    context = "Hidden states belong to the cache whose method reads them, and to no other. " * 4
    settings = dict(method="compactor", compression_ratio=0.5, mode="chunked", chunk_size=32, max_new_tokens=4, progress=False,
                    stop_at_eos=False)
    alone = kvc.generate(model, tokenizer, context, "what?", **settings)
    kvzap_cache = kvc.CompressedCache(model, "kvzap", budget=24, method_params={"scorer": str(tiny_scorer)})
    beside = kvc.generate(model, tokenizer, context, "what?", **settings)
    assert (beside.token_ids, beside.kv_bytes, beside.peak_kv_bytes) == (alone.token_ids, alone.kv_bytes, alone.peak_kv_bytes)
    ids = torch.randint(0, 200, (1, 64), generator=torch.Generator().manual_seed(4))
    stream = kvc.CompressedCache(model, "compactor", compression_ratio=0.5, mode="chunked", stream_length=64)
    with torch.no_grad():
        model(ids[:, :32], past_key_values=stream)
        del kvzap_cache
        gc.collect()
        model(ids[:, 32:], past_key_values=stream)
    assert stream.get_seq_length() == 64


def test_scope_model_streams_of_a_model_take_each_layers_share_and_stay_within_it(tiny_checkpoint, tiny_scorer, tmp_path):
    """AdaKV(scope="model") over KVzap in a decode-mode cache inside `model.generate`: each layer's stream is built with
    its share of the model's budget (`AdaKV.layer_budget`), the shares differ, sum to at most L·budget, and no stream
    ever holds more than its own; saved and loaded, the streams keep those budgets."""
    model, _ = kvc.load_model(tiny_checkpoint)
    ids = torch.randint(0, 200, (1, 166), generator=torch.Generator().manual_seed(4))
    params = {"scorer": "kvzap", "scorer_params": {"scorer": str(tiny_scorer)}, "scope": "model", "alpha_safeguard": 0.05}
    cache = kvc.CompressedCache(model, "adakv", mode="decode", compression_ratio=0.5, window=8, stream_length=170, method_params=params)
    peaks = [0, 0]

    def watch(module, args, kwargs, output):
        for i, layer in enumerate(cache.layers):
            if layer.front is not None:
                peaks[i] = max(peaks[i], layer.front.state.held_slots())

    handle = model.register_forward_hook(watch, with_kwargs=True)
    try:
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    finally:
        handle.remove()
    budget = cache.options.budget_for(170)
    want = [cache.options.compressor.layer_budget(budget, i, 170 - 4 - 8) for i in range(2)]
    assert [layer.front.budget for layer in cache.layers] == want and want[0] != want[1] and sum(want) <= 2 * budget
    assert all(0 < peak <= b for peak, b in zip(peaks, want))
    cache.save(tmp_path / "streams.kvc", token_ids=out[:, :-1])
    loaded = kvc.CompressedCache.load(tmp_path / "streams.kvc", model)
    assert [layer.front.budget for layer in loaded.layers] == want


def test_a_recorded_prefill_is_refused_by_name_for_kvzap(tiny_checkpoint, tiny_scorer):
    """A recorded prefill (`capture_qkv`) keeps no hidden states: compressing one with KVzap is refused naming why
    (`Method.check_inputs`), and the sweep runner lets a KVzap cell run its own forward
    (`Requirements.compresses_a_recorded_prefill`)."""
    from kvcompress.cache import CompressedCache
    from kvcompress.eval.capture import capture_qkv
    from kvcompress.options import CompressionOptions

    model, _ = kvc.load_model(tiny_checkpoint)
    captured = capture_qkv(model, torch.randint(0, 200, (1, 96), generator=torch.Generator().manual_seed(1)))
    options = CompressionOptions(method="kvzap", method_params={"scorer": str(tiny_scorer)}, budget=16)
    assert not options.compressor.requirements.compresses_a_recorded_prefill
    with pytest.raises(ValueError, match="scores the layer's hidden states.*a recorded prefill keeps none"):
        CompressedCache.from_prefill(model, options, captured)
    assert CompressionOptions(method="snapkv", budget=16).compressor.requirements.compresses_a_recorded_prefill


@pytest.mark.parametrize("pre_rope,bits", [(False, None), (True, None), (True, 4)])
def test_a_recompression_by_entry_scores_keeps_what_one_over_every_held_column_keeps(tmp_path, pre_rope, bits):
    """`AdaptiveBlockwiseState._recompress_by_entry_scores` (the kept tokens' columns gathered from the packed slots and
    the buffer, only the scores unpacked) leaves the state `_recompress_held` (every column unpacked to one rectangle)
    leaves: the same packed keys, values (with kv_bits, their codes, scales and zero points), positions, extra columns,
    per-head counts and admission rule."""
    import copy

    from kvcompress.methods.adakv import AdaKV

    _surrogate(width=4).save(tmp_path / "s.safetensors")
    method = AdaKV(scorer=KVzap(scorer=str(tmp_path / "s.safetensors")), alpha_safeguard=0.2)
    g = torch.Generator().manual_seed(7)
    b, h, n, budget = 2, 3, 400, 40
    keys, values = torch.randn(b, h, n, 8, generator=g), torch.randn(b, h, n, 8, generator=g)
    scores = torch.randn(b, h, n, generator=g) + torch.linspace(0, 2, h)[:, None]
    pre = torch.randn(b, h, n, 8, generator=g)
    state = method.new_stream(budget, torch.Generator(), 0.1)
    if bits is not None:
        state = state.quantized(bits, 4)
    checked = 0
    for start in range(0, n, 9):
        stop = min(n, start + 9)
        state.absorb(Tokens(keys[:, :, start:stop], values[:, :, start:stop], torch.arange(start, stop).expand(b, h, -1),
                            pre_rope_keys=pre[:, :, start:stop] if pre_rope else None, entry_scores=scores[:, :, start:stop]))
        if state.kept is not None and state.held_slots() > state.target:
            gathered, unpacked = copy.deepcopy(state), copy.deepcopy(state)
            gathered._recompress_by_entry_scores()
            unpacked._recompress_held(fixed=True)
            assert all(torch.equal(x, y) for x, y in zip(gathered._stored_kept(), unpacked._stored_kept(), strict=True))
            assert len(gathered._stored_kept()) == (7 if bits else 3) + 1 + pre_rope
            assert torch.equal(gathered.kept.counts, unpacked.kept.counts)
            assert len(gathered.kept_extra) == 1 + pre_rope
            assert all(torch.equal(x, y) for x, y in zip(gathered.kept_extra, unpacked.kept_extra, strict=True))
            assert all(torch.equal(x, y) for x, y in zip(gathered.admission, unpacked.admission, strict=True))
            checked += 1
    assert checked >= 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_kv_bits_a_stream_over_entry_scores_keeps_the_same_tokens_each_quantized_once_and_packed(tmp_path, dtype):
    """AdaKV over entry scores (the default's streams) with kv_bits: the same tokens are kept as at full precision, at every
    step (positions, per-head counts, admission rule, the buffer's length), each kept slot is its key and value quantized once
    on entry (`quantize` per slot over groups of channels), and the kept slots are stored packed
    (`QuantizedRaggedSlots`), so the state stores each kept slot's codes, scales and zero points and the buffer's: a
    layer row holds at most H_kv·budget slots, as at full precision."""
    from kvcompress.methods.adakv import AdaKV
    from kvcompress.quantization import QuantizedRaggedSlots, quantize
    from kvcompress.summary import take_slots

    _surrogate(width=4).save(tmp_path / "s.safetensors")
    method = AdaKV(scorer=KVzap(scorer=str(tmp_path / "s.safetensors")), alpha_safeguard=0.2)
    g = torch.Generator().manual_seed(3)
    b, h, n, d, budget, group = 2, 3, 600, 16, 40, 8
    keys, values = (torch.randn(b, h, n, d, generator=g).to(dtype) for _ in range(2))
    scores = torch.randn(b, h, n, generator=g) + torch.linspace(0, 2, h)[:, None]
    full = method.new_stream(budget, torch.Generator(), 0.1)
    quantized = method.new_stream(budget, torch.Generator(), 0.1).quantized(4, group)
    per_slot = 2 * (d * 4 // 8 + 2 * (d // group) * keys.element_size())  # a key and a value: codes, a scale and a zero per group
    checked = 0
    for start in range(0, n, 37):  # blocks larger than the room (16) and smaller
        stop = min(n, start + 37)
        for state in (full, quantized):
            state.absorb(Tokens(keys[:, :, start:stop], values[:, :, start:stop], torch.arange(start, stop).expand(b, h, -1),
                                entry_scores=scores[:, :, start:stop]))
        assert quantized.slots.length == full.slots.length and quantized.seen == full.seen
        if full.kept is None:
            continue
        assert isinstance(quantized.kept, QuantizedRaggedSlots)
        assert torch.equal(quantized.kept.positions, full.kept.positions) and torch.equal(quantized.kept.counts, full.kept.counts)
        assert all(torch.equal(x, y) for x, y in zip(quantized.admission, full.admission, strict=True))
        stored = quantized.kept.ragged()
        index = full.kept.positions.long()  # the packed slots' tokens, head after head
        head = torch.repeat_interleave(torch.arange(b * h), full.kept.counts.flatten().long())
        for got, original in ((stored.keys, keys), (stored.values, values)):
            expected = quantize(original.flatten(0, 1)[head, index][None, None], 4, group, "token").dequantize()[0, 0]
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        new = quantized.slots.view()
        if quantized.slots.length:
            positions = new[2]
            torch.testing.assert_close(new[0], quantize(take_slots(keys, positions), 4, group, "token").dequantize(), rtol=0, atol=0)
        assert quantized.nbytes() == (full.kept.positions.numel() + b * h * quantized.slots.tensors[0].shape[2]) * per_slot + \
            full.kept.counts.numel() * 4
        assert quantized.nbytes() <= b * h * budget * per_slot + full.kept.counts.numel() * 4
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("alpha", [0.0, 0.2, 1.0])
def test_a_stream_turns_away_only_tokens_no_later_recompression_could_keep(tmp_path, alpha):
    """AdaKV over entry scores (KVzap's) in a stream: tokens scoring below every head's floor and the row's cutoff of the
    last re-compression are not stored (`AdaptiveBlockwiseState.admission`), and none of them was needed: a last re-compression of what
    is held keeps exactly what one allocation over every token absorbed keeps. Most tokens are turned away, so the
    stream re-compresses far less often than once per room's worth of tokens; its room is at least 16 slots."""
    from kvcompress.methods.adakv import AdaKV, head_allocation

    _surrogate(width=4).save(tmp_path / "s.safetensors")
    method = AdaKV(scorer=KVzap(scorer=str(tmp_path / "s.safetensors")), alpha_safeguard=alpha)
    g = torch.Generator().manual_seed(5)
    b, h, n, budget = 2, 3, 3000, 40
    keys, values = torch.randn(b, h, n, 4, generator=g), torch.randn(b, h, n, 4, generator=g)
    scores = torch.randn(b, h, n, generator=g) + torch.linspace(0, 2, h)[:, None]  # heads on different levels
    state = method.new_stream(budget, torch.Generator(), 0.1)
    assert (state.target, state.slack_slots) == (24, 16)  # slack 0.1 alone leaves 4 slots of room; at least 16 (ENTRY_SCORE_ROOM)
    assert method.ranks_by_entry_score and not AdaKV(normalize="softmax", scorer=method.scorer).ranks_by_entry_score
    assert AdaKV().new_stream(budget, torch.Generator(), 0.1).slack_slots == 4  # SnapKV rescores: the slack's room
    calls = []
    recompress = state.recompress
    state.recompress = lambda room: (calls.append(state.held_slots()), recompress(room))
    for start in range(0, n, 7):
        stop = min(n, start + 7)
        state.absorb(Tokens(keys[:, :, start:stop], values[:, :, start:stop], torch.arange(start, stop).expand(b, h, -1),
                            entry_scores=scores[:, :, start:stop]))
        assert state.held_slots() <= budget
    assert state.seen == n and len(calls) < (n - budget) // state.slack_slots // 2  # 185 without turning any away
    state.recompress(room=0)
    kept = head_allocation(scores, state.target, min(method.safeguard(state.target), state.target))
    want = torch.arange(n).expand(b, h, -1)[kept]
    assert torch.equal(state.kept.positions.long(), want) and torch.equal(state.kept.counts.long(), kept.sum(-1))


@pytest.mark.parametrize("alpha", [0.0, 0.2])
def test_a_block_larger_than_the_room_costs_one_recompression_and_stores_only_what_it_keeps(tmp_path, alpha):
    """AdaKV over entry scores in a stream fed blocks of 64 tokens, four times its room of 16: each block whose admitted
    tokens overflow the room is ranked with what is held in one re-compression (`AdaptiveBlockwiseState.absorb`), never
    buffered first, so the state holds at most its budget throughout and re-compresses at most once per block; what it
    keeps in the end is what one allocation over every token absorbed keeps."""
    from kvcompress.methods.adakv import AdaKV, head_allocation

    _surrogate(width=4).save(tmp_path / "s.safetensors")
    method = AdaKV(scorer=KVzap(scorer=str(tmp_path / "s.safetensors")), alpha_safeguard=alpha)
    g = torch.Generator().manual_seed(11)
    b, h, n, budget, block = 2, 3, 1024, 40, 64
    keys, values = torch.randn(b, h, n, 4, generator=g), torch.randn(b, h, n, 4, generator=g)
    scores = torch.randn(b, h, n, generator=g) + torch.linspace(0, 2, h)[:, None]
    state = method.new_stream(budget, torch.Generator(), 0.1)
    assert state.slack_slots == 16
    calls = []
    for name in ("recompress", "_recompress_by_entry_scores"):
        original = getattr(state, name)
        setattr(state, name, lambda *args, _original=original, **kwargs: (calls.append(1), _original(*args, **kwargs))[1])
    for start in range(0, n, block):
        before = len(calls)
        state.absorb(Tokens(keys[:, :, start:start + block], values[:, :, start:start + block],
                            torch.arange(start, start + block).expand(b, h, -1), entry_scores=scores[:, :, start:start + block]))
        assert state.held_slots() <= budget and state.peak_slots <= budget
        assert len(calls) - before <= (2 if start == 0 else 1)  # the first block fills the buffer, then its first re-compression
    assert state.seen == n and len(calls) <= n // block + 1
    state.recompress(room=0)
    kept = head_allocation(scores, state.target, min(method.safeguard(state.target), state.target))
    want = torch.arange(n).expand(b, h, -1)[kept]
    assert torch.equal(state.kept.positions.long(), want) and torch.equal(state.kept.counts.long(), kept.sum(-1))


def test_a_learned_layer_split_keeps_each_layers_share_in_one_shot_and_is_refused_without_shares(tmp_path):
    """AdaKV scope "model" with layer_split="learned" (mode prefill): each layer keeps its `layer_budget` of the model's
    budget, shared among its heads by `head_allocation` of its own scores, where "joint" ranks every layer's heads
    together; a scope or scorer without learned shares, or another split, is a clear error."""
    from kvcompress.methods.adakv import AdaKV, head_allocation

    s = _with_quantiles([torch.linspace(0, 1, 9).tolist(), torch.linspace(1, 2, 9).tolist()])
    s.save(tmp_path / "q.safetensors")
    scorer = KVzap(scorer=str(tmp_path / "q.safetensors"))
    learned = AdaKV(scorer=scorer, scope="model", alpha_safeguard=0.2, layer_split="learned")
    g = torch.Generator().manual_seed(0)
    layers = [Tokens(torch.randn(1, 2, 408, 8, generator=g), torch.randn(1, 2, 408, 8, generator=g), torch.arange(408).expand(1, 2, 408),
                     layer_idx=layer, num_layers=2, hidden_states=torch.randn(1, 2, 408, 8, generator=g)) for layer in (0, 1)]
    summaries = learned.compress_layers(layers, 102, [torch.Generator() for _ in layers])
    budgets = [learned.layer_budget(102, layer, 408) for layer in (0, 1)]  # keeps a quarter: shares 0 and 2
    assert budgets == [22, 182]
    for tokens, summary, budget in zip(layers, summaries, budgets):
        kept = head_allocation(scorer.score(tokens, None), budget, learned.safeguard(budget))
        for head in range(2):
            stored = summary.positions[0, head][torch.isfinite(summary.log_weights[0, head])]
            assert torch.equal(stored, kept[0, head].nonzero().squeeze(1))
    joint = AdaKV(scorer=scorer, scope="model", alpha_safeguard=0.2).compress_layers(layers, 102, [torch.Generator() for _ in layers])
    assert [int(torch.isfinite(x.log_weights).sum()) for x in joint] != [2 * b for b in budgets]
    with pytest.raises(ValueError, match="layer_split must be one of"):
        AdaKV(scorer=scorer, scope="model", layer_split="even")
    with pytest.raises(ValueError, match="needs scope='model' and a scorer with layer shares"):
        AdaKV(scorer=scorer, scope="layer", layer_split="learned")
    _surrogate().save(tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match="needs scope='model' and a scorer with layer shares"):
        AdaKV(scorer=KVzap(scorer=str(tmp_path / "plain.safetensors")), scope="model", layer_split="learned")


def test_a_damaged_scorer_file_is_refused_by_its_checksum(tmp_path):
    """A flipped bit that leaves every weight finite loaded, and scored with it (a weight of -2e38 made a layer's
    scores infinite): the file records a SHA-256 of its tensors."""
    path = tmp_path / "s.safetensors"
    _surrogate().save(path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # a mantissa bit of the last stored value: still a finite float
    path.write_bytes(bytes(data))
    with pytest.raises(SurrogateError, match=r"its tensors do not match the checksum it records \(sha256\): the file is damaged"):
        Surrogate.load(path)


def _with_layers(s: Surrogate, layers: tuple[int, ...]) -> Surrogate:
    """`s` with its first layer's surrogate for each of `layers`."""
    def rows(t):
        return None if t is None else t[:1].expand(len(layers), *t.shape[1:]).clone()

    return replace(s, layers=layers, first_weight=rows(s.first_weight), first_bias=rows(s.first_bias),
                   second_weight=rows(s.second_weight), second_bias=rows(s.second_bias), score_quantiles=rows(s.score_quantiles))


def test_a_scorer_for_other_layers_is_refused_when_the_cache_is_built(tiny_checkpoint, tiny_scorer, tmp_path):
    """A file of the model's width and heads but of other layers was taken: its shares of one budget were normalised
    over layers the model does not have, so a stream kept less than the ratio asked."""
    model, _ = kvc.load_model(tiny_checkpoint)
    s = Surrogate.load(tiny_scorer)
    n = len(s.layers)
    assert s.layers == tuple(range(n))
    kvc.CompressedCache(model, "kvzap", method_params={"scorer": str(tiny_scorer)}, budget=16)
    for layers in ((*s.layers, n, n + 1), s.layers[:-1]):
        path = tmp_path / f"layers{len(layers)}.safetensors"
        _with_layers(s, layers).save(path)
        for method, params in (("kvzap", {"scorer": str(path)}), ("adakv", {"scorer": "kvzap", "scorer_params": {"scorer": str(path)}}),
                               ("hybrid", {"score": ["tova", "kvzap"], "score_params": [None, {"scorer": str(path)}]})):
            with pytest.raises(SurrogateError, match=rf"covers layers {re.escape(str(list(layers)))} with {s.kv_heads} KV heads of width "
                                                     rf"{s.input_width}; this model compresses layers {re.escape(str(list(range(n))))} with "
                                                     rf"{s.kv_heads} of width {s.input_width}: it belongs to another model"):
                kvc.CompressedCache(model, method, budget=16, method_params=params)


def test_a_decode_cache_goes_on_with_the_scorer_it_was_made_with(tiny_checkpoint, tiny_scorer, tmp_path, monkeypatch):
    """A decode-mode cache, whose streams score every later token, is refused once the file its settings name holds other
    weights: trained again at the same path, or another file at the same relative path from another working directory
    (it answered with them, silently). A prefill-mode cache reads only what it stores and still loads."""
    import shutil

    from kvcompress.cache_file import CacheFileError
    from kvcompress.integration import compress_context_ids

    model, _ = kvc.load_model(tiny_checkpoint)
    shutil.copy(tiny_scorer, tmp_path / "scorer.safetensors")
    monkeypatch.chdir(tmp_path)
    ctx = torch.randint(0, 200, (1, 120), generator=torch.Generator().manual_seed(5))
    for mode in ("prefill", "decode"):
        cache = compress_context_ids(model, ctx, method="kvzap", method_params={"scorer": "scorer.safetensors"}, budget=24, mode=mode,
                                     **({"chunk_size": 32} if mode == "decode" else {}))
        cache.save(tmp_path / f"{mode}.kvc")
    assert kvc.load_cache(tmp_path / "decode.kvc", model).get_seq_length() == 120
    s = Surrogate.load(tmp_path / "scorer.safetensors")
    (tmp_path / "elsewhere").mkdir()
    replace(s, first_bias=s.first_bias + 1.0).save(tmp_path / "elsewhere" / "scorer.safetensors")
    replace(s, first_bias=s.first_bias - 1.0).save(tmp_path / "scorer.safetensors")  # trained again at the same path
    for where in (tmp_path, tmp_path / "elsewhere"):
        monkeypatch.chdir(where)
        assert kvc.load_cache(tmp_path / "prefill.kvc", model).get_seq_length() == 120
        with pytest.raises(CacheFileError, match=r"was compressed by 'kvzap' with weights of checksums \{'scorer': '[0-9a-f]{64}'\}; the "
                                                 r"files its settings name now hold \{'scorer': '[0-9a-f]{64}'\}"):
            kvc.load_cache(tmp_path / "decode.kvc", model)


def test_train_scorer_refuses_a_tuning_count_the_text_cannot_fill_before_scoring(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """The tuning contexts were cut after the training contexts' KVzip scoring (about ten minutes at the defaults)."""
    from kvcompress.integration import scorer_training

    def no_scoring(*args, **kwargs):
        raise AssertionError("scored before the contexts were checked")

    monkeypatch.setattr(scorer_training, "scoring_pairs", no_scoring)
    assert main(["train-scorer", "--model", str(tiny_checkpoint), "--tokens", "96", "--contexts", "1", "--tuning-contexts", "5000",
                 "--out", str(tmp_path / "s.safetensors")]) == 2
    assert "--tuning-contexts 5000: the text" in capsys.readouterr().err


def test_a_saved_decode_cache_of_the_default_admits_as_the_live_one(tiny_checkpoint, tiny_scorer, tmp_path):
    """The default's decode stream turns away tokens it could never keep (`AdaptiveBlockwiseState.admission`); a loaded
    stream had lost that rule, admitted what the live one turned away, re-compressed at other steps and answered
    otherwise. The rule is saved with the stream: the loaded cache holds and answers as the live one does."""
    from kvcompress.integration import answer_from_cache_ids, compress_context_ids

    model, _ = kvc.load_model(tiny_checkpoint)
    g = torch.Generator().manual_seed(11)
    ctx, question = torch.randint(0, 200, (1, 400), generator=g), torch.randint(0, 200, (1, 6), generator=g)
    settings = dict(method="adakv", method_params={"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05,
                                                   "scorer_params": {"scorer": str(tiny_scorer)}}, budget=24, mode="decode",
                    chunk_size=32, slack=0.1)
    cache = compress_context_ids(model, ctx, **settings)
    assert all(layer.front.state.admission is not None for layer in cache.layers)
    cache.save(tmp_path / "c.kvc")
    (live,) = answer_from_cache_ids(model, cache, [question], max_new_tokens=40, stop_at_eos=False)
    (loaded,) = answer_from_cache_ids(model, tmp_path / "c.kvc", [question], max_new_tokens=40, stop_at_eos=False)
    assert loaded.token_ids == live.token_ids and loaded.slots_per_layer == live.slots_per_layer


def test_hidden_state_hooks_removed_during_a_forward_do_not_break_it(tiny_checkpoint):
    """A dropped default cache's finalizer removes its hooks whenever the garbage collector runs, possibly inside another
    forward; torch then still calls a removed hook, without its kwargs (a TypeError out of model.generate, now and then)."""
    from kvcompress.model_support import attention_modules, keep_hidden_states, release_hidden_states

    model, _ = kvc.load_model(tiny_checkpoint)
    module = attention_modules(model)[0]
    handles = []
    remover = module.register_forward_pre_hook(lambda *_: release_hidden_states(handles), with_kwargs=True)
    handles += keep_hidden_states(model)  # registered after the remover: removed by it within the same forward
    try:
        with torch.no_grad():
            model(torch.arange(8)[None])
    finally:
        remover.remove()
    assert not any(m._forward_pre_hooks for m in attention_modules(model))


def test_adakv_refuses_kvzaps_threshold_which_its_allocation_would_not_apply(tiny_scorer):
    """threshold in AdaKV's scorer_params was ignored: the same slots, bytes and answer at -3, 100 and none."""
    with pytest.raises(ValueError, match=r"scorer 'kvzap' with a threshold drops tokens by its own rule, which AdaKV does not apply "
                                         r".*run method='kvzap' for the threshold rule"):
        build_method("adakv", scorer="kvzap", scorer_params={"scorer": str(tiny_scorer), "threshold": -3.0})
    build_method("adakv", scorer="kvzap", scorer_params={"scorer": str(tiny_scorer)})
    build_method("kvzap", scorer=str(tiny_scorer), threshold=-3.0)


def test_a_scorer_file_is_written_whole_or_the_one_there_stays(tiny_scorer, tmp_path, monkeypatch):
    """A failed write (a full disk, a file size limit) truncated the scorer file already at --out."""
    import kvcompress.saved_state as saved_state

    out = tmp_path / "scorer.safetensors"
    surrogate = Surrogate.load(tiny_scorer)
    surrogate.save(out)
    before = out.read_bytes()

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(saved_state.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        surrogate.save(out)
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["scorer.safetensors"]
    Surrogate.load(out)


def _in_threads(calls) -> list:
    """Each call in its own thread, all started together; their results in order (an exception is re-raised)."""
    import threading

    results, start = [None] * len(calls), threading.Barrier(len(calls))

    def run(i):
        start.wait()
        try:
            results[i] = calls[i]()
        except Exception as err:  # re-raised in the test's thread
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def test_threads_on_one_model_each_get_their_own_answer(tiny_checkpoint, tiny_scorer):
    """One model, several threads at once: kvcompress's calls hold the model's lock (`model_support.model_lock`; a call
    switches the model's attention and generation config while it runs), and the hidden states a method scores are kept
    per thread (`model_support.take_hidden_states`), so caches built by name and used through `model.generate` in two threads read
    their own. Every answer equals the same call alone, and the model's settings come back as they were."""
    from kvcompress.integration import generate_ids

    model, _ = kvc.load_model(tiny_checkpoint)
    eos, attention = model.generation_config.eos_token_id, model.config._attn_implementation
    g = torch.Generator().manual_seed(5)
    prompts = [(torch.randint(0, 200, (1, 150), generator=g), torch.randint(0, 200, (1, 6), generator=g)) for _ in range(2)]
    kvzap = dict(method="kvzap", budget=24, method_params={"scorer": str(tiny_scorer)})

    def answer(i, stop_at_eos):
        return generate_ids(model, *prompts[i], max_new_tokens=6, stop_at_eos=stop_at_eos, **kvzap).token_ids

    def by_name(i):
        cache = kvc.CompressedCache(model, "kvzap", budget=24, scorer=str(tiny_scorer))
        out = model.generate(torch.cat(prompts[i], 1), past_key_values=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        return out[0, -6:].tolist()

    alone = [answer(0, False), answer(1, True)]
    named = [by_name(0), by_name(1)]
    for _ in range(4):
        assert _in_threads([lambda: answer(0, False), lambda: answer(1, True)]) == alone
        assert _in_threads([lambda: by_name(0), lambda: by_name(1)]) == named
    assert model.generation_config.eos_token_id == eos and model.config._attn_implementation in (attention, "kvcompress")


def test_a_call_ending_leaves_the_attention_a_cache_built_by_name_switched_to_meanwhile():
    """A kvcompress call restores the attention implementation it found, unless a cache built by name (in another
    thread, here inside the call) switched the model for its other uses meanwhile: that cache then still works."""
    from kvcompress.model_support import use_compressed_attention
    from test_integration import _prompt, tiny

    model = tiny()
    model.set_attn_implementation("sdpa")
    ids = torch.cat(_prompt(n=100), 1)
    with use_compressed_attention(model):
        cache = kvc.CompressedCache(model, "knorm", budget=16)
    assert model.config._attn_implementation == "kvcompress"
    assert model.generate(ids, past_key_values=cache, max_new_tokens=3, min_new_tokens=3, do_sample=False).shape == (1, 111)
    with use_compressed_attention(model):  # nothing switched meanwhile: what it found comes back
        pass
    model.set_attn_implementation("sdpa")
    with use_compressed_attention(model):
        pass
    assert model.config._attn_implementation == "sdpa"


def test_a_dropped_cache_is_freed_at_once_with_the_defaults_hooks_and_a_copy_owns_its_layers(tiny_default_scorer):
    """A cache's layers referred back to it strongly, a cycle: a dropped cache kept its tensors, and the default's 2
    forward pre-hooks per model (30 on SmolLM2), until the garbage collector's next full pass (SmolLM2 reached 180
    hooks over six dropped caches). With the collector off, dropping the cache now frees it and takes its hooks off;
    a deep copy's layers belong to the copy."""
    import copy
    import gc
    import weakref

    from test_integration import _prompt, tiny

    model = tiny()
    ids = torch.cat(_prompt(n=200), 1)

    def hooks() -> int:
        return sum(len(m._forward_pre_hooks) for m in model.modules())

    before = hooks()
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            cache = kvc.CompressedCache(model, compression_ratio=0.5)
            model.generate(ids, past_key_values=cache, max_new_tokens=2, min_new_tokens=2, do_sample=False)
            assert hooks() == before + 2
            copied = copy.deepcopy(cache)
            assert all(layer.cache is copied for layer in copied.layers) and all(layer.cache is cache for layer in cache.layers)
            assert hooks() == before + 4
            dropped = weakref.ref(cache)
            del cache, copied
            assert dropped() is None and hooks() == before
    finally:
        gc.enable()
