"""Small writers shared by the benchmark scripts and the eval runner."""

from __future__ import annotations

import csv
from pathlib import Path


def write_csv(path: str | Path, rows: list[dict]) -> None:
    """Write dict rows to a CSV file, columns in the first row's key order."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
