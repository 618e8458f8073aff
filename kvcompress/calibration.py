"""Context-calibrated compression, for any method that compresses a recorded prefill (not KVzip, KVzap or the default).

Chari & Van Durme, "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate
Leverage Scores", arXiv:2507.08143, Sec. 3.5; docs/design.md, "Context-calibrated compression".

For a method and a model, the NLL ratio y = NLL(t; q, c) / NLL(t; q, c~_r) of a known answer t
after keeping a fraction r of the context c is modelled as

    f(r) = (e^{kr} - 1) / (e^k - 1),   k = alpha·NLL(c) + beta,

(f(0) = 0, f(1) = 1) where NLL(c) is the model's token-averaged NLL of the context itself.
`fit` finds alpha, beta from (r, NLL(c), y) triples with an asymmetric squared loss (a curve
above the measured y would choose too small an r, so those residuals weigh `asymmetry` times
more); `Calibration.retention` inverts f for a quality budget gamma:
r* = ln(1 + gamma(e^k - 1)) / k, written as 1 + ln(gamma + (1 - gamma)e^{-k}) / k for k > 0 so
it never overflows; k -> 0 gives r* -> gamma. Compression ratios follow the kvpress convention of
the rest of the library: compression_ratio = 1 - r (fraction removed).

`calibrated_ratio` is the run-time step: one plain prefill for NLL(c), then r*. Measuring the
triples on a model through the compressed cache, and `kvc.calibrate` (measure + fit), live one
layer up in `integration.calibrate_model`; this module needs nothing from the model integration.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from .checks import as_count, as_real
from .methods.registry import build_method, method_names
from .saved_state import write_whole


# |k| below this is treated as 0 (f(r) = r); the error of doing so is below 1e-7.
_KAPPA_EPS = 1e-6


def retention_curve(r, kappa) -> torch.Tensor:
    """f(r) = (e^{kr} - 1)/(e^k - 1) elementwise (float64), overflow-free for any k (broadcasts r and k)."""
    r = torch.as_tensor(r, dtype=torch.float64)
    kappa = torch.as_tensor(kappa, dtype=torch.float64)
    kp, kn = kappa.clamp_min(_KAPPA_EPS), kappa.clamp_max(-_KAPPA_EPS)
    positive = torch.exp(kp * (r - 1)) * torch.expm1(-kp * r) / torch.expm1(-kp)
    negative = torch.expm1(kn * r) / torch.expm1(kn)
    return torch.where(kappa.abs() < _KAPPA_EPS, r, torch.where(kappa > 0, positive, negative))


def optimal_retention(kappa: float, quality: float) -> float:
    """Smallest r in (0, 1] with f(r) >= quality, in closed form (overflow-safe for large |k|)."""
    check_quality(quality)
    if quality == 1.0:  # only the full context has f = 1 (and log1p(-1) would be -inf for very negative k)
        return 1.0
    if abs(kappa) < _KAPPA_EPS:
        r = quality
    elif kappa > 0:
        r = 1.0 + math.log(quality + (1.0 - quality) * math.exp(-kappa)) / kappa
    else:
        r = math.log1p(quality * math.expm1(kappa)) / kappa
    return min(1.0, max(r, 0.0))


def check_quality(quality: float) -> None:
    if isinstance(quality, bool) or not isinstance(quality, (int, float)) or not (0.0 < quality <= 1.0):
        raise ValueError(f"quality (the NLL-ratio budget gamma) must be in (0, 1], got {quality!r}")


@dataclass
class Calibration:
    """A fitted curve for one method (and model): k = alpha·NLL(c) + beta."""

    method: str  # the registered method the curve was measured for
    alpha: float  # k's slope in the context's NLL
    beta: float  # k's intercept
    asymmetry: float = 4.0  # the weight the fit gave residuals where the curve promised more quality than measured
    model: str | None = None  # the model it was measured on (`kvcompress generate` refuses a file fitted on another)
    method_params: dict = field(default_factory=dict)  # the method's parameters in the measurement, applied with it
    n_triples: int = 0  # how many (retention, NLL(c), NLL ratio) triples the fit saw
    # the fit's weighted mean squared residual: a record of the fit, not compared (NaN, for a curve not fitted by `fit`,
    # equals nothing, not even a pickled copy of itself)
    loss: float = field(default=float("nan"), compare=False)
    # [lowest, highest] NLL(c) of the contexts the fit saw: a context outside it is an extrapolation (None: not recorded)
    nll_context_range: list[float] | None = None

    def __post_init__(self):
        if not isinstance(self.method, str) or self.method not in method_names():
            raise ValueError(f"method must be a registered method's name (one of {', '.join(method_names())}), got {self.method!r}")
        self.alpha = as_real("alpha", self.alpha, "the curve's slope in the context's NLL")
        self.beta = as_real("beta", self.beta, "the curve's intercept")
        self.asymmetry = as_asymmetry(self.asymmetry)
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model must be a model's name or None, got {self.model!r}")
        if not isinstance(self.method_params, dict):
            raise ValueError(f"method_params must be a dict of the method's parameters, got {self.method_params!r}")
        try:  # the parameters the curve was measured with are the method's own (an error here names the calibration, not a flag)
            build_method(self.method, **self.method_params)
        except ValueError as error:
            raise ValueError(f"method_params {self.method_params} are not {self.method!r}'s ({error})") from None
        self.n_triples = as_count("n_triples", self.n_triples, 0)
        if self.nll_context_range is not None:
            bounds = self.nll_context_range
            if not (isinstance(bounds, (list, tuple)) and len(bounds) == 2):
                raise ValueError(f"nll_context_range must be None or [lowest, highest] NLL(c), got {bounds!r}")
            low, high = (as_real("nll_context_range", value, "an NLL(c) the fit saw") for value in bounds)
            if low > high:
                raise ValueError(f"nll_context_range must be [lowest, highest] NLL(c), got {bounds!r}")
            self.nll_context_range = [low, high]
        if isinstance(self.loss, bool) or not isinstance(self.loss, numbers.Real):
            raise ValueError(f"loss must be a number, got {self.loss!r}")

    def kappa(self, nll_context: float) -> float:
        return self.alpha * float(nll_context) + self.beta

    def predict(self, retention, nll_context) -> torch.Tensor:
        """Predicted NLL ratio f(r) at retention(s) r for context NLL(s)."""
        return retention_curve(retention, self.alpha * torch.as_tensor(nll_context, dtype=torch.float64) + self.beta)

    def retention(self, nll_context: float, quality: float) -> float:
        """r*: the fraction of the context to keep so the predicted NLL ratio is >= quality."""
        return optimal_retention(self.kappa(nll_context), quality)

    def save(self, path: str | Path) -> None:
        write_whole(path, json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not a calibration file (a JSON object with method, alpha, beta)")
        missing = {"method", "alpha", "beta"} - set(data)
        unknown = set(data) - {f.name for f in fields(cls)}
        if missing or unknown:
            raise ValueError(f"{path}: not a calibration file (missing {sorted(missing)}, unknown {sorted(unknown)})")
        try:
            return cls(**data)
        except ValueError as err:
            raise ValueError(f"{path}: not a calibration file ({err})") from None


def load_calibration(calibration: Calibration | str | os.PathLike) -> Calibration:
    """`calibration` itself when it is a `Calibration`, else the one saved in the JSON file at that path
    (`Calibration.save`, `kvcompress calibrate --out`). Anything else, or a path that holds no such file, is a
    ValueError naming `calibration`, what it was and what is accepted."""
    if isinstance(calibration, Calibration):
        return calibration
    if not isinstance(calibration, (str, os.PathLike)):
        raise ValueError(f"calibration must be a kvcompress.calibration.Calibration or the path of the JSON file one was saved to, "
                         f"got a {type(calibration).__name__}: {calibration!r}")
    path = Path(calibration)
    saved = "`kvc.calibrate(...).save(path)` or `kvcompress calibrate --out FILE`"
    if path.is_dir():
        raise ValueError(f"calibration {str(path)!r} is a directory: pass the JSON file a calibration was saved to ({saved})")
    if not path.is_file():
        raise ValueError(f"calibration {str(path)!r} does not exist: write one with {saved}")
    try:
        return Calibration.load(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"calibration {str(path)!r} is not JSON text ({err}): pass the file a calibration was saved to ({saved})") from None
    except ValueError as err:
        raise ValueError(f"calibration {err}") from None


def choose_ratio(calibration: Calibration | str | os.PathLike, nll_context: float, quality: float) -> float:
    """compression_ratio (fraction removed, kvpress convention) = 1 - r* for a context of NLL `nll_context`;
    `calibration` as `load_calibration` takes it."""
    return max(0.0, 1.0 - load_calibration(calibration).retention(nll_context, quality))


MAX_ASYMMETRY = 1e6  # the fit weighs residuals by its square root: past a thousandfold the other residuals hardly count


def as_asymmetry(value) -> float:
    """The fit's `asymmetry` as a Python float: a number from 1 to `MAX_ASYMMETRY` (a float beyond it overflowed the fit)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 1.0 <= value <= MAX_ASYMMETRY:
        raise ValueError(f"asymmetry must be a number from 1 to {MAX_ASYMMETRY:g} (the weight of residuals where the curve promises "
                         f"more quality than measured), got {value!r}")
    return float(value)


