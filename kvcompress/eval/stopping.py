"""Stop strings as token ids: decoding ends at the first generated token whose text contains one (RULER-style)."""

from __future__ import annotations

from collections.abc import Sequence


def stop_token_ids(tokenizer, stop: Sequence[str]) -> frozenset[int]:
    """Ids of every vocabulary token whose decoded text contains one of the `stop` strings.

    Cached per tokenizer and stop tuple (decoding the vocabulary once takes a fraction of a second).
    """
    if not stop:
        return frozenset()
    cache = tokenizer.__dict__.setdefault("_kvcompress_stop_ids", {})
    key = tuple(stop)
    if key not in cache:
        pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        cache[key] = frozenset(i for i, piece in enumerate(pieces) if any(s in piece for s in stop))
    return cache[key]
