"""A real-prose source, and (re-exported from `integration.capture`) real q/k/v capture.

`prose_paragraphs` / `prose_text` give natural-language text that ships with every CPython: the
prose paragraphs of the Python language reference topics in `pydoc_data.topics` (the text behind
`help("for")`), without code samples, grammar blocks or headings.
"""

from __future__ import annotations

import random
import re

from ..integration.capture import capture_qkv

__all__ = ["capture_qkv", "prose_paragraphs", "prose_text"]


def _is_prose(paragraph: str) -> bool:
    """A paragraph of running text: unindented, several words, mostly letters, ends a sentence."""
    if paragraph.startswith((" ", "*", "-", "+", "=")) or len(paragraph.split()) < 8:
        return False
    letters = sum(ch.isalpha() or ch.isspace() for ch in paragraph)
    return letters >= 0.85 * len(paragraph) and paragraph.rstrip().endswith((".", ":", "?", "!"))


def prose_paragraphs() -> list[str]:
    """Prose paragraphs of the Python language reference (`pydoc_data.topics`), in a fixed order.

    Line breaks inside a paragraph become spaces; paragraphs ending with ':' (which introduce a
    code sample that was removed) are dropped, and so are repeats (several topics share text).
    """
    from pydoc_data.topics import topics

    out: dict[str, None] = {}
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            if _is_prose(block) and not block.rstrip().endswith(":"):
                out.setdefault(" ".join(block.split()))
    return list(out)


def prose_text(n_chars: int | None = None, seed: int | None = None) -> str:
    """Real prose joined by blank lines: the paragraphs in order (seed None) or shuffled by `seed`.

    n_chars: stop at the first paragraph boundary at or after n_chars characters, cycling through
    the paragraphs again if needed; None returns every paragraph once.
    """
    paragraphs = prose_paragraphs()
    if seed is not None:
        random.Random(seed).shuffle(paragraphs)
    if n_chars is None:
        return "\n\n".join(paragraphs)
    if n_chars < 0:
        raise ValueError(f"n_chars must be >= 0, got {n_chars}")
    parts: list[str] = []
    total = 0
    while total < n_chars:
        for p in paragraphs:
            parts.append(p)
            total += len(p) + 2
            if total >= n_chars:
                break
    return "\n\n".join(parts)