def fit(triples, method: str, asymmetry: float = 4.0, model: str | None = None, method_params: dict | None = None) -> Calibration:
    """Fit alpha, beta to triples (dicts with "retention", "nll_context", "nll_ratio", or 3-tuples in that order).

    Loss: mean of w·(f(r) - y)^2 with w = asymmetry where f(r) > y (the curve promises more quality
    than measured, i.e. would over-compress) and 1 elsewhere. Levenberg-Marquardt in float64 from
    a few starting points (k = 0, -3, +3); the best one is kept.
    """
    asymmetry = as_asymmetry(asymmetry)
    rows = [(t["retention"], t["nll_context"], t["nll_ratio"]) if isinstance(t, dict) else tuple(t) for t in triples]
    if len(rows) < 2:
        raise ValueError(f"fit needs at least 2 triples, got {len(rows)}")
    r, nll, y = torch.tensor(rows, dtype=torch.float64).T
    if not (torch.isfinite(r).all() and torch.isfinite(nll).all() and torch.isfinite(y).all()):
        raise ValueError("triples contain NaN or infinite values")
    if ((r <= 0) | (r > 1)).any():
        raise ValueError("triples' retention must be in (0, 1]")

    def residuals(params: torch.Tensor) -> torch.Tensor:
        """sqrt(w)·(f(r) - y), so the loss is their mean square."""
        err = retention_curve(r, params[0] * nll + params[1]) - y
        return torch.where(err > 0, math.sqrt(asymmetry), 1.0) * err

    best = None
    for beta0 in (0.0, -3.0, 3.0):
        params = levenberg_marquardt(residuals, torch.tensor([0.0, beta0], dtype=torch.float64))
        loss = float(residuals(params).square().mean())
        if math.isfinite(loss) and (best is None or loss < best[0]):
            best = (loss, params)
    loss, (alpha, beta) = best[0], best[1].tolist()
    return Calibration(method, alpha, beta, asymmetry, model, dict(method_params or {}), len(rows), loss,
                       nll_context_range=[float(nll.min()), float(nll.max())])


