"""Cost benchmarks (DESIGN.md §5, issue 9): what each method costs against the uncompressed baseline.

Every number is a ratio to a baseline measured in the same run (absolute times on a shared
machine are noise); times are the minimum (and median) over repeats, each a wall-clock
`time.perf_counter` interval.

- `overhead_rows`: one layer's worth of heads (synthetic tensors of a model's shapes); each
  method's one-shot `compress`, and each natively streaming method's updates over the same
  tokens, timed against one exact causal attention pass (SDPA) over the same n tokens.
- `fit_exponent`: the growth exponent a of time ≈ c·n^a (least squares in log-log).
- `decode_rows`: greedy-decoding tokens/s on a real model over one long context, the full cache
  against every method at the given kept fractions (one recorded prefill reused by each method).
- `attention_step_rows`: the attention-only decode step (one query) over a full cache (SDPA)
  against a compressed one (`weighted_attention` over kept·n slots).
- `memory_rows`: peak KV bytes the cache stores and peak process memory (resident set, Linux
  `VmHWM` reset per point) during the prompt, `prefill` vs `chunked` mode.
- `write_csv`, `write_markdown`, `plot_*`: the tables and PNGs; `run` does it all.
"""

from __future__ import annotations

import csv
import datetime
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    """One layer's attention shape: KV heads, query heads (grouped-query), head dimension."""

    name: str
    kv_heads: int
    query_heads: int
    head_dim: int


SHAPES = {
    "smollm2": Shape("smollm2", 3, 9, 64),  # the default model, SmolLM2-135M-Instruct
    "llama8b": Shape("llama8b", 8, 32, 128),  # Llama-3-8B-like: 8 KV heads x 128, 32 query heads
}
DEFAULT_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
SECTIONS = ("overhead", "decode", "attention", "memory")


