"""`kvc.calibrate`: measure (retention, NLL(c), NLL ratio) triples on a model and fit the curve of `kvcompress.calibration`.

Per sample: one forward for NLL(c), one shared prefill (`integration.prefill.SharedPrefill`),
then per retention the context compressed in prefill mode and question + answer appended exactly
(the query-agnostic setting of Sec. 3.5 of "Compactor: Calibrated Query-Agnostic KV Cache
Compression with Approximate Leverage Scores", arXiv:2507.08143).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch

from ..calibration import Calibration, as_asymmetry, context_nll, fit, mean_nll
from ..methods.registry import build_method
from ..model_support import model_lock
from ..options import CompressionOptions
from ..names import CALIBRATION_RETENTIONS as DEFAULT_RETENTIONS
from .model import build_prompt
from .prefill import SharedPrefill, continuation_logits


def answer_nll(model, cache, continuation_ids: torch.Tensor, answer_len: int) -> float:
    """NLL(t; q, c~): continuation_ids [1, m] = question then answer (its last `answer_len` tokens), after the cache's context."""
    m = continuation_ids.shape[1]
    logits = continuation_logits(model, cache, continuation_ids)
    return mean_nll(logits[:, m - answer_len - 1 : m - 1], continuation_ids[:, m - answer_len :])


def encode_sample(tokenizer, context: str, question: str, answer: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(context_ids [1,n], question+answer ids [1,m], answer length) with the chat prompt of `build_prompt`."""
    context_ids, question_ids = build_prompt(tokenizer, context, question)
    answer_ids = torch.tensor([tokenizer.encode(answer, add_special_tokens=False)], dtype=torch.long)
    if answer_ids.shape[1] == 0:
        raise ValueError("the known continuation (answer) is empty")
    return context_ids, torch.cat([question_ids, answer_ids], 1), answer_ids.shape[1]


def make_triples(model, tokenizer, samples, method: str, retentions, seed: int = 0, progress=None, **method_params) -> list[dict]:
    """(retention, NLL(c), NLL ratio) for every sample x retention.

    samples: (context, question, answer) tuples or dicts with those keys (plus an optional "task").
    """
    triples = []
    for i, sample in enumerate(samples):
        context, question, answer, task = _unpack(sample, i)
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


def _check_retentions_fit(tokenizer, samples, method: str, retentions, method_params: dict) -> None:
    """Before any measurement: every retention must leave each sample's context room beyond the method's exact sink and
    window (the budget `CompressionOptions.token_budget_for` resolves), else a ValueError naming the retention, the
    sample and the smallest retention that fits (the budget's own advice speaks of ratios and sizes calibrate sets)."""
    for i, sample in enumerate(samples):
        n = encode_sample(tokenizer, *_unpack(sample, i)[:3])[0].shape[1]
        for r in retentions:
            options = CompressionOptions(method=method, method_params=method_params, compression_ratio=1.0 - r)
            try:
                options.token_budget_for(n)
            except ValueError:
                least = math.ceil((options.sink + options.window + 1) / n * 100) / 100  # a hundredth at or above what fits
                raise ValueError(f"retentions: {r} keeps too few of the {n} context tokens of samples[{i}] for {method}'s exact sink "
                                 f"({options.sink}) and window ({options.window}): use retentions of at least {least:g}, or longer "
                                 "contexts (the command line's --tokens)") from None


def _unpack(sample, i: int) -> tuple[str, str, str, str | None]:
    """(context, question, answer, task or None) of a sample: a dict with those keys or a 3-tuple of strings."""
    if isinstance(sample, dict) and {"context", "question", "answer"} <= set(sample):
        context, question, answer, task = sample["context"], sample["question"], sample["answer"], sample.get("task")
    elif isinstance(sample, (tuple, list)) and len(sample) == 3:
        (context, question, answer), task = sample, None
    else:
        raise ValueError(f"samples[{i}] must be (context, question, answer) or a dict with those keys, got {type(sample).__name__}")
    if not all(isinstance(x, str) for x in (context, question, answer)):
        raise ValueError(f"samples[{i}]: context, question and answer must be strings")
    return context, question, answer, task


def check_calibratable(method: str, **method_params) -> None:
    """A ValueError unless `method` with `method_params` (its own parameters: not sink, window or other settings) can
    be calibrated: it compresses the recorded prefill every retention shares, so a method scored by a reconstruction
    forward (KVzip) or by the layers' hidden states (KVzap, the default) cannot."""
    needs = build_method(method, **method_params).requirements
    source = "its reconstruction forward" if needs.needs("reconstruction") else "the layers' hidden states"
    if needs.needs("hidden_states") or needs.needs("reconstruction"):
        raise ValueError(f"method {method!r} scores the context with {source}, which the recorded prefill calibration "
                         "compresses does not keep: calibrate another method")


def as_retentions(retentions) -> list[float]:
    """The fractions of the context kept that a calibration measures: a list of different numbers in (0, 1]."""
    if isinstance(retentions, (str, bytes)) or not isinstance(retentions, Iterable):
        raise ValueError(f"retentions must be a list of fractions kept in (0, 1], e.g. [0.25, 0.5], got {retentions!r}")
    retentions = list(retentions)
    bad = [r for r in retentions if isinstance(r, bool) or not isinstance(r, (int, float)) or not (0 < r <= 1) or math.isnan(r)]
    if not retentions or bad:
        raise ValueError(f"retentions must be fractions kept in (0, 1], got {retentions!r}")
    repeated = sorted({r for r in retentions if retentions.count(r) > 1})
    if repeated:  # the same measurement twice adds no point to the fit
        raise ValueError(f"retentions must be different fractions, got {repeated} more than once in {retentions!r}")
    return retentions


def calibrate(
    model,
    tokenizer,
    samples: Iterable,
    method: str = "compactor",
    retentions: Sequence[float] = DEFAULT_RETENTIONS,
    asymmetry: float = 4.0,
    seed: int = 0,
    model_name: str | None = None,
    progress: Callable[[dict], None] | None = None,
    **method_params,
) -> Calibration:
    """Measure triples for `method` on `model` over `samples` and fit k = alpha·NLL(c) + beta.

    samples: (context, question, answer) tuples or dicts with those keys (offline ones:
    `kvcompress.eval.calibration_samples.offline_samples`). retentions: fractions of the context
    kept, each in (0, 1]. method_params: the method's own parameters (recorded with the curve); a method scored
    by a reconstruction forward (KVzip) or by the layers' hidden states (KVzap, the default) cannot be calibrated:
    the recorded prefill every retention compresses keeps neither. progress(triple) is called after each measured triple. Save the result
    with `.save(path)` and pass it (or the path) to `generate(quality=..., calibration=...)`.
    """
    check_calibratable(method, **method_params)
    as_asymmetry(asymmetry)  # before the measurements, not after
    if isinstance(samples, (str, bytes, dict)) or not isinstance(samples, Iterable):
        raise ValueError(f"samples must be a list of (context, question, answer) tuples or dicts, got {type(samples).__name__}")
    retentions = as_retentions(retentions)
    samples = list(samples)
    if not samples:
        raise ValueError("samples must hold at least one (context, question, answer); got none")
    for i, sample in enumerate(samples):
        _unpack(sample, i)
    _check_retentions_fit(tokenizer, samples, method, retentions, method_params)
    with model_lock(model):  # its forwards switch the model's attention: kvcompress calls of other threads wait
        triples = make_triples(model, tokenizer, samples, method, retentions, seed=seed, progress=progress, **method_params)
    return fit(triples, method, asymmetry, model=model_name, method_params=method_params)
