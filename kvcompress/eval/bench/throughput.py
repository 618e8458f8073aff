"""Streaming throughput: tokens a fresh `kvc.stream` absorbs per second, each method against KeyDiff's block prompt processing."""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch

from .common import Shape, check_positive, synthetic_layer, time_calls
from .overhead import kept_budget, natively_streaming, streamed

REFERENCE = "keydiff"


def throughput_rows(
    methods: Sequence[str],
    shape: Shape,
    tokens: int = 8192,
    block: int = 128,
    repeats: int = 3,
    seed: int = 0,
    log: Callable[[str], None] = print,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[dict]:
    """Rows {shape, method, stream (native|block-wise), tokens, budget, block, runs, min_s, median_s, tokens_per_s, over_keydiff}, KeyDiff first.

    Synthetic tensors of `shape`: `tokens` tokens fed in blocks of `block` (each block with its own
    queries and pre-RoPE keys), half of them kept (no sink or window), then compacted to the budget
    (`streamed`). tokens_per_s is tokens over the min of `repeats` runs; methods take turns within
    each repeat (in reverse every other repeat), so load changes of a shared machine hit all of them. KeyDiff is always measured.
    """
    check_positive("tokens", tokens, 2)
    check_positive("block", block)
    check_positive("repeats", repeats)
    order = [REFERENCE, *[m for m in methods if m != REFERENCE]]
    layer = synthetic_layer(shape, tokens, torch.Generator().manual_seed(seed), dtype, device)
    times: dict[str, list[float]] = {m: [] for m in order}
    for i in range(repeats):
        for method in order if i % 2 == 0 else order[::-1]:  # every other repeat reversed: no method always runs warm
            times[method] += time_calls(streamed(method, layer, 0.5, block, seed), 1, device=device)
            log(f"throughput {shape.name}: {method} {tokens / times[method][-1]:.0f} tokens/s")
    reference = tokens / min(times[REFERENCE])
    return [{"shape": shape.name, "method": m, "stream": "native" if natively_streaming(m) else "block-wise", "tokens": tokens,
             "budget": kept_budget(tokens, 0.5), "block": block, "runs": len(t), "min_s": min(t), "median_s": statistics.median(t),
             "tokens_per_s": tokens / min(t), "over_keydiff": tokens / min(t) / reference} for m, t in times.items()]