def _check_positive(name: str, value, minimum=1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


def time_calls(fn: Callable[[], object], repeats: int, max_seconds: float = math.inf) -> list[float]:
    """Wall-clock seconds of up to `repeats` calls of fn; stops early once their sum passes max_seconds (at least one call)."""
    _check_positive("repeats", repeats)
    times: list[float] = []
    while len(times) < repeats and sum(times) <= max_seconds:
        start = time.perf_counter()
        fn()
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


def synthetic_layer(shape: Shape, n: int, generator: torch.Generator, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random post-RoPE keys/values/queries [1, H, n, d] and pre-RoPE keys for one layer of `shape`.

    Keys carry a few large channels and a per-head offset, as real keys do (some methods' cost
    depends on the data: SubGen's cluster count, Express's thinning); only the shapes matter
    for the exact pass.
    """
    h, hq, d = shape.kv_heads, shape.query_heads, shape.head_dim
    channel_scale = torch.ones(d)
    channel_scale[: max(1, d // 16)] = 4.0

    def draw(heads: int) -> torch.Tensor:
        offset = torch.randn(1, heads, 1, d, generator=generator)
        return (torch.randn(1, heads, n, d, generator=generator) * channel_scale + offset).to(dtype)

    return {
        "keys": draw(h),
        "values": torch.randn(1, h, n, shape.head_dim, generator=generator).to(dtype),
        "queries": draw(hq),
        "pre_rope_keys": draw(h),
    }


def exact_attention_pass(layer: dict[str, torch.Tensor]) -> torch.Tensor:
    """One exact causal attention pass of every query over the layer's n tokens (SDPA, grouped-query)."""
    return F.scaled_dot_product_attention(layer["queries"], layer["keys"], layer["values"], is_causal=True, enable_gqa=True)


def natively_streaming(method: str) -> bool:
    """True when the method has its own streaming state (not the block-wise replay of its one-shot form)."""
    from ..methods.base import Method, get_method_class

    return get_method_class(method).new_stream is not Method.new_stream


def method_inputs(method: str, layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The optional inputs the method needs: queries and/or pre-RoPE keys."""
    from ..methods.base import get_method_class

    cls = get_method_class(method)
    out = {}
    if cls.needs_queries:
        out["queries"] = layer["queries"]
    if cls.needs_pre_rope_keys:
        out["pre_rope_keys"] = layer["pre_rope_keys"]
    return out


def kept_budget(n: int, compression_ratio: float) -> int:
    """Slots kept per head when `compression_ratio` of n tokens is removed (at least 1)."""
    return max(1, math.ceil((1.0 - compression_ratio) * n - 1e-9))


def one_shot(method: str, layer: dict[str, torch.Tensor], compression_ratio: float, seed: int) -> Callable[[], object]:
    """A call compressing the whole layer once with `kvc.compress` (sink = window = 0: every token goes through the method)."""
    from ..api import compress

    budget = kept_budget(layer["keys"].shape[2], compression_ratio)
    extra = method_inputs(method, layer)
    return lambda: compress(method, layer["keys"], layer["values"], budget=budget, sink=0, window=0, seed=seed, **extra)


def streamed(method: str, layer: dict[str, torch.Tensor], compression_ratio: float, block: int, seed: int) -> Callable[[], object]:
    """A call feeding the layer to a fresh `kvc.stream` (sink = window = 0) in blocks of `block` tokens, each with its own queries, then reading the summary."""
    from ..api import stream

    n = layer["keys"].shape[2]
    budget = kept_budget(n, compression_ratio)
    extra = method_inputs(method, layer)

    def run():
        st = stream(method, budget=budget, sink=0, window=0, seed=seed)
        for start in range(0, n, block):
            part = {k: v[:, :, start : start + block] for k, v in extra.items()}
            st.update(layer["keys"][:, :, start : start + block], layer["values"][:, :, start : start + block], **part)
        return st.summary()

    return run


def _timing_row(shape: Shape, n: int, method: str, kind: str, times: list[float], exact: list[float] | None) -> dict:
    row = {"shape": shape.name, "n": n, "method": method, "kind": kind, "repeats": len(times),
           "min_s": min(times), "median_s": statistics.median(times)}
    if exact is not None:
        row["ratio_min"] = row["min_s"] / min(exact)
        row["ratio_median"] = row["median_s"] / statistics.median(exact)
    return row


def overhead_rows(
    methods: Sequence[str],
    shapes: Sequence[Shape],
    sizes: Sequence[int],
    compression_ratio: float = 0.5,
    repeats: int = 3,
    block: int = 128,
    max_seconds: float = 30.0,
    stream: str = "native",
    seed: int = 0,
    log: Callable[[str], None] = print,
    on_row: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Rows {shape, n, method, kind (exact|compress|stream), repeats, min_s, median_s, ratio_min, ratio_median}.

    Every method gets the same job: keep ceil((1 - compression_ratio)·n) of the n tokens per
    head, with no exact sink or window (so the time is the method's own work on all n tokens).
    stream: "native" times the updates of natively streaming methods, "all" of every method
    (block-wise replay included), "none" skips streaming. Repeats of one measurement stop once
    they have taken max_seconds; a measurement whose single call took longer than max_seconds
    is not run at larger n (a row with skipped=True and no times records it), and neither is
    anything of a shape whose exact pass did.
    """
    if stream not in ("native", "all", "none"):
        raise ValueError(f"stream must be 'native', 'all' or 'none', got {stream!r}")
    if not 0.0 <= compression_ratio < 1.0:
        raise ValueError(f"compression_ratio must be in [0, 1), got {compression_ratio!r}")
    _check_positive("block", block)
    _check_positive("max_seconds", max_seconds, 0)
    for n in sizes:
        _check_positive("sizes", n, 2)
    jobs = []
    for method in methods:
        jobs.append((method, "compress"))
        if stream == "all" or (stream == "native" and natively_streaming(method)):
            jobs.append((method, "stream"))
    rows: list[dict] = []
    for shape in shapes:
        too_slow: set[tuple[str, str]] = set()
        for n in sorted(sizes):
            if ("exact", "exact") in too_slow:
                too_slow.update(jobs)
                rows += [{"shape": shape.name, "n": n, "method": m, "kind": k, "skipped": True} for m, k in (("exact", "exact"), *jobs)]
                continue
            layer = synthetic_layer(shape, n, torch.Generator().manual_seed(seed + n))
            exact = time_calls(lambda: exact_attention_pass(layer), repeats, max_seconds)
            _add(rows, on_row, _timing_row(shape, n, "exact", "exact", exact, None))
            log(f"{shape.name} n={n}: exact attention {min(exact):.3f}s")
            for method, kind in jobs:
                if (method, kind) in too_slow:
                    _add(rows, on_row, {"shape": shape.name, "n": n, "method": method, "kind": kind, "skipped": True})
                    continue
                fn = one_shot(method, layer, compression_ratio, seed) if kind == "compress" else streamed(method, layer, compression_ratio, block, seed)
                times = time_calls(fn, repeats, max_seconds)
                _add(rows, on_row, _timing_row(shape, n, method, kind, times, exact))
                log(f"{shape.name} n={n}: {method} {kind} {min(times):.3f}s = {rows[-1]['ratio_min']:.3f}x exact")
                if min(times) > max_seconds:
                    too_slow.add((method, kind))
            if min(exact) > max_seconds:
                too_slow.add(("exact", "exact"))
    return rows


def _add(rows: list[dict], on_row, row: dict) -> None:
    """Append a row and hand the rows so far to on_row (so a long run's results are saved as they come)."""
    rows.append(row)
    if on_row is not None:
        on_row(rows)


def exponent_rows(rows: Sequence[dict]) -> list[dict]:
    """Per (shape, method, kind): growth exponents of time and of the ratio to exact attention, over the sizes measured."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if not r.get("skipped"):
            groups.setdefault((r["shape"], r["method"], r["kind"]), []).append(r)
    out = []
    for (shape, method, kind), rs in groups.items():
        if len({r["n"] for r in rs}) < 2:
            continue
        ns = [r["n"] for r in rs]
        row = {"shape": shape, "method": method, "kind": kind, "n_min": min(ns), "n_max": max(ns),
               "time_exponent": fit_exponent(ns, [r["min_s"] for r in rs])[0]}
        if "ratio_min" in rs[0]:
            row["ratio_exponent"] = fit_exponent(ns, [r["ratio_min"] for r in rs])[0]
        out.append(row)
    return out


def context_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    """[1, n_tokens] ids of real prose (the Python reference's paragraphs, cycled)."""
    from .capture import prose_text

    _check_positive("n_tokens", n_tokens)
    ids = tokenizer(prose_text(n_chars=6 * n_tokens), add_special_tokens=False, return_tensors="pt")["input_ids"]
    return ids[:, :n_tokens]


def decode_rows(
    model,
    tokenizer,
    methods: Sequence[str],
    context_tokens: int = 8192,
    kept: Sequence[float] = (0.25, 0.5),
    new_tokens: int = 32,
    seed: int = 0,
    log: Callable[[str], None] = print,
    on_row: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Rows {method, kept, context_tokens, new_tokens, decode_s, tokens_per_s, speedup, kv_bytes, kv_bytes_full}.

    The context (real prose, `context_tokens` tokens plus the chat template) is prefilled once and
    every method compresses its own copy (prefill mode, question appended exactly); then
    `new_tokens` greedy tokens are decoded without stopping at EOS. speedup is tokens/s over the
    full cache's tokens/s (full cache: transformers' DynamicCache and SDPA).
    """
    from ..integration import build_prompt, generate_ids
    from .capture import capture_qkv

    _check_positive("new_tokens", new_tokens, 2)
    for k in kept:
        if not 0.0 < k <= 1.0:
            raise ValueError(f"kept fractions must be in (0, 1], got {k!r}")
    text = tokenizer.decode(context_ids(tokenizer, context_tokens)[0])
    ctx, question = build_prompt(tokenizer, text, "Summarise the text above in one sentence.")
    log(f"decode: context {ctx.shape[1]} tokens, question {question.shape[1]} tokens, {new_tokens} new tokens")
    prefill = capture_qkv(model, ctx)
    common = {"max_new_tokens": new_tokens, "stop_at_eos": False, "seed": seed}
    full = generate_ids(model, ctx, question, method=None, **common)
    rows: list[dict] = []
    _add(rows, on_row, _decode_row(full, 1.0, full))
    log(f"decode full: {full.decode_tokens_per_second:.2f} tokens/s")
    for method in methods:
        for k in kept:
            res = generate_ids(model, ctx, question, method=method, compression_ratio=1.0 - k, prefill=prefill, **common)
            _add(rows, on_row, _decode_row(res, k, full))
            log(f"decode {method} kept={k}: {res.decode_tokens_per_second:.2f} tokens/s = {rows[-1]['speedup']:.2f}x full")
    return rows


def _decode_row(res, kept: float, full) -> dict:
    return {"method": res.method, "kept": kept, "context_tokens": res.context_tokens, "new_tokens": len(res.token_ids),
            "decode_s": res.decode_seconds, "tokens_per_s": res.decode_tokens_per_second,
            "speedup": res.decode_tokens_per_second / full.decode_tokens_per_second,
            "kv_bytes": res.kv_bytes, "kv_bytes_full": res.kv_bytes_full}


def attention_step_rows(
    shape: Shape,
    contexts: Sequence[int] = (8192, 32768),
    kept: Sequence[float] = (0.25, 0.5),
    repeats: int = 50,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Rows {shape, context, path, kept, slots, min_s, median_s, speedup} for one decode step's attention.

    path "sdpa": one query over the full n keys with SDPA (the full cache's step);
    "weighted": `weighted_attention` over the full n (same code path as compressed, kept=1) and
    over kept·n slots (the compressed cache's step). speedup is the full SDPA time over the row's
    time (minimum over repeats).
    """
    from ..attention import weighted_attention
    from ..summary import KVSummary

    rows = []
    for n in contexts:
        layer = synthetic_layer(shape, n, torch.Generator().manual_seed(seed + n))
        q = layer["queries"][:, :, -1:]
        full = time_calls(lambda: F.scaled_dot_product_attention(q, layer["keys"], layer["values"], enable_gqa=True), repeats)
        cases = [("sdpa", 1.0, full)]
        for k in (1.0, *kept):
            m = max(1, round(k * n))
            summary = KVSummary.exact(layer["keys"][:, :, :m], layer["values"][:, :, :m], torch.arange(m))
            cases.append(("weighted", k, time_calls(lambda: weighted_attention(q, summary), repeats)))
        for path, k, times in cases:
            rows.append({"shape": shape.name, "context": n, "path": path, "kept": k, "slots": max(1, round(k * n)),
                         "min_s": min(times), "median_s": statistics.median(times), "speedup": min(full) / min(times)})
            log(f"attention step {shape.name} n={n} {path} kept={k}: {min(times) * 1e3:.3f} ms = {rows[-1]['speedup']:.2f}x faster than full")
    return rows


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def peak_process_memory(fn: Callable[[], object]) -> tuple[object, int, int]:
    """(fn(), peak resident bytes during the call, resident bytes before it), via Linux's VmHWM reset (clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as err:
        raise RuntimeError(f"peak process memory needs Linux /proc/self/clear_refs (resetting VmHWM): {err}") from err
    before = _status_kib("VmRSS") * 1024
    out = fn()
    return out, _status_kib("VmHWM") * 1024, before


def memory_rows(
    model,
    tokenizer,
    method: str = "keydiff",
    sizes: Sequence[int] = (2048, 4096, 8192, 16384),
    budget: int = 1024,
    chunk_size: int = 128,
    modes: Sequence[str] = ("chunked", "prefill"),
    log: Callable[[str], None] = print,
    on_row: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Rows {mode, method, n, budget, peak_kv_bytes, kv_bytes, kv_bytes_full, peak_rss_bytes, rss_before_bytes, peak_rss_growth_bytes, prompt_s}.

    The prompt (n tokens of real prose, no question) goes through `generate_ids` with a fixed
    middle budget and one new token; peak_kv_bytes is what the cache stored at its largest,
    peak_rss_growth_bytes the process's resident set at its peak minus before the call (after
    one warm-up forward, so paging in the weights does not count).
    """
    from ..integration import generate_ids

    # Warm-up: the first forward pages in the (memory-mapped) weights, which is not prefill memory.
    generate_ids(model, context_ids(tokenizer, 16), None, method=None, max_new_tokens=1)
    rows = []
    for mode in modes:
        for n in sorted(sizes):
            ids = context_ids(tokenizer, n)
            res, peak, before = peak_process_memory(
                lambda: generate_ids(model, ids, None, method=method, budget=budget, mode=mode, max_new_tokens=1, chunk_size=chunk_size)
            )
            _add(rows, on_row, {"mode": mode, "method": method, "n": ids.shape[1], "budget": budget, "peak_kv_bytes": res.peak_kv_bytes,
                         "kv_bytes": res.kv_bytes, "kv_bytes_full": res.kv_bytes_full, "peak_rss_bytes": peak,
                         "rss_before_bytes": before, "peak_rss_growth_bytes": peak - before, "prompt_s": res.prefill_seconds})
            log(f"memory {mode} n={n}: peak KV {res.peak_kv_bytes / 2**20:.1f} MiB, peak RSS growth {(peak - before) / 2**20:.1f} MiB")
    return rows


def write_csv(rows: Sequence[dict], path: Path) -> None:
    """Rows as CSV; columns in first-seen order over all rows."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    """Rows written by write_csv, numbers parsed back (int, float or bool), empty cells dropped."""

    def parse(v: str):
        if v in ("True", "False"):
            return v == "True"
        for kind in (int, float):
            try:
                return kind(v)
            except ValueError:
                pass
        return v

    with open(path, newline="") as f:
        return [{k: parse(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    columns = list(columns or dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def machine_description(threads: int) -> str:
    """One line: CPU model, cores, torch threads, load, date, versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{cpu}, {os.cpu_count()} cores, torch threads {threads}, load average {load:.1f} at start, "
            f"{datetime.date.today().isoformat()}, torch {torch.__version__}, Python {platform.python_version()}")


def overhead_pivot(rows: Sequence[dict], shape: str, kind: str) -> list[dict]:
    """{method, ratio at each n} for one shape and kind (compress/stream): min-of-repeats ratios to exact attention."""
    table: dict[str, dict] = {}
    for r in rows:
        if r["shape"] == shape and r["kind"] == kind:
            cell = "skipped" if r.get("skipped") else f"{r['ratio_min']:.3g}"
            table.setdefault(r["method"], {"method": r["method"]})[f"n={r['n']}"] = cell
    return list(table.values())


def _subplots(ncols: int, size: tuple[float, float]):
    """(figure, axes [1, ncols]) on matplotlib's Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=size, squeeze=False)


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_overhead(rows: Sequence[dict], path: Path) -> None:
    """Ratio to exact attention vs n (log-log), one panel per shape; solid compress, dashed stream."""
    import matplotlib

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = _subplots(len(shapes), (7 * len(shapes), 5))
    for ax, shape in zip(axes[0], shapes):
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in rows:
            if r["shape"] == shape and "ratio_min" in r and not r.get("skipped"):
                series.setdefault((r["method"], r["kind"]), []).append((r["n"], r["ratio_min"]))
        methods = sorted({m for m, _ in series})
        colors = matplotlib.colormaps["tab20"].resampled(max(1, len(methods)))
        for (method, kind), pts in sorted(series.items()):
            ns, ratios = zip(*pts)
            style = "-o" if kind == "compress" else "--x"
            ax.plot(ns, ratios, style, color=colors(methods.index(method)), label=f"{method} ({kind})", markersize=3)
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens n")
        ax.set_ylabel("time / one exact causal attention pass")
        ax.set_title(f"compression overhead, {shape} shape")
        ax.legend(fontsize=6, ncol=2)
    _save(fig, path)


def plot_decode(decode: Sequence[dict], step: Sequence[dict], path: Path) -> None:
    """A panel of decode tokens/s over the full cache's per method and kept fraction, and one of attention-step speed-ups (those with rows)."""
    panels = [(kind, rows) for kind, rows in (("decode", decode), ("step", step)) if rows]
    fig, axes = _subplots(len(panels), (7 * len(panels), 5))
    for ax, (kind, rows) in zip(axes[0], panels):
        if kind == "decode":
            methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "full"))
            kept = sorted({r["kept"] for r in rows if r["method"] != "full"})
            width = 0.8 / max(1, len(kept))
            for i, k in enumerate(kept):
                vals = {r["method"]: r["speedup"] for r in rows if r["kept"] == k and r["method"] != "full"}
                ax.bar(np.arange(len(methods)) + i * width, [vals.get(m, np.nan) for m in methods], width, label=f"{k:.0%} kept")
            ax.set_xticks(np.arange(len(methods)) + width * (len(kept) - 1) / 2, methods, rotation=45, ha="right")
            ax.set_ylabel("decode tokens/s / full cache")
            ax.set_title(f"greedy decoding, default model, {rows[0]['context_tokens']}-token context")
            ax.legend()
        else:
            labels = [f"{r['context'] // 1024}k {r['path']} {r['kept']:.0%}" for r in rows]
            ax.bar(np.arange(len(rows)), [r["speedup"] for r in rows])
            ax.set_xticks(np.arange(len(rows)), labels, rotation=45, ha="right")
            ax.set_ylabel("full-cache SDPA step time / step time")
            ax.set_title(f"attention-only decode step, {rows[0]['shape']} shape")
        ax.axhline(1.0, color="black", linewidth=1)
    _save(fig, path)


def plot_memory(rows: Sequence[dict], path: Path) -> None:
    """Peak KV bytes and peak process-memory growth vs prompt length, one line per mode."""
    fig, axes = _subplots(2, (12, 4.5))
    for ax, key, label in ((axes[0][0], "peak_kv_bytes", "peak KV bytes stored (MiB)"),
                           (axes[0][1], "peak_rss_growth_bytes", "peak process memory growth (MiB)")):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = [(r["n"], r[key] / 2**20) for r in rows if r["mode"] == mode]
            ax.plot(*zip(*pts), "-o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"prefill vs chunked, {rows[0]['method']}, middle budget {rows[0]['budget']}")
    _save(fig, path)


def write_markdown(path: Path, machine: str, overhead=(), exponents=(), decode=(), step=(), memory=()) -> None:
    """One Markdown page with every section that was run."""
    out = ["# kvcompress bench", "", f"Machine: {machine}.", ""]
    if overhead:
        out += ["## Compression overhead", "",
                "Time of each method over one exact causal attention pass (SDPA) over the same n tokens "
                "(min of repeats, synthetic tensors of the shape, 50% removed unless stated). "
                "`skipped`: a smaller n already took longer than the per-call limit.", ""]
        for shape in dict.fromkeys(r["shape"] for r in overhead):
            exact = [r for r in overhead if r["shape"] == shape and r["method"] == "exact"]
            out += [f"### {shape}: exact attention seconds", "",
                    markdown_table([{"n": r["n"], "min_s": r.get("min_s", "skipped"), "repeats": r.get("repeats")} for r in exact]), ""]
            for kind in ("compress", "stream"):
                table = overhead_pivot(overhead, shape, kind)
                if table:
                    out += [f"### {shape}: {kind} time / exact attention", "", markdown_table(table), ""]
    if exponents:
        out += ["### Growth exponents (time ≈ c·n^a; ratio ≈ c·n^b)", "",
                markdown_table(exponents, ["shape", "method", "kind", "n_min", "n_max", "time_exponent", "ratio_exponent"]), ""]
    if decode:
        out += ["## Decode speed", "", markdown_table(decode, ["method", "kept", "context_tokens", "new_tokens", "tokens_per_s", "speedup", "kv_bytes"]), ""]
    if step:
        out += ["## Attention-only decode step", "", markdown_table(step), ""]
    if memory:
        out += ["## Memory: prefill vs chunked", "",
                markdown_table(memory, ["mode", "method", "n", "budget", "peak_kv_bytes", "kv_bytes_full", "peak_rss_growth_bytes", "prompt_s"]), ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out))


def report(out_dir: Path) -> dict[str, list[dict]]:
    """Rewrite bench.md and the PNGs of out_dir from the CSVs (and machine.txt) a run left there."""
    out_dir = Path(out_dir)
    results = {name: read_csv(out_dir / f"{name}.csv") for name in SECTIONS if (out_dir / f"{name}.csv").is_file()}
    if not results:
        raise ValueError(f"out_dir {str(out_dir)!r} holds no bench CSV ({', '.join(SECTIONS)})")
    if "overhead" in results:
        results["exponents"] = exponent_rows(results["overhead"])
        plot_overhead(results["overhead"], out_dir / "overhead.png")
        write_csv(results["exponents"], out_dir / "exponents.csv")
    if "decode" in results or "attention" in results:
        plot_decode(results.get("decode", []), results.get("attention", []), out_dir / "decode.png")
    if "memory" in results:
        plot_memory(results["memory"], out_dir / "memory.png")
    machine = (out_dir / "machine.txt").read_text().strip() if (out_dir / "machine.txt").is_file() else "not recorded"
    write_markdown(out_dir / "bench.md", machine, results.get("overhead", ()), results.get("exponents", ()),
                   results.get("decode", ()), results.get("attention", ()), results.get("memory", ()))
    return results


def run(
    out_dir: Path,
    sections: Sequence[str] = SECTIONS,
    methods: Sequence[str] | None = None,
    shapes: Sequence[str] = ("smollm2", "llama8b"),
    sizes: Sequence[int] = DEFAULT_SIZES,
    compression_ratio: float = 0.5,
    repeats: int = 3,
    block: int = 128,
    max_seconds: float = 30.0,
    stream: str = "native",
    decode_context: int = 8192,
    decode_kept: Sequence[float] = (0.25, 0.5),
    decode_tokens: int = 32,
    step_shape: str = "llama8b",
    step_contexts: Sequence[int] = (8192, 32768),
    step_repeats: int = 50,
    memory_method: str = "keydiff",
    memory_sizes: Sequence[int] = (2048, 4096, 8192, 16384),
    memory_budget: int = 1024,
    memory_modes: Sequence[str] = ("chunked", "prefill"),
    chunk_size: int = 128,
    threads: int | None = None,
    model_path: str | None = None,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, list[dict]]:
    """Run the chosen sections, writing <section>.csv, machine.txt, bench.md and PNGs into out_dir; returns the rows of every CSV there.

    Sections already in out_dir from an earlier run stay in the report (rerun a section to replace it).
    """
    from ..api import methods as all_methods

    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise ValueError(f"sections must be among {SECTIONS}, got {unknown}")
    bad_shapes = [s for s in (*shapes, step_shape) if s not in SHAPES]
    if bad_shapes:
        raise ValueError(f"shapes must be among {sorted(SHAPES)}, got {bad_shapes}")
    methods = list(all_methods() if methods is None else methods)
    missing = [m for m in (*methods, memory_method) if m not in all_methods()]
    if missing:
        raise ValueError(f"unknown method(s) {missing}; known methods: {', '.join(all_methods())}")
    if threads is not None:
        _check_positive("threads", threads)
        torch.set_num_threads(threads)
    machine = machine_description(torch.get_num_threads())
    log(machine)
    out_dir = Path(out_dir)
    results: dict[str, list[dict]] = {}

    def saver(name: str) -> Callable[[list[dict]], None]:
        return lambda rows: write_csv(rows, out_dir / f"{name}.csv")

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "machine.txt").write_text(machine + "\n")
    if "overhead" in sections:
        rows = overhead_rows(methods, [SHAPES[s] for s in shapes], sizes, compression_ratio, repeats, block, max_seconds, stream, seed, log,
                             saver("overhead"))
        results["overhead"] = rows
    if "attention" in sections:
        results["attention"] = attention_step_rows(SHAPES[step_shape], step_contexts, decode_kept, step_repeats, seed, log)
        write_csv(results["attention"], out_dir / "attention.csv")
    model = tokenizer = None
    if "decode" in sections or "memory" in sections:
        from ..integration import load_model

        model, tokenizer = load_model(model_path)
    if "decode" in sections:
        results["decode"] = decode_rows(model, tokenizer, methods, decode_context, decode_kept, decode_tokens, seed, log, saver("decode"))
    if "memory" in sections:
        results["memory"] = memory_rows(model, tokenizer, memory_method, memory_sizes, memory_budget, chunk_size, memory_modes, log, saver("memory"))
    return report(out_dir)
