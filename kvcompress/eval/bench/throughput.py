"""Streaming throughput: tokens a fresh `kvc.stream` absorbs per second, each method against KeyDiff's block prompt processing."""

from __future__ import annotations

import statistics
from typing import Callable

import torch

from .common import synthetic_layer, time_calls
from .config import BenchConfig
from .overhead import has_stream, kept_budget, natively_streaming, streamed, unfit_reason

REFERENCE = "keydiff"


def throughput_rows(config: BenchConfig, log: Callable[[str], None] = print) -> list[dict]:
    """Rows {shape, method, stream (native|block-wise|none), tokens, budget, block, runs, min_s, median_s, tokens_per_s, over_keydiff}, KeyDiff first.

    Synthetic tensors of config.throughput_shape: throughput_tokens tokens fed in blocks of `block`
    (each block with its own queries and pre-RoPE keys), half of them kept (no sink or window), then
    compacted (`streamed`). tokens_per_s is tokens over the min of throughput_repeats runs; methods
    take turns within each repeat (in reverse every other repeat), so load changes of a shared
    machine hit all of them. KeyDiff is always measured. A method with no stream (KVzip) or one that cannot run on the
    shape (`unfit_reason`) gets a row with `skipped`, the reason, and no times.
    """
    shape, tokens, block, seed = config.throughput_shape, config.throughput_tokens, config.block, config.seed
    # every method but the reference -> why it is not measured, or None
    reasons = {m: unfit_reason(m, shape) if has_stream(m) else "it has no stream (mode 'prefill' only)"
               for m in config.methods if m != REFERENCE}
    for method, reason in reasons.items():
        if reason is not None:
            log(f"throughput {shape.name}: {method} not measured: {reason}")
    order = [REFERENCE, *[m for m, reason in reasons.items() if reason is None]]
    layer = synthetic_layer(shape, tokens, torch.Generator().manual_seed(seed), config.dtype, config.device)
    times: dict[str, list[float]] = {m: [] for m in order}
    for i in range(config.throughput_repeats):
        for method in order if i % 2 == 0 else order[::-1]:  # every other repeat reversed: no method always runs warm
            times[method] += time_calls(streamed(method, layer, 0.5, block, seed), 1, device=config.device)
            log(f"throughput {shape.name}: {method} {tokens / times[method][-1]:.0f} tokens/s")
    reference = tokens / min(times[REFERENCE])

    def row(method: str) -> dict:
        stream = "native" if natively_streaming(method) else "block-wise" if has_stream(method) else "none"
        common = {"shape": shape.name, "method": method, "stream": stream, "tokens": tokens, "budget": kept_budget(tokens, 0.5),
                  "block": block}
        if method not in times:
            return {**common, "skipped": reasons[method]}
        t = times[method]
        return {**common, "runs": len(t), "min_s": min(t), "median_s": statistics.median(t), "tokens_per_s": tokens / min(t),
                "over_keydiff": tokens / min(t) / reference}

    return [row(m) for m in [REFERENCE, *reasons]]
