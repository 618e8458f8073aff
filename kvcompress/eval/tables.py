"""Rows of dicts as CSV and Markdown tables: the one writer, reader and table of the evaluation and benchmark code."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path


def _columns(rows: Sequence[dict]) -> list[str]:
    return list(dict.fromkeys(k for r in rows for k in r))


def write_csv(path: str | Path, rows: Sequence[dict], columns: Sequence[str] | None = None) -> None:
    """Rows as a CSV file (its directory created), of `columns` (default: every key, in first-seen order over all rows; a
    row's missing key an empty cell); written whole or not at all (`saved_state.write_whole`: an interrupted rewrite
    leaves the rows that were there)."""
    from ..saved_state import write_whole  # imports torch, which the command line's parsing must not

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=_columns(rows) if columns is None else columns)
    writer.writeheader()
    writer.writerows(rows)
    write_whole(path, text.getvalue())


def parse_scalar(text: str):
    """A value written as text: true/false (any case) as a bool, else an int, else a float, else the text itself."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def read_csv(path: str | Path) -> list[dict]:
    """Rows written by write_csv, numbers parsed back (int, float or bool: `parse_scalar`), empty cells dropped. A row
    with more or fewer cells than the header (a file cut short or edited) is refused, naming the file and line."""
    with open(path, newline="", encoding="utf-8") as f:
        lines = csv.reader(f)
        header = next(lines, [])
        rows = []
        for row in lines:
            if not row:  # a blank line
                continue
            if len(row) != len(header):
                raise ValueError(f"{str(path)!r} line {lines.line_num} has {len(row)} cells where its header has {len(header)} "
                                 "(a file cut short or edited?)")
            rows.append({k: parse_scalar(v) for k, v in zip(header, row) if v != ""})
    return rows


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """Rows as a Markdown table of `columns` (default: every key, in first-seen order); floats to 4 significant digits, None empty."""
    columns = list(columns or _columns(rows))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
