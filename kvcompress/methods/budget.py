"""Budget arithmetic: the middle budget from a budget or a compression ratio, sink/window and stream slack checks.

Below `methods.base`, which imports it: a method reaches it only as a `Streaming` value (no import of `base`).
"""

from __future__ import annotations

import math
import numbers
from typing import Protocol

import torch

from ..checks import as_count, as_fraction


class Streaming(Protocol):
    """What the stream budget checks read of a method (a `methods.base.Method`): its name and its stream factory."""

    name: str

    def new_stream(self, budget: int, generator: torch.Generator) -> object: ...


# Default re-compression slack of block-wise streams (fraction of the budget held beyond it before
# re-compressing). Each token then takes part in about 1 + 1/slack re-compressions; time and peak
# memory against it: docs/bench.md, "Streams with amortised re-compression".
DEFAULT_SLACK = 0.5


def check_slack(slack) -> float:
    """The re-compression slack of a block-wise stream: a finite number >= 0, as a Python float."""
    if isinstance(slack, bool) or not isinstance(slack, numbers.Real) or not math.isfinite(slack) or slack < 0:
        raise ValueError(
            f"slack must be a finite number >= 0 (extra slots a block-wise stream holds before re-compressing, "
            f"as a fraction of budget; 0 re-compresses after every block), got {slack!r}"
        )
    return float(slack)


def _smallest_context(kept_needed: int, compression_ratio: float) -> int:
    """Smallest n with ceil((1 - ratio)·n) >= kept_needed."""
    n = max(1, math.ceil(kept_needed / (1.0 - compression_ratio)) - 1)
    while math.ceil((1.0 - compression_ratio) * n - 1e-9) < kept_needed:
        n += 1
    return n


def smallest_stream_budget(method: Streaming) -> int:
    """The smallest budget the method's streaming state accepts (1 for most; BalanceKV and Express need more)."""
    for budget in range(1, 65):
        try:
            method.new_stream(budget, torch.Generator())
        except ValueError:
            continue
        return budget
    raise ValueError(f"method {method.name!r} accepts no streaming budget up to 64")


def resolve_budget(
    n: int,
    budget: int | None,
    compression_ratio: float | None,
    sink: int,
    window: int,
    method: Streaming | None = None,
    streaming: bool = False,
) -> int:
    """Middle budget (slots per head, sink and window not counted) from exactly one of budget / ratio.

    compression_ratio is the fraction of all n tokens removed (kvpress convention): the layer keeps
    ceil((1 - ratio) * n) tokens, of which sink + window are exact, the rest is the middle budget.
    A ratio that would remove tokens but leaves no room beyond sink + window is an error naming
    the largest ratio and the smallest context that work (never a silent "keep everything").
    With `method` and streaming=True (chunked/decode generation), a middle budget below what the
    method's stream accepts is an error that says where the budget came from.
    """
    if (budget is None) == (compression_ratio is None):
        raise ValueError(
            f"pass exactly one of budget (tokens kept per head) or compression_ratio (fraction removed); got budget={budget!r}, compression_ratio={compression_ratio!r}"
        )
    if budget is not None:
        middle = as_count("budget", budget, 1)
        origin = f"budget={middle}"
    else:
        ratio = as_fraction("compression_ratio", compression_ratio, "the fraction of tokens removed")
        kept = math.ceil((1.0 - ratio) * n - 1e-9)
        middle = kept - sink - window
        origin = f"compression_ratio={ratio} of n={n} tokens (keeps {kept}: sink={sink} + window={window} exact, a middle budget of {middle})"
        if middle < 1 and kept < n:
            needed = sink + window + 1
            fixes = [f"a context of at least {_smallest_context(needed, ratio)} tokens", "a smaller sink/window"]
            if n >= needed:
                fixes.insert(0, f"compression_ratio <= {math.floor((1 - needed / n) * 1e4) / 1e4}")
            raise ValueError(
                f"compression_ratio={ratio} keeps {kept} of n={n} tokens, which does not leave room beyond sink={sink} + window={window} "
                f"(always kept exactly), so the ratio cannot be honoured; use " + ", or ".join(fixes)
            )
        middle = max(middle, 1)
    if streaming and method is not None:
        smallest = smallest_stream_budget(method)
        if middle < smallest:
            raise ValueError(f"{origin}: streaming {method.name} (chunked/decode mode) needs a middle budget >= {smallest} per KV head")
    return middle


def check_sink_window(sink, window) -> tuple[int, int]:
    """(sink, window) as Python ints >= 0."""
    return as_count("sink", sink, 0), as_count("window", window, 0)
