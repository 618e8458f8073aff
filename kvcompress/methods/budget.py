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


# A fraction times a count is read to 9 decimals before it is cut to a whole number of slots: a float's rounding just
# below an integer or a half (0.29 * 100 = 28.999999999999996) is not a slot.
_TOLERANCE = 1e-9


def tokens_kept(n: int, compression_ratio: float) -> int:
    """ceil((1 - compression_ratio)·n): the tokens of n that a compression ratio keeps."""
    return math.ceil((1.0 - compression_ratio) * n - _TOLERANCE)


def floor_share(fraction: float, count: int) -> int:
    """floor(fraction·count): the whole slots a fraction of `count` gives."""
    return math.floor(fraction * count + _TOLERANCE)


def round_share(fraction: float, count: int) -> int:
    """round(fraction·count), a half to even: the nearest whole number of slots to a fraction of `count`."""
    return round(round(fraction * count, 9))


# Default re-compression slack of block-wise streams: the room a stream fills before re-compressing, as a fraction of
# what it compresses back to, both within the budget (`stream_split`: 0.5 compresses to 2/3 of the budget and lets the
# last third fill). Each token then takes part in about 1 + 1/slack re-compressions; time against it: docs/bench.md,
# "Streams with amortised re-compression".
DEFAULT_SLACK = 0.5


def check_slack(slack) -> float:
    """The re-compression slack of a block-wise stream: a finite number >= 0, as a Python float."""
    if isinstance(slack, bool) or not isinstance(slack, numbers.Real) or not math.isfinite(slack) or slack < 0:
        raise ValueError(
            f"slack must be a finite number >= 0 (the room a re-compressing stream fills before compressing again, as a "
            f"fraction of what it compresses back to, both within the budget; 0 compresses at every token past the budget), "
            f"got {slack!r}"
        )
    return float(slack)


def stream_split(budget: int, slack: float) -> tuple[int, int]:
    """(target, room) of a re-compressing stream whose stored slots per head never pass `budget` (the middle budget the
    user's budget or compression ratio gives): it compresses back to `target` slots and lets `room` = budget - target
    more in (its slack and the block being absorbed) before it compresses again. target = floor(budget / (1 + slack)),
    room the rest, so the slack comes out of the budget, not on top of it: slack 0.5 compresses to 2/3 of the budget
    and lets the last third fill. The room is at least 1 slot (a block-wise stream takes a block in pieces that fit
    it), so slack 0 compresses back to budget - 1; a budget below 2 leaves no room for the stream to work in and is a
    ValueError naming it, as is a slack so large that less than one slot would be kept (above budget - 1)."""
    if budget < 2:
        raise ValueError(
            f"a re-compressing stream needs a middle budget >= 2 per KV head (at least 1 slot kept and 1 for the next "
            f"token, both within the budget), got budget={budget}; use a larger budget or a lower compression_ratio"
        )
    kept = math.floor(budget / (1.0 + slack) + _TOLERANCE)
    if kept < 1:
        raise ValueError(
            f"slack={slack!r} leaves less than one slot to compress back to in a stream's middle budget of {budget} per KV "
            f"head (a layer's share where the method shares one budget over the layers; a stream keeps budget / (1 + slack) "
            f"slots at a re-compression); use slack <= {budget - 1}, or a larger budget"
        )
    target = min(budget - 1, kept)
    return target, budget - target


def _smallest_context(kept_needed: int, compression_ratio: float) -> int:
    """Smallest n with ceil((1 - ratio)·n) >= kept_needed: counted up from floor((kept_needed - 1) / (1 - ratio)), which
    is at most that (ceil reaches kept_needed as soon as (1 - ratio)·n passes kept_needed - 1)."""
    n = max(1, math.floor((kept_needed - 1) / (1.0 - compression_ratio)))
    while tokens_kept(n, compression_ratio) < kept_needed:
        n += 1
    return n


def smallest_stream_budget(method: Streaming) -> int:
    """The smallest budget the method's streaming state accepts (2 for a re-compressing stream: one slot kept and one of
    room, `stream_split`; Express, SubGen and the hybrid need more)."""
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
    A ratio that would remove tokens but leaves no room beyond sink + window (with `method` and streaming=True, for
    the smallest budget the method's stream accepts, `smallest_stream_budget`) is an error naming the largest ratio
    and the smallest n that work (never a silent "keep everything"); streaming, n is the tokens the streams take. A
    budget below what the stream accepts is an error that says where the budget came from.
    """
    if (budget is None) == (compression_ratio is None):
        raise ValueError(
            f"pass exactly one of budget (tokens kept per head) or compression_ratio (fraction removed); got budget={budget!r}, compression_ratio={compression_ratio!r}"
        )
    least = smallest_stream_budget(method) if streaming and method is not None else 1
    if budget is not None:
        middle = as_count("budget", budget, 1)
        if middle < least:
            raise ValueError(f"budget={middle}: streaming {method.name} (chunked/decode mode) needs a middle budget >= {least} per KV head")
        return middle
    ratio = as_fraction("compression_ratio", compression_ratio, "the fraction of tokens removed")
    kept = tokens_kept(n, ratio)
    middle = kept - sink - window
    if kept >= n:  # nothing removed (ratio 0, or every token within sink + window): the smallest budget keeps them all
        return max(middle, least)
    if middle < least:
        needed = sink + window + least
        counted = " (the tokens the streams take: the prompt's, and in decode mode the answer's too)" if streaming else ""
        longer = "streams of" if streaming else "a context of"
        fixes = [f"{longer} at least {_smallest_context(needed, ratio)} tokens", "a smaller sink/window"]
        if n >= needed:
            fixes.insert(0, f"compression_ratio <= {(n - needed) * 10_000 // n / 10_000}")  # in integers: 1 - 8/10 is 0.1999… in floats
        room = "room" if least == 1 else f"the middle budget of {least} per KV head that streaming {method.name} needs"
        raise ValueError(
            f"compression_ratio={ratio} keeps {kept} of n={n} tokens{counted}, which does not leave {room} beyond sink={sink} + "
            f"window={window} (always kept exactly), so the ratio cannot be honoured; use " + ", or ".join(fixes)
        )
    return middle


def check_sink_window(sink, window) -> tuple[int, int]:
    """(sink, window) as Python ints >= 0."""
    return as_count("sink", sink, 0), as_count("window", window, 0)
