"""Memory: peak KV bytes the cache stores and peak process memory during the prompt, `prefill` vs `chunked` mode."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from .common import add_row, context_ids, save_figure, subplots
from .config import BenchConfig


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def peak_process_memory(fn: Callable[[], object]) -> tuple[object, int, int]:
    """(fn(), peak resident bytes during the call, resident bytes before it), via Linux's VmHWM reset (clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
            f.write("5")
    except OSError as err:
        raise RuntimeError(f"peak process memory needs Linux /proc/self/clear_refs (resetting VmHWM): {err}") from err
    before = _status_kib("VmRSS") * 1024
    out = fn()
    return out, _status_kib("VmHWM") * 1024, before


def memory_rows(model, tokenizer, config: BenchConfig, log: Callable[[str], None] = print,
                on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Rows {mode, method, n, budget, peak_kv_bytes, kv_bytes, kv_bytes_full, peak_rss_bytes, rss_before_bytes, peak_rss_growth_bytes, prompt_s}
    for config.memory_method in each of memory_modes at each of memory_sizes.

    The prompt (n tokens of real prose, no question) goes through `generate_ids` with the fixed
    middle budget memory_budget (chunked mode: blocks of chunk_size) and one new token; peak_kv_bytes is what the cache stored at its largest,
    peak_rss_growth_bytes the process's resident set at its peak minus before the call (after
    one warm-up forward, so paging in the weights does not count).
    """
    from ...integration import generate_ids
    from ...options import block_settings

    # Warm-up: the first forward pages in the (memory-mapped) weights, which is not prefill memory.
    generate_ids(model, context_ids(tokenizer, 16), None, method=None, max_new_tokens=1)
    method, budget = config.memory_method, config.memory_budget
    rows = []
    for mode in config.memory_modes:
        for n in sorted(config.memory_sizes):
            ids = context_ids(tokenizer, n)
            res, peak, before = peak_process_memory(
                lambda: generate_ids(model, ids, None, method=method, budget=budget, mode=mode, max_new_tokens=1,
                                     **block_settings(mode, config.chunk_size))
            )
            add_row(rows, on_row, {"mode": mode, "method": method, "n": ids.shape[1], "budget": budget, "peak_kv_bytes": res.peak_kv_bytes,
                         "kv_bytes": res.kv_bytes, "kv_bytes_full": res.kv_bytes_full, "peak_rss_bytes": peak,
                         "rss_before_bytes": before, "peak_rss_growth_bytes": peak - before, "prompt_s": res.prefill_seconds})
            log(f"memory {mode} n={n}: peak KV {res.peak_kv_bytes / 2**20:.1f} MiB, peak RSS growth {(peak - before) / 2**20:.1f} MiB")
    return rows


def plot_memory(rows: Sequence[dict], path: Path) -> None:
    """Peak KV bytes and peak process-memory growth vs prompt length, one line per mode."""
    fig, axes = subplots(2, (12, 4.5))
    for ax, key, label in ((axes[0][0], "peak_kv_bytes", "peak KV bytes stored (MiB)"),
                           (axes[0][1], "peak_rss_growth_bytes", "peak process memory growth (MiB)")):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = [(r["n"], r[key] / 2**20) for r in rows if r["mode"] == mode]
            ax.plot(*zip(*pts), "-o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"{' vs '.join(dict.fromkeys(r['mode'] for r in rows))}, {rows[0]['method']}, middle budget {rows[0]['budget']}")
    save_figure(fig, path)