def levenberg_marquardt(residuals, params: torch.Tensor, iterations: int = 200, h: float = 1e-6) -> torch.Tensor:
    """Minimise mean(residuals(params)^2) over a few float64 parameters (central-difference Jacobian)."""
    damping = 1e-3
    res = residuals(params)
    eye = torch.eye(params.numel(), dtype=torch.float64)
    for _ in range(iterations):
        jac = torch.stack([(residuals(params + h * e) - residuals(params - h * e)) / (2 * h) for e in eye], 1)
        jtj = jac.T @ jac
        step = torch.linalg.solve(jtj + damping * torch.diag(jtj.diagonal()) + 1e-12 * eye, -jac.T @ res)
        trial = residuals(params + step)
        if torch.isfinite(trial).all() and trial.square().sum() < res.square().sum():
            params, res, damping = params + step, trial, damping / 3
            if step.abs().max() < 1e-10:
                break
        else:
            damping *= 4
            if damping > 1e12:
                break
    return params


def mean_nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Token-averaged NLL of targets [1, L] under logits [1, L, V] (logits[i] predicts targets[i]), in float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return float(-logp.gather(-1, targets[..., None]).mean())


@torch.inference_mode()
def context_nll(model, context_ids: torch.Tensor) -> float:
    """NLL(c): the model's token-averaged NLL of the context itself (one plain forward)."""
    return mean_nll(model(context_ids).logits[:, :-1], context_ids[:, 1:])


@torch.inference_mode()
def calibrated_ratio(model, context_ids: torch.Tensor, calibration: Calibration | str | Path, quality: float) -> dict:
    """Run-time choice for one context: one plain prefill gives NLL(c), the curve gives r*.

    Returns {"nll_context", "retention", "compression_ratio", "extrapolated"}; pass compression_ratio to generate.
    extrapolated: NLL(c) lies outside the range of the contexts the curve was fitted on (`Calibration.nll_context_range`),
    so the choice rests on the curve's form alone; a UserWarning says so (None: the file records no range).
    """
    calibration = load_calibration(calibration)
    nll = context_nll(model, context_ids)
    ratio = choose_ratio(calibration, nll, quality)
    bounds = calibration.nll_context_range
    extrapolated = None if bounds is None else not bounds[0] <= nll <= bounds[1]
    if extrapolated:
        warnings.warn(f"the context's NLL {nll:.3f} lies outside the range the calibration was fitted on ({bounds[0]:.3f} to "
                      f"{bounds[1]:.3f}), so its compression ratio {ratio:.3f} extrapolates the curve; calibrate on texts like "
                      "this one (kvcompress calibrate) for a choice it measured", UserWarning, stacklevel=3)  # the caller of the inference-mode wrapper
    return {"nll_context": nll, "retention": 1.0 - ratio, "compression_ratio": ratio, "extrapolated": extrapolated}
