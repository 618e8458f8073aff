"""Context-calibrated compression (Compactor seed 002, Sec. 3.5; DESIGN.md §4), for any method.

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

`make_triples` measures the triples on a model through the compressed cache (context compressed
in prefill mode, question and answer appended exactly: the query-agnostic setting), and
`calibrated_ratio` is the run-time step: one plain prefill for NLL(c), then r*.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


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

    method: str
    alpha: float
    beta: float
    asymmetry: float = 4.0
    model: str | None = None
    method_params: dict = field(default_factory=dict)
    n_triples: int = 0
    loss: float = float("nan")

    def kappa(self, nll_context: float) -> float:
        return self.alpha * float(nll_context) + self.beta

    def predict(self, retention, nll_context) -> torch.Tensor:
        """Predicted NLL ratio f(r) at retention(s) r for context NLL(s)."""
        return retention_curve(retention, self.alpha * torch.as_tensor(nll_context, dtype=torch.float64) + self.beta)

    def retention(self, nll_context: float, quality: float) -> float:
        """r*: the fraction of the context to keep so the predicted NLL ratio is >= quality."""
        return optimal_retention(self.kappa(nll_context), quality)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        data = json.loads(Path(path).read_text())
        missing = {"method", "alpha", "beta"} - set(data)
        if missing:
            raise ValueError(f"{path}: not a calibration file (missing {sorted(missing)})")
        return cls(**data)


def choose_ratio(calibration: Calibration | str | Path, nll_context: float, quality: float) -> float:
    """compression_ratio (fraction removed, kvpress convention) = 1 - r* for a context of NLL `nll_context`."""
    if not isinstance(calibration, Calibration):
        calibration = Calibration.load(calibration)
    return max(0.0, 1.0 - calibration.retention(nll_context, quality))


def fit(triples, method: str, asymmetry: float = 4.0, model: str | None = None, method_params: dict | None = None) -> Calibration:
    """Fit alpha, beta to triples (dicts with "retention", "nll_context", "nll_ratio", or 3-tuples in that order).

    Loss: mean of w·(f(r) - y)^2 with w = asymmetry where f(r) > y (the curve promises more quality
    than measured, i.e. would over-compress) and 1 elsewhere. Levenberg-Marquardt in float64 from
    a few starting points (k = 0, -3, +3); the best one is kept.
    """
    if not isinstance(asymmetry, (int, float)) or not asymmetry >= 1.0:
        raise ValueError(f"asymmetry must be >= 1 (weight of over-compressing residuals), got {asymmetry!r}")
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
    return Calibration(method, alpha, beta, float(asymmetry), model, dict(method_params or {}), len(rows), loss)


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


def answer_nll(model, cache, continuation_ids: torch.Tensor, answer_len: int) -> float:
    """NLL(t; q, c~): continuation_ids [1, m] = question then answer (its last `answer_len` tokens), after the cache's context."""
    from .eval.prefill_replay import continuation_logits

    m = continuation_ids.shape[1]
    logits = continuation_logits(model, cache, continuation_ids)
    return mean_nll(logits[:, m - answer_len - 1 : m - 1], continuation_ids[:, m - answer_len :])


@torch.inference_mode()
def context_nll(model, context_ids: torch.Tensor) -> float:
    """NLL(c): the model's token-averaged NLL of the context itself (one plain forward)."""
    return mean_nll(model(context_ids).logits[:, :-1], context_ids[:, 1:])


