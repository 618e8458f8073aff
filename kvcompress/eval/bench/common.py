"""What every cost benchmark shares: layer shapes, synthetic tensors, timing, the power-law fit, the machine line, figures."""

from __future__ import annotations

import datetime
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from matplotlib.figure import Figure

from ...checks import as_count
from ...names import BENCH_SHAPES
from ...names import BENCH_SIZES as DEFAULT_SIZES
from ..tables import markdown_table, write_csv


@dataclass(frozen=True)
class Shape:
    """One layer's attention shape: KV heads, query heads (grouped-query), head dimension."""

    name: str
    kv_heads: int
    query_heads: int
    head_dim: int


SHAPES = {name: Shape(name, *dims) for name, dims in BENCH_SHAPES.items()}


def time_calls(fn: Callable[[], object], repeats: int, max_seconds: float = math.inf, device: torch.device | str = "cpu") -> list[float]:
    """Wall-clock seconds of up to `repeats` calls of fn; stops early once their sum passes max_seconds (at least one call).

    On a CUDA `device` each interval ends with a synchronise, so it covers the queued kernels.
    """
    as_count("repeats", repeats, 1)
    cuda = torch.device(device).type == "cuda"
    times: list[float] = []
    while len(times) < repeats and sum(times) <= max_seconds:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def fit_exponent(sizes: Sequence[float], values: Sequence[float]) -> tuple[float, float]:
    """(a, c) of values ≈ c·sizes^a by least squares on log values vs log sizes (needs >= 2 distinct sizes)."""
    sizes, values = np.asarray(sizes, dtype=float), np.asarray(values, dtype=float)
    if len(sizes) != len(values) or len(np.unique(sizes)) < 2:
        raise ValueError(f"fit_exponent needs >= 2 distinct sizes with one value each, got {len(sizes)} sizes and {len(values)} values")
    if not (np.isfinite(values).all() and (values > 0).all() and (sizes > 0).all()):
        raise ValueError("fit_exponent needs positive, finite sizes and values")
    x, y = np.log(sizes), np.log(values)
    a, log_c = np.polyfit(x, y, 1)
    return float(a), float(math.exp(log_c))


def synthetic_layer(shape: Shape, n: int, generator: torch.Generator, dtype=torch.float32, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Random post-RoPE keys/values/queries [1, H, n, d], pre-RoPE keys, and hidden states [1, H_kv, n, H_q·d] (one per
    token, the same for every head) for one layer of `shape`, on `device` in `dtype`.

    Drawn on the CPU from `generator` (the same numbers on every device), then moved.

    Keys carry a few large channels and a per-head offset, as real keys do (some methods' cost
    depends on the data: SubGen's cluster count, Express's thinning); only the shapes matter
    for the exact pass.
    """
    h, hq, d = shape.kv_heads, shape.query_heads, shape.head_dim
    channel_scale = torch.ones(d, dtype=torch.float32)
    channel_scale[: max(1, d // 16)] = 4.0

    def draw(heads: int) -> torch.Tensor:
        offset = torch.randn(1, heads, 1, d, generator=generator, dtype=torch.float32)
        return (torch.randn(1, heads, n, d, generator=generator, dtype=torch.float32) * channel_scale + offset).to(device, dtype)

    return {
        "keys": draw(h),
        "values": torch.randn(1, h, n, shape.head_dim, generator=generator, dtype=torch.float32).to(device, dtype),
        "queries": draw(hq),
        "pre_rope_keys": draw(h),
        "hidden_states": torch.randn(1, 1, n, hq * d, generator=generator, dtype=torch.float32).to(device, dtype).expand(1, h, n, hq * d),
    }


def context_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    """[1, n_tokens] ids of real prose (the Python reference's paragraphs, cycled)."""
    from ..capture import prose_text

    as_count("n_tokens", n_tokens, 1)
    ids = tokenizer(prose_text(n_chars=6 * n_tokens), add_special_tokens=False, return_tensors="pt")["input_ids"]
    return ids[:, :n_tokens]


def add_row(rows: list[dict], on_row, row: dict) -> None:
    """Append a row and hand the rows so far to on_row (so a long run's results are saved as they come)."""
    rows.append(row)
    if on_row is not None:
        on_row(rows)


def write_table(rows: Sequence[dict], out: Path, stem: str, heading: str, columns: Sequence[str]) -> str:
    """Rows as out/stem.csv and out/stem.md (the heading paragraphs, then a table of `columns`); returns the Markdown."""
    write_csv(out / f"{stem}.csv", rows)
    text = f"{heading}\n\n{markdown_table(rows, columns)}\n"
    (out / f"{stem}.md").write_text(text, encoding="utf-8")
    return text


def machine_description(threads: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> str:
    """One line: CPU model, cores, torch threads, device and dtype, load, date, versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    device = torch.device(device)
    where = f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{cpu}, {os.cpu_count()} cores, torch threads {threads}, device {where}, {str(dtype).removeprefix('torch.')}, "
            f"load average {load:.1f} at start, {datetime.date.today().isoformat()}, torch {torch.__version__}, Python {platform.python_version()}")


def subplots(ncols: int, size: tuple[float, float]) -> tuple[Figure, np.ndarray]:
    """(figure, axes [1, ncols]): a matplotlib Figure outside pyplot, so the user's backend is left alone and nothing needs closing."""
    fig = Figure(figsize=size)
    return fig, fig.subplots(1, ncols, squeeze=False)


def save_figure(fig: Figure, path: Path) -> None:
    """The figure as a PNG at `path` (its directory created)."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
