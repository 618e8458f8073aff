"""Compression overhead: each method's one-shot `compress` (and natively streaming methods' updates) timed against one exact causal attention pass over the same n tokens; growth exponents."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ...methods.budget import tokens_kept
from .common import Shape, add_row, fit_exponent, save_figure, subplots, synthetic_layer, time_calls
from .config import BenchConfig


def exact_attention_pass(layer: dict[str, torch.Tensor]) -> torch.Tensor:
    """One exact causal attention pass of every query over the layer's n tokens (SDPA, grouped-query)."""
    return F.scaled_dot_product_attention(layer["queries"], layer["keys"], layer["values"], is_causal=True, enable_gqa=True)


def natively_streaming(method: str) -> bool:
    """True when the method has its own streaming state (not the block-wise replay of its one-shot form)."""
    from ...methods.base import Method
    from ...methods.registry import build_method

    built = build_method(method)
    return type(built).new_stream is not Method.new_stream and "chunked" in built.requirements.modes  # KVzip's new_stream only refuses


def method_inputs(method: str, layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The optional inputs the method needs: queries, pre-RoPE keys, hidden states."""
    from ...methods.registry import build_method

    needs = build_method(method).requirements.needs
    out = {}
    if needs("queries"):
        out["queries"] = layer["queries"]
    if needs("pre_rope_keys"):
        out["pre_rope_keys"] = layer["pre_rope_keys"]
    if needs("hidden_states"):
        out["hidden_states"] = layer["hidden_states"]
    return out


def unfit_reason(method: str, shape: Shape) -> str | None:
    """Why `method` cannot run on a synthetic layer of `shape`, or None when it can. A learned scorer (KVzap's) reads
    the hidden states of the model it was trained on, so the shipped one runs on that model's shape only."""
    from ...methods.registry import build_method

    surrogate = getattr(build_method(method), "surrogate", None)
    width = shape.query_heads * shape.head_dim
    if surrogate is None or surrogate.reads(shape.kv_heads, width):
        return None
    return (f"its scorer, trained on {surrogate.model}, reads hidden states of width {surrogate.input_width} for "
            f"{surrogate.kv_heads} KV heads; shape {shape.name} has width {width} and {shape.kv_heads} KV heads")


def kept_budget(n: int, compression_ratio: float) -> int:
    """Slots kept per head when `compression_ratio` of n tokens is removed (at least 1)."""
    return max(1, tokens_kept(n, compression_ratio))


# The timed layer is the only layer of its model, so a method whose budget depends on the depth (PyramidKV) keeps the same budget as the others.
ONE_LAYER = (0, 1)


def one_shot(method: str, layer: dict[str, torch.Tensor], compression_ratio: float, seed: int) -> Callable[[], object]:
    """A call compressing the whole layer once with `kvc.compress` (sink = window = 0: every token goes through the method)."""
    from ...api import compress

    budget = kept_budget(layer["keys"].shape[2], compression_ratio)
    extra = method_inputs(method, layer)
    return lambda: compress(method, layer["keys"], layer["values"], budget=budget, sink=0, window=0, seed=seed, layer=ONE_LAYER, **extra)


def streamed(method: str, layer: dict[str, torch.Tensor], compression_ratio: float, block: int, seed: int,
             slack: float | None = None) -> Callable[[], object]:
    """A call feeding the layer to a fresh `kvc.stream` (sink = window = 0, re-compression `slack`:
    None is the default) in blocks of `block` tokens, each with its own queries, then compacting it
    (the room it reserves for later blocks given back: it ends with at most the budget, as one-shot
    compression keeps); the call returns the stream."""
    from ...api import stream

    n = layer["keys"].shape[2]
    budget = kept_budget(n, compression_ratio)
    extra = method_inputs(method, layer)

    def run():
        st = stream(method, budget=budget, sink=0, window=0, seed=seed, slack=slack)
        for start in range(0, n, block):
            part = {k: v[:, :, start : start + block] for k, v in extra.items()}
            st.update(layer["keys"][:, :, start : start + block], layer["values"][:, :, start : start + block], **part,
                      layer_idx=ONE_LAYER[0], num_layers=ONE_LAYER[1])
        st.compact()
        return st

    return run


def _timing_row(shape: Shape, n: int, method: str, kind: str, times: list[float], exact: list[float] | None) -> dict:
    row = {"shape": shape.name, "n": n, "method": method, "kind": kind, "repeats": len(times),
           "min_s": min(times), "median_s": statistics.median(times)}
    if exact is not None:
        row["ratio_min"] = row["min_s"] / min(exact)
        row["ratio_median"] = row["median_s"] / statistics.median(exact)
    return row


def has_stream(method: str) -> bool:
    """Whether the method has a stream (a prefill-only method, KVzip, has none)."""
    from ...methods.registry import build_method

    return "chunked" in build_method(method).requirements.modes


def overhead_rows(config: BenchConfig, log: Callable[[str], None] = print, on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Rows {shape, n, method, kind (exact|compress|stream), repeats, min_s, median_s, ratio_min, ratio_median,
    ratio_removed} for config's methods, shapes and sizes.

    Every method gets the same job: keep ceil((1 - compression_ratio)·n) of the n tokens per
    head, with no exact sink or window (so the time is the method's own work on all n tokens).
    config.stream: "native" times the updates of natively streaming methods, "all" of every method
    (block-wise replay included), "none" skips streaming. Repeats of one measurement stop once
    they have taken max_seconds; a measurement whose single call took longer than max_seconds
    is not run at larger n (a row with skipped=True and no times records it), and neither is
    anything of a shape whose exact pass did. A method that cannot run on a shape (`unfit_reason`) gets a row
    with skipped set to the reason, at every n. The synthetic tensors are created on config's device in its dtype.
    """
    jobs = []
    for method in config.methods:
        jobs.append((method, "compress"))
        if (config.stream == "all" and has_stream(method)) or (config.stream == "native" and natively_streaming(method)):
            jobs.append((method, "stream"))
    rows: list[dict] = []

    def add(row: dict) -> None:  # every row records the share removed
        add_row(rows, on_row, {**row, "ratio_removed": config.compression_ratio})

    for shape in config.shapes:
        too_slow: set[tuple[str, str]] = set()
        reasons = {method: unfit_reason(method, shape) for method in config.methods}  # None: measured
        for method, reason in reasons.items():
            if reason is not None:
                log(f"{shape.name}: {method} not measured: {reason}")
        for n in sorted(config.sizes):
            if ("exact", "exact") in too_slow:
                too_slow.update(jobs)
                for m, k in (("exact", "exact"), *jobs):  # a method that cannot run on the shape keeps its reason
                    add({"shape": shape.name, "n": n, "method": m, "kind": k, "skipped": reasons.get(m) or True})
                continue
            layer = synthetic_layer(shape, n, torch.Generator().manual_seed(config.seed + n), config.dtype, config.device)
            exact = time_calls(lambda: exact_attention_pass(layer), config.repeats, config.max_seconds, config.device)
            add(_timing_row(shape, n, "exact", "exact", exact, None))
            log(f"{shape.name} n={n}: exact attention {min(exact):.3f}s")
            for method, kind in jobs:
                if reasons[method] is not None:
                    add({"shape": shape.name, "n": n, "method": method, "kind": kind, "skipped": reasons[method]})
                    continue
                if (method, kind) in too_slow:
                    add({"shape": shape.name, "n": n, "method": method, "kind": kind, "skipped": True})
                    continue
                if kind == "compress":
                    fn = one_shot(method, layer, config.compression_ratio, config.seed)
                else:
                    fn = streamed(method, layer, config.compression_ratio, config.block, config.seed)
                times = time_calls(fn, config.repeats, config.max_seconds, config.device)
                add(_timing_row(shape, n, method, kind, times, exact))
                log(f"{shape.name} n={n}: {method} {kind} {min(times):.3f}s = {rows[-1]['ratio_min']:.3f}x exact")
                if min(times) > config.max_seconds:
                    too_slow.add((method, kind))
            if min(exact) > config.max_seconds:
                too_slow.add(("exact", "exact"))
    return rows


EXPONENT_COLUMNS = ["shape", "method", "kind", "n_min", "n_max", "time_exponent", "ratio_exponent"]


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


def overhead_pivot(rows: Sequence[dict], shape: str, kind: str) -> list[dict]:
    """{method, ratio at each n} for one shape and kind (compress/stream): min-of-repeats ratios to exact attention;
    "skipped" past the per-call limit, "n/a" where the method cannot run on the shape (`unfit_reasons`)."""
    table: dict[str, dict] = {}
    for r in rows:
        if r["shape"] == shape and r["kind"] == kind:
            skipped = r.get("skipped")
            cell = f"{r['ratio_min']:.3g}" if not skipped else "skipped" if skipped is True else "n/a"
            table.setdefault(r["method"], {"method": r["method"]})[f"n={r['n']}"] = cell
    return list(table.values())


def unfit_reasons(rows: Sequence[dict], shape: str) -> dict[str, str]:
    """{method: why it cannot run on `shape`} for the rows skipped for that reason (`unfit_reason`)."""
    return {r["method"]: r["skipped"] for r in rows if r["shape"] == shape and isinstance(r.get("skipped"), str)}


def plot_overhead(rows: Sequence[dict], path: Path) -> None:
    """Ratio to exact attention vs n (log-log), one panel per shape; solid compress, dashed stream."""
    import matplotlib

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = subplots(len(shapes), (7 * len(shapes), 5))
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
    save_figure(fig, path)
