"""End-to-end prefill cost: `generate` prefill with compression over a plain transformers prefill of the same context.

The plain prefill is `generate_ids(method=None)`: transformers' DynamicCache and the model's own
SDPA attention. Each method runs the same prefill through kvcompress's cache in prefill mode, every
layer compressed once at the end of its forward (the method's default sink and window). Both are
timed by `GenerationResult.prefill_seconds` (the context's forward, compression included);
`compress_seconds` (the compression calls alone) gives each method's compression share of its own
prefill, and the overhead that share implies, 1 / (1 - share): both come from the same runs, so a
load change between runs cancels. A method that scores with the attention mass (H2O) gets it from
the prefill's fused kernel (`causal_attention_with_mass`), whose extra time over SDPA is measured
apart on the context's real q/k/v and counted as compression too.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.nn.functional as F

from .common import context_ids, time_calls
from .config import BenchConfig


def prefill_seconds(model, ids: torch.Tensor, method: str | None, ratio: float) -> tuple[float, float]:
    """(seconds of the context's prefill, of which compression) through `generate_ids` (method None: plain transformers)."""
    from ...integration import generate_ids

    options = {"compression_ratio": ratio} if method is not None else {}
    res = generate_ids(model, ids, None, method=method, max_new_tokens=1, stop_at_eos=False, **options)
    return res.prefill_seconds, res.compress_seconds


def fused_attention_cost(model, ids: torch.Tensor, repeats: int) -> dict[str, float]:
    """Seconds of SDPA's causal pass and of `causal_attention_with_mass` on the context's q/k/v, each summed over
    the layers of per-layer minima over `repeats` interleaved calls, and their difference (`fused_extra_s`)."""
    from ...integration.attention import causal_attention_with_mass
    from ...model_support import attention_scales
    from ..capture import capture_qkv

    scales = attention_scales(model)
    sdpa = fused = 0.0
    for layer, (q, k, v) in capture_qkv(model, ids).items():
        pairs = [(time_calls(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scales[layer], enable_gqa=True), 1)[0],
                  time_calls(lambda: causal_attention_with_mass(q, k, v, scales[layer]), 1)[0]) for _ in range(repeats)]
        sdpa += min(p[0] for p in pairs)
        fused += min(p[1] for p in pairs)
    return {"sdpa_s": sdpa, "fused_s": fused, "fused_extra_s": fused - sdpa}


def _rows(times: dict[str, list[float]], compress: dict[str, list[float]], paired: dict[str, list[float]], tokens: int, ratio: float,
          kernel: dict[str, float], mass_methods: set[str]) -> list[dict]:
    """One row per method measured so far (and the plain prefill): min/median seconds, their ratios to the plain
    prefill's, the median ratio to the plain prefill run just before (`paired`), the compression share of the
    method's own prefill and the overhead it implies."""
    plain_min, plain_median = min(times["plain"]), statistics.median(times["plain"])
    rows = []
    for method, t in times.items():
        if not t:
            continue
        compress_min = min(compress[method]) if compress[method] else 0.0
        extra = kernel["fused_extra_s"] if method in mass_methods else 0.0
        rows.append({
            "method": method, "tokens": tokens, "ratio_removed": ratio if method != "plain" else 0.0, "runs": len(t),
            "min_s": min(t), "median_s": statistics.median(t), "overhead_min": min(t) / plain_min,
            "overhead_median": statistics.median(t) / plain_median,
            "overhead_paired": statistics.median(paired[method]) if method != "plain" else 1.0, "compress_min_s": compress_min, "fused_extra_s": extra,
            "compress_share": (compress_min + extra) / min(t), "implied_overhead": min(t) / (min(t) - compress_min - extra),
        })
    return rows


def prefill_rows(model, tokenizer, config: BenchConfig, log: Callable[[str], None] = print,
                 on_rows: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Rows {method, tokens, ratio_removed, runs, min_s, median_s, overhead_min, overhead_median, overhead_paired,
    compress_min_s, fused_extra_s, compress_share, implied_overhead}, the plain prefill first, for config's methods.

    One context of real prose of config.prefill_tokens tokens, prefill_ratio of it removed.
    prefill_repeats rounds go round all methods in turn, with a plain prefill before every
    plain_every methods (kernel_repeats calls of the attention-mass kernel), so slow phases of a
    shared machine hit both; a method's ratios are to the min (median) of every plain prefill of
    the run, and (overhead_paired) the median over its runs of each run ÷ the plain prefill run just
    before it: a min over the many plain runs sits lower than a min over a method's few, which
    `overhead_min` charges to the method, and paired runs share the machine's load. on_rows gets the
    rows so far after each prefill.
    """
    from ...methods.registry import build_method

    methods, ratio = config.methods, config.prefill_ratio
    ids = context_ids(tokenizer, config.prefill_tokens)
    prefill_seconds(model, ids[:, :256], None, ratio)  # warm-up: first calls pay allocation and dispatch setup
    mass_methods = {m for m in methods if build_method(m).requirements.needs("attention_mass")}
    kernel = {"sdpa_s": 0.0, "fused_s": 0.0, "fused_extra_s": 0.0}
    if mass_methods:
        kernel = fused_attention_cost(model, ids, config.kernel_repeats)
        log(f"attention over the layers: SDPA {kernel['sdpa_s']:.2f}s, fused with mass {kernel['fused_s']:.2f}s")
    times: dict[str, list[float]] = {"plain": [], **{m: [] for m in methods}}
    compress: dict[str, list[float]] = {"plain": [], **{m: [] for m in methods}}
    paired: dict[str, list[float]] = {m: [] for m in methods}
    rows: list[dict] = []
    for r in range(config.prefill_repeats):
        for i, method in enumerate(methods):
            if i % config.plain_every == 0:
                seconds, _ = prefill_seconds(model, ids, None, ratio)
                times["plain"].append(seconds)
                log(f"prefill repeat {r}: plain {seconds:.2f}s")
            seconds, compressing = prefill_seconds(model, ids, method, ratio)
            times[method].append(seconds)
            compress[method].append(compressing)
            paired[method].append(seconds / times["plain"][-1])
            log(f"prefill repeat {r}: {method} {seconds:.2f}s (compression {compressing:.2f}s)")
            rows = _rows(times, compress, paired, ids.shape[1], ratio, kernel, mass_methods)
            if on_rows is not None:
                on_rows(rows)
    return rows
