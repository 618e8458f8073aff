"""Where a greedily decoded answer ends, by its stop rules. Standard library only, so that the kvpress side-by-side
harness (benchmarks/kvpress_side_by_side.py) loads it by path in a venv without kvcompress and decodes kvpress's
answers by the same rule."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def answer_end(tokens: Sequence[int], eos_ids: Collection[int], stop_ids: Collection[int]) -> int | None:
    """How many of an answer's `tokens` it keeps: up to and including its first EOS, or its first stop token that follows
    a token that is not one; None when neither comes (the answer goes on). Stop tokens before any other token (a leading
    newline) do not end it: LongBench decodes its one-line answers freely and keeps the first line that is not empty."""
    other = False
    for i, t in enumerate(tokens):
        if t in eos_ids or (other and t in stop_ids):
            return i + 1
        other = other or t not in stop_ids
    return None
