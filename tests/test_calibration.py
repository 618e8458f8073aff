"""Context-calibrated compression (the Compactor paper, Sec. 3.5): the curve, its inverse, the fit, the JSON file."""

import json
import math
import re

import pytest
import torch

from kvcompress import calibration as cal

KAPPAS = [-700.0, -50.0, -3.0, -1e-9, 0.0, 1e-9, 0.5, 3.0, 50.0, 700.0, 5000.0]


def _naive(r, k):
    return (math.exp(k * r) - 1) / (math.exp(k) - 1)


@pytest.mark.parametrize("kappa", KAPPAS)
def test_curve_is_a_finite_monotone_map_from_0_to_1(kappa):
    r = torch.linspace(0, 1, 101, dtype=torch.float64)
    f = cal.retention_curve(r, kappa)
    assert torch.isfinite(f).all()
    assert f[0] == 0 and abs(float(f[-1]) - 1) < 1e-12
    assert (f.diff() >= -1e-15).all()
    if 1e-3 < abs(kappa) < 700:
        for x in (0.1, 0.5, 0.9):
            assert math.isclose(float(cal.retention_curve(x, kappa)), _naive(x, kappa), rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("kappa", KAPPAS)
@pytest.mark.parametrize("quality", [0.5, 0.9, 0.95, 0.999, 1.0])
def test_optimal_retention_inverts_the_curve(kappa, quality):
    r = cal.optimal_retention(kappa, quality)
    assert 0.0 <= r <= 1.0
    assert float(cal.retention_curve(r, kappa)) >= quality - 1e-9
    if r > 1e-6:  # the smallest such r: a little less falls short
        assert float(cal.retention_curve(r * (1 - 1e-4), kappa)) < quality + 1e-12


def test_optimal_retention_known_values():
    assert math.isclose(cal.optimal_retention(-3.0, 0.95), math.log1p(0.95 * math.expm1(-3.0)) / -3.0)
    assert 0.77 < cal.optimal_retention(-3.0, 0.95) < 0.78  # docs/design.md, "Context-calibrated compression"
    assert math.isclose(cal.optimal_retention(1e-9, 0.95), 0.95)
    assert math.isclose(cal.optimal_retention(1e-4, 0.95), 0.95, rel_tol=1e-4)
    assert cal.optimal_retention(1000.0, 0.95) > 0.999  # large positive k: incompressible, no overflow
    with pytest.raises(ValueError, match="quality"):
        cal.optimal_retention(-3.0, 0.0)
    with pytest.raises(ValueError, match="quality"):
        cal.optimal_retention(-3.0, 1.5)


def _synthetic_triples(alpha, beta, noise, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for nll in torch.linspace(1.0, 4.0, 8).tolist():
        for r in (0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
            y = float(cal.retention_curve(r, alpha * nll + beta)) + noise * float(torch.randn(1, generator=g))
            rows.append({"retention": r, "nll_context": nll, "nll_ratio": y})
    return rows


def test_fit_recovers_parameters_from_exact_triples():
    c = cal.fit(_synthetic_triples(2.0, -9.0, 0.0), "compactor", asymmetry=1.0)
    assert math.isclose(c.alpha, 2.0, abs_tol=1e-3) and math.isclose(c.beta, -9.0, abs_tol=1e-3)
    assert c.n_triples == 48 and c.loss < 1e-10


def test_asymmetric_loss_keeps_the_curve_below_the_data():
    triples = _synthetic_triples(2.0, -9.0, 0.05, seed=1)
    sym = cal.fit(triples, "compactor", asymmetry=1.0)
    asym = cal.fit(triples, "compactor", asymmetry=8.0)
    r = torch.tensor([t["retention"] for t in triples], dtype=torch.float64)
    nll = torch.tensor([t["nll_context"] for t in triples], dtype=torch.float64)
    y = torch.tensor([t["nll_ratio"] for t in triples], dtype=torch.float64)
    over_sym = (sym.predict(r, nll) > y).float().mean()
    over_asym = (asym.predict(r, nll) > y).float().mean()
    assert over_asym < over_sym
    # a more cautious curve asks for more retention at the same quality budget
    assert asym.retention(2.5, 0.95) > sym.retention(2.5, 0.95)


def test_json_round_trip_and_choose_ratio(tmp_path):
    c = cal.Calibration("snapkv", alpha=1.5, beta=-7.0, model="SmolLM2", method_params={"kernel_size": 5}, n_triples=10, loss=0.01)
    path = tmp_path / "cal.json"
    c.save(path)
    assert cal.Calibration.load(path) == c
    kappa = 1.5 * 2.0 - 7.0
    assert math.isclose(cal.choose_ratio(path, 2.0, 0.95), 1 - cal.optimal_retention(kappa, 0.95))
    assert math.isclose(cal.choose_ratio(c, 2.0, 0.95), cal.choose_ratio(path, 2.0, 0.95))
    (tmp_path / "bad.json").write_text('{"alpha": 1}')
    with pytest.raises(ValueError, match="not a calibration file"):
        cal.Calibration.load(tmp_path / "bad.json")


def test_a_calibration_without_a_fit_equals_its_copies(tmp_path):
    """A curve built by hand has no fit's loss (NaN, which equals nothing): its copies, pickled or saved, still equal it;
    the loss is a record of the fit, not part of the curve."""
    import copy
    import pickle

    c = cal.Calibration("snapkv", alpha=1.5, beta=-7.0)
    c.save(tmp_path / "cal.json")
    loaded = cal.Calibration.load(tmp_path / "cal.json")
    assert math.isnan(c.loss) and math.isnan(loaded.loss)
    assert pickle.loads(pickle.dumps(c)) == copy.deepcopy(c) == loaded == c
    assert cal.Calibration("snapkv", alpha=1.5, beta=-7.0, loss=0.5) == c != cal.Calibration("snapkv", alpha=1.5, beta=-6.0)


@pytest.mark.parametrize("field, value, match", [
    ("alpha", "x", "alpha must be a finite number"), ("alpha", None, "alpha must be a finite number"),
    ("beta", float("nan"), "beta must be a finite number"), ("asymmetry", 0.5, "asymmetry must be a number from 1 to 1e"), ("asymmetry", 1e308, r"asymmetry must be a number from 1 to 1e\+06"),
    ("method", "", "method must be a registered method's name"), ("method", "nosuch", "method must be a registered method's name .* got 'nosuch'"), ("method_params", [1], "method_params must be a dict"),
    ("method_params", {"bogus": 1}, r"method_params \{'bogus': 1\} are not 'snapkv''s \(method 'snapkv' has no parameter"),
    ("n_triples", -1, "n_triples must be"), ("nll_context_range", [2.0], r"nll_context_range must be None or \[lowest, highest\]"),
    ("nll_context_range", [3.0, 1.0], r"nll_context_range must be \[lowest, highest\]"), ("nll_context_range", [1.0, "x"], "nll_context_range must be a finite"),
])
def test_a_calibration_file_with_a_bad_value_is_refused_when_loaded(tmp_path, field, value, match):
    """A file that loads must give a ratio: a NaN slope had turned compression off (r* = 1), a text one failed after
    the model's prefill."""
    path = tmp_path / "cal.json"
    cal.Calibration("snapkv", alpha=1.5, beta=-7.0).save(path)
    data = json.loads(path.read_text()) | {field: value}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"calibration {re.escape(str(path))}: not a calibration file \\({match}"):
        cal.load_calibration(path)


def test_fit_rejects_bad_input():
    good = _synthetic_triples(1.0, -5.0, 0.0)
    with pytest.raises(ValueError, match="asymmetry"):
        cal.fit(good, "compactor", asymmetry=0.5)
    with pytest.raises(ValueError, match="at least 2"):
        cal.fit(good[:1], "compactor")
    with pytest.raises(ValueError, match="retention"):
        cal.fit([(0.0, 2.0, 0.5), (0.5, 2.0, 0.9)], "compactor")
    with pytest.raises(ValueError, match="NaN"):
        cal.fit([(0.5, float("nan"), 0.5), (0.5, 2.0, 0.9)], "compactor")


def test_mean_nll_matches_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(1, 7, 11, generator=g), torch.randint(0, 11, (1, 7), generator=g)
    ref = torch.nn.functional.cross_entropy(logits[0], targets[0])
    assert math.isclose(cal.mean_nll(logits.half(), targets), float(ref), rel_tol=1e-2)
    assert math.isclose(cal.mean_nll(logits, targets), float(ref), rel_tol=1e-6)


def test_a_calibration_for_another_method_is_refused_naming_both_methods_before_the_model_runs(tmp_path, tiny_checkpoint):
    import kvcompress as kvc
    from kvcompress.options import CompressionOptions

    path = tmp_path / "compactor.json"
    cal.Calibration("compactor", alpha=0.0, beta=-3.0).save(path)
    model, tokenizer = kvc.load_model(tiny_checkpoint)
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with pytest.raises(ValueError, match=r"calibration was fitted for method 'compactor', got method='keydiff'.*name no method to run 'compactor'"):
        kvc.generate(model, tokenizer, "The magic number is 42. " * 8, "What is the magic number?", method="keydiff",
                     calibration=path, quality=0.9, progress=False)
    assert forwards == []  # refused when the options are built
    fitted = cal.Calibration("keydiff", alpha=0.0, beta=-3.0, method_params={"anchor": "median"})
    with pytest.raises(ValueError, match=r"method parameters \{'anchor': 'mean'\} differ from those the calibration was fitted with, \{'anchor': 'median'\}"):
        CompressionOptions.build(method="keydiff", anchor="mean", quality=0.9, calibration=fitted)
    with pytest.raises(ValueError, match=r"calibration must be a kvcompress.calibration.Calibration or the path .*got a int: 3"):
        CompressionOptions(quality=0.9, calibration=3)
    with pytest.raises(ValueError, match=r"calibration '.*none.json' does not exist: write one with"):
        CompressionOptions(quality=0.9, calibration=tmp_path / "none.json")
    with pytest.raises(ValueError, match=r"quality \(the NLL-ratio budget gamma\) must be in \(0, 1\], got 0"):
        CompressionOptions(quality=0, calibration=path)


def test_with_no_method_named_the_calibrations_method_and_parameters_run(tmp_path, tiny_checkpoint):
    """Not the library's default (adakv): KeyDiff with the median anchor the file was fitted with, at the ratio it chose."""
    import kvcompress as kvc
    from kvcompress.options import CompressionOptions

    path = tmp_path / "keydiff.json"
    cal.Calibration("keydiff", alpha=0.0, beta=-3.0, method_params={"anchor": "median"}).save(path)
    model, tokenizer = kvc.load_model(tiny_checkpoint)
    context, question = "The magic number is 42. The sky is green today. " * 6, "What is the magic number?"
    run = dict(max_new_tokens=4, stop_at_eos=False, progress=False)
    res = kvc.generate(model, tokenizer, context, question, calibration=path, quality=0.8, **run)
    ratio = res.extra["calibration"]["compression_ratio"]
    assert res.method == "keydiff" and ratio == pytest.approx(1 - cal.optimal_retention(-3.0, 0.8))
    named = kvc.generate(model, tokenizer, context, question, method="keydiff", anchor="median", compression_ratio=ratio, **run)
    assert res.token_ids == named.token_ids and res.slots_per_layer == named.slots_per_layer
    options = CompressionOptions(quality=0.8, calibration=str(path))
    assert (options.method, options.method_params) == ("keydiff", {"anchor": "median"}) and options.calibration == cal.Calibration.load(path)
    assert CompressionOptions(**options.to_dict()) == options
    # a method named is the file's: its parameters fill those not given
    assert CompressionOptions.build(method="keydiff", metric="dot", quality=0.8, calibration=path).method_params == {"anchor": "median", "metric": "dot"}


def test_a_context_outside_the_fitted_nll_range_is_said_to_extrapolate(tmp_path, tiny_checkpoint):
    """A fit records the range of NLL(c) its contexts spanned; a context outside it gets the curve's ratio with a warning
    that the choice extrapolates (extra["calibration"]["extrapolated"]), which a context inside it does not; a file that
    records no range warns of nothing (None). A fit on one sample had chosen 4 % of a context far outside its range,
    and the answer looped, without a word."""
    import warnings

    import kvcompress as kvc

    fitted = cal.fit(_synthetic_triples(1.0, -5.0, 0.0), "keydiff")
    assert cal.Calibration("keydiff", 0.0, -3.0, 4.0, None, {}, 10, 0.01).loss == 0.01  # the fields' order as before the range
    assert fitted.nll_context_range == pytest.approx([1.0, 4.0])  # the triples' NLL(c) run over linspace(1, 4)
    model, tokenizer = kvc.load_model(tiny_checkpoint)
    context, question = "The magic number is 42. The sky is green today. " * 6, "What is the magic number?"
    run = dict(max_new_tokens=2, stop_at_eos=False, progress=False, quality=0.8)
    nll = kvc.generate(model, tokenizer, context, question, calibration=cal.Calibration("keydiff", 0.0, -3.0), **run).extra["calibration"]
    assert nll["extrapolated"] is None
    for bounds, outside in (([nll["nll_context"] + 1, nll["nll_context"] + 2], True), ([nll["nll_context"] - 1, nll["nll_context"] + 1], False)):
        path = tmp_path / "keydiff.json"
        cal.Calibration("keydiff", alpha=0.0, beta=-3.0, nll_context_range=bounds).save(path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            chosen = kvc.generate(model, tokenizer, context, question, calibration=path, **run).extra["calibration"]
        said = [str(w.message) for w in caught if "outside the range the calibration was fitted on" in str(w.message)]
        assert chosen["extrapolated"] is outside and len(said) == outside, (bounds, said)
        assert chosen["compression_ratio"] == pytest.approx(nll["compression_ratio"])


def test_a_batch_with_a_calibration_runs_each_context_alone_at_its_own_ratio(tmp_path, tiny_checkpoint):
    import kvcompress as kvc

    path = tmp_path / "knorm.json"
    cal.Calibration("knorm", alpha=0.5, beta=-4.0).save(path)  # kappa depends on the context's NLL: a ratio per context
    model, tokenizer = kvc.load_model(tiny_checkpoint)
    contexts = ["The magic number is 42. The sky is green today. " * 6, "Seven blue birds sat on a fence; one flew off. " * 4]
    run = dict(calibration=path, quality=0.8, max_new_tokens=4, stop_at_eos=False, progress=False)
    batch = kvc.generate(model, tokenizer, contexts, "What is the magic number?", **run)
    for context, res in zip(contexts, batch):
        alone = kvc.generate(model, tokenizer, context, "What is the magic number?", **run)
        assert res.token_ids == alone.token_ids and res.extra["calibration"] == alone.extra["calibration"]
        assert res.method == "knorm" and res.extra["batch_run"] == "one_by_one" and res.extra["batch_size"] == 2
    assert batch[0].extra["calibration"]["compression_ratio"] != batch[1].extra["calibration"]["compression_ratio"]


def test_calibrate_refuses_settings_that_are_not_the_methods_and_methods_it_cannot_measure():
    """sink and window were taken by the shared prefill and recorded as the method's parameters, which no later run
    accepted; KVzap's and KVzip's scores need what a recorded prefill keeps no copy of: each is refused before any
    measurement (no model is touched)."""
    from kvcompress.integration.calibrate_model import calibrate

    sample = [("context", "question", "answer")]
    with pytest.raises(ValueError, match=r"method 'snapkv' has no parameter\(s\) \['sink', 'window'\]"):
        calibrate(None, None, sample, "snapkv", sink=2, window=8)
    with pytest.raises(ValueError, match="method 'kvzap' scores the context with the layers' hidden states"):
        calibrate(None, None, sample, "kvzap")
    with pytest.raises(ValueError, match="method 'adakv' scores the context with the layers' hidden states"):
        calibrate(None, None, sample, "adakv", scorer="kvzap")
    with pytest.raises(ValueError, match="asymmetry must be a number from 1 to 1e"):
        calibrate(None, None, sample, "snapkv", asymmetry=float("inf"))
    with pytest.raises(ValueError, match=r"retentions must be a list of fractions kept in \(0, 1\], e\.g\. \[0\.25, 0\.5\], got 0\.5"):
        calibrate(None, None, sample, "snapkv", retentions=0.5)
    with pytest.raises(ValueError, match=r"retentions must be a list of fractions .* got '0\.5'"):
        calibrate(None, None, sample, "snapkv", retentions="0.5")
    with pytest.raises(ValueError, match=r"samples must be a list of \(context, question, answer\) tuples or dicts, got NoneType"):
        calibrate(None, None, None, "snapkv")


def test_calibrate_refuses_a_retention_too_small_for_the_sink_and_window_before_measuring(tiny_checkpoint):
    """`kvcompress calibrate --method snapkv` failed after loading, on its default retention 0.1, advising a compression
    ratio and a context size the command has no flag for; the refusal names the retention that fits."""
    import re

    import kvcompress as kvc
    from kvcompress.integration.calibrate_model import _check_retentions_fit, calibrate

    model, tokenizer = kvc.load_model(str(tiny_checkpoint))
    samples = [("The river runs past the mill. " * 12, "Where does the river run?", "past the mill")]
    with pytest.raises(ValueError, match=r"^retentions: 0\.1 keeps too few of the \d+ context tokens of samples\[0\] for snapkv's exact "
                                         r"sink \(4\) and window \(64\): use retentions of at least [\d.]+, or longer contexts") as refused:
        calibrate(model, tokenizer, samples, "snapkv", retentions=[0.5, 0.1])
    least = float(re.search(r"at least ([\d.]+)", str(refused.value)).group(1))
    _check_retentions_fit(tokenizer, samples, "snapkv", [least, 0.5], {})  # the retention it names fits