def encode_sample(tokenizer, context: str, question: str, answer: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(context_ids [1,n], question+answer ids [1,m], answer length) with the chat prompt of `build_prompt`."""
    from .integration.model import build_prompt

    context_ids, question_ids = build_prompt(tokenizer, context, question)
    answer_ids = torch.tensor([tokenizer.encode(answer, add_special_tokens=False)], dtype=torch.long)
    if answer_ids.shape[1] == 0:
        raise ValueError("the known continuation (answer) is empty")
    return context_ids, torch.cat([question_ids, answer_ids], 1), answer_ids.shape[1]


def make_triples(model, tokenizer, samples, method: str, retentions, seed: int = 0, progress=None, **method_params) -> list[dict]:
    """(retention, NLL(c), NLL ratio) for every sample x retention.

    samples: (context, question, answer) tuples or dicts with those keys (plus an optional "task").
    Per sample: one forward for NLL(c), one shared prefill (`eval.prefill_replay`), then per
    retention the context compressed in prefill mode and question + answer appended exactly.
    """
    from .eval.prefill_replay import SharedPrefill

    triples = []
    for i, sample in enumerate(samples):
        if isinstance(sample, dict):
            context, question, answer, task = sample["context"], sample["question"], sample["answer"], sample.get("task")
        else:
            (context, question, answer), task = sample, None
        context_ids, continuation_ids, answer_len = encode_sample(tokenizer, context, question, answer)
        nll_context = context_nll(model, context_ids)
        shared = SharedPrefill(model, context_ids)
        nll_full = answer_nll(model, shared.cache(None), continuation_ids, answer_len)
        for r in retentions:
            cache = shared.cache(method, 1.0 - r, seed=seed, **method_params)
            nll_r = answer_nll(model, cache, continuation_ids, answer_len)
            triples.append({
                "sample": i, "task": task, "retention": float(r), "nll_context": nll_context,
                "nll_full": nll_full, "nll_compressed": nll_r, "nll_ratio": nll_full / nll_r,
            })
            if progress is not None:
                progress(triples[-1])
    return triples


@torch.inference_mode()
def calibrated_ratio(model, context_ids: torch.Tensor, calibration: Calibration | str | Path, quality: float) -> dict:
    """Run-time choice for one context: one plain prefill gives NLL(c), the curve gives r*.

    Returns {"nll_context", "retention", "compression_ratio"}; pass compression_ratio to generate.
    """
    nll = context_nll(model, context_ids)
    ratio = choose_ratio(calibration, nll, quality)
    return {"nll_context": nll, "retention": 1.0 - ratio, "compression_ratio": ratio}


def offline_samples(tokenizer, task_names, per_task: int, tokens: int, first_seed: int = 0) -> list[dict]:
    """Calibration samples from the offline task set: {"task", "context", "question", "answer"} (answers joined by ", ")."""
    from .eval.tasks import generate_sample

    out = []
    for task in task_names:
        for seed in range(first_seed, first_seed + per_task):
            s = generate_sample(task, target_tokens=tokens, seed=seed, tokenizer=tokenizer)
            out.append({"task": task, "seed": seed, "context": s.context, "question": s.question, "answer": ", ".join(s.answers)})
    return out


def add_cli(subparsers) -> None:
    """`kvcompress calibrate`: measure triples for a method on a model, fit the curve, save the JSON file."""
    from .cli import add_device_args, add_model_arg

    p = subparsers.add_parser(
        "calibrate", help="fit the context-calibration curve of a method (Compactor seed Sec. 3.5)",
        description="Measure (retention, NLL(context), NLL ratio of the known answer) triples on offline tasks, "
        "fit k = alpha*NLL(c) + beta of f(r) = (e^{kr}-1)/(e^k-1) with an asymmetric loss, and save the fit as JSON.",
    )
    p.add_argument("--method", default="compactor", help="registered method name (default compactor)")
    p.add_argument("--tasks", default="niah_single,niah_multikey,variable_tracking,common_words", help="comma-separated offline task names")
    p.add_argument("--samples", type=int, default=2, help="samples per task (default 2)")
    p.add_argument("--tokens", type=int, default=512, help="context length target in tokens (default 512)")
    p.add_argument("--retentions", default="0.1,0.25,0.5,0.75,0.9", help="fractions of the context kept (default 0.1,...,0.9)")
    p.add_argument("--asymmetry", type=float, default=4.0, help="weight of residuals where the curve over-promises (default 4)")
    p.add_argument("--seed", type=int, default=0, help="first task seed and the method's seed")
    p.add_argument("--triples", type=Path, default=None, help="also write the measured triples to this JSON file")
    p.add_argument("--out", type=Path, required=True, help="where to write the calibration JSON")
    add_model_arg(p)
    add_device_args(p)
    p.set_defaults(func=_run_cli)


def _run_cli(args) -> int:
    from .integration import load_model

    retentions = [float(x) for x in args.retentions.split(",")]
    if any(not 0 < r <= 1 for r in retentions):
        raise ValueError(f"--retentions must lie in (0, 1], got {args.retentions}")
    if args.samples < 1 or args.tokens < 16:
        raise ValueError("--samples must be >= 1 and --tokens >= 16")
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    samples = offline_samples(tokenizer, args.tasks.split(","), args.samples, args.tokens, args.seed)
    triples = make_triples(
        model, tokenizer, samples, args.method, retentions, seed=args.seed,
        progress=lambda t: print(f"sample {t['sample']} r={t['retention']:.2f}: NLL(c)={t['nll_context']:.3f} ratio={t['nll_ratio']:.3f}", flush=True),
    )
    if args.triples is not None:
        args.triples.write_text(json.dumps(triples, indent=1) + "\n")
    calibration = fit(triples, args.method, args.asymmetry, model=args.model or "SmolLM2-135M-Instruct")
    calibration.save(args.out)
    print(f"alpha={calibration.alpha:.4f} beta={calibration.beta:.4f} (loss {calibration.loss:.4g}, {calibration.n_triples} triples) -> {args.out}")
    return 0
