"""Attention-approximation bench on real q/k/v of a real model.

The protocol of App. B.1 of "BalanceKV: KV Cache Compression through Discrepancy Theory",
arXiv:2502.07861 (sinks and the last queries exact, the middle compressed).

For each chosen layer: capture post-RoPE (q, k, v) of n tokens of real prose
(`eval.capture.capture_qkv`, `eval.capture.prose_text`). The targets are the last `n_queries`
queries j ∈ [n − n_queries, n). Each method keeps the first `sink` tokens and the last
`n_queries` tokens exactly (the window; query j sees only window tokens ≤ j) and compresses the
middle [sink, n − n_queries) to a fraction (1 − ratio) of its length, so `ratio` is the rate at
which the middle is compressed (the paper's 2^−T ∈ {1/2, 1/4, 1/8, 1/16} is ratio 0.5 … 0.9375).
Query-aware methods see every query of the prefix, as in prefill compression; Compactor gets the
pre-RoPE keys the integration would give it.

Error of query j in query head h: ‖z_j − Attn_j‖ / ‖Attn_j‖ (z from `weighted_attention` over
the summary, Attn from `exact_attention` over all keys, causal); a run's error is the mean over
queries and heads; each (method, ratio, layer) repeats over `seeds` random seeds and reports the
mean and standard deviation over them (zero for deterministic methods).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..api import compress
from ..attention import exact_attention, weighted_attention
from ..checks import check_distinct
from ..methods.budget import tokens_kept
from ..methods.registry import build_method, method_names
from ..model_support import RotaryInverse, attention_scales
from ..names import APPROX_LAYERS as DEFAULT_APPROX_LAYERS
from ..names import APPROX_RATIOS as DEFAULT_APPROX_RATIOS
from .capture import capture_qkv, prose_text
from .runner import check_lengths_fit
from .tables import markdown_table, write_csv


@dataclass
class ApproxConfig:
    """methods None means every registered method. tokens: prompt length n; text_seed shuffles the prose."""

    methods: list[str] | None = None
    ratios: list[float] = field(default_factory=lambda: list(DEFAULT_APPROX_RATIOS))
    layers: list[int] = field(default_factory=lambda: list(DEFAULT_APPROX_LAYERS))
    tokens: int = 2048
    n_queries: int = 256
    sink: int = 256
    seeds: int = 10
    text_seed: int = 0

    def __post_init__(self):
        if self.methods is None:
            self.methods = method_names()
        bad = [m for m in self.methods if m not in method_names()]
        if bad:
            raise ValueError(f"methods must be among {method_names()}, got {bad}")
        for r in self.ratios:
            if not 0.0 <= r < 1.0:
                raise ValueError(f"ratios must lie in [0, 1), got {r}")
        for name in ("methods", "ratios", "layers"):
            check_distinct(name, getattr(self, name))
        if self.n_queries < 1 or self.sink < 0:
            raise ValueError(f"n_queries must be >= 1 and sink >= 0, got {self.n_queries}, {self.sink}")
        if self.tokens <= self.sink + self.n_queries:
            raise ValueError(f"tokens must exceed sink + n_queries = {self.sink + self.n_queries}, got {self.tokens}")
        if self.seeds < 1:
            raise ValueError(f"seeds must be >= 1, got {self.seeds}")


def per_query_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """Mean over batch, heads and queries of ‖approx_j − exact_j‖ / ‖exact_j‖ ([B,H,q,d] each), in float64."""
    num = (approx.double() - exact.double()).norm(dim=-1)
    return float((num / exact.double().norm(dim=-1).clamp_min(1e-300)).mean())


def layer_errors(method: str, queries, keys, values, scale: float, config: ApproxConfig, pre_rope_keys=None,
                 layer_idx: int | None = None, num_layers: int | None = None, **method_params) -> dict[float, list[float]]:
    """{ratio: [error per seed]} for one layer's captured q/k/v ([1,H,n,d]); layer_idx / num_layers for layer-aware budgets (PyramidKV);
    method_params go to the method."""
    n = keys.shape[2]
    middle = n - config.sink - config.n_queries
    targets = queries[:, :, n - config.n_queries :]
    qpos = torch.arange(n - config.n_queries, n)
    exact = exact_attention(targets, keys, values, scale=scale, causal_offset=n - config.n_queries)
    out = {}
    for ratio in config.ratios:
        budget = max(1, tokens_kept(middle, ratio))
        errs = []
        for seed in range(config.seeds):
            summary = compress(
                method, keys, values, queries=queries, pre_rope_keys=pre_rope_keys, budget=budget,
                sink=config.sink, window=config.n_queries, seed=seed, scale=scale, layer=(layer_idx, num_layers) if layer_idx is not None else None,
                **method_params,
            )
            errs.append(per_query_error(weighted_attention(targets, summary, scale=scale, query_positions=qpos), exact))
        out[ratio] = errs
    return out


def run_approx(model, tokenizer, config: ApproxConfig, progress: bool = True) -> list[dict]:
    """Rows {method, ratio, layer, tokens, seeds, error_mean, error_std, seconds} for every method × ratio × layer."""
    check_lengths_fit(model, [config.tokens], "tokens")
    text = prose_text(n_chars=8 * config.tokens, seed=config.text_seed)
    captured = capture_qkv(model, tokenizer, text, layers=config.layers, max_tokens=config.tokens)
    n = next(iter(captured.values()))[1].shape[2]
    if n < config.tokens:
        raise ValueError(f"the prose gave only {n} tokens, fewer than tokens={config.tokens}")
    scales = attention_scales(model)
    rows = []
    bar = tqdm(total=len(config.methods) * len(captured), desc="approx", unit="method-layer", disable=not progress)
    for method in config.methods:
        unrotate = RotaryInverse(model) if build_method(method).requirements.needs("pre_rope_keys") else None
        for layer, (q, k, v) in captured.items():
            start = time.perf_counter()
            pre = unrotate(k, torch.arange(n)) if unrotate is not None else None
            errors = layer_errors(method, q, k, v, scales[layer], config, pre_rope_keys=pre, layer_idx=layer,
                                  num_layers=model.config.num_hidden_layers)
            seconds = (time.perf_counter() - start) / (len(config.ratios) * config.seeds)
            for ratio, errs in errors.items():
                t = torch.tensor(errs, dtype=torch.float64)
                std = float(t.std()) if len(errs) > 1 else 0.0
                rows.append({"method": method, "ratio": ratio, "layer": layer, "tokens": n, "seeds": len(errs),
                             "error_mean": float(t.mean()), "error_std": std, "seconds": seconds})
            bar.update(1)
    bar.close()
    return rows


APPROX_FIELDS = ["method", "ratio", "layer", "tokens", "seeds", "error_mean", "error_std", "seconds"]


def write_approx(rows: list[dict], out_dir: str | Path, config: ApproxConfig | None = None) -> tuple[Path, Path]:
    """`approx.csv` (every row) and `approx.md` (mean ± std per method × ratio, one column per layer, and
    with several layers a last column: the mean over the layers, each method's error at that memory), after a line of
    the run's settings when `config` is given (the prose, its length, the queries, the sink, the seeds). Both replace
    an earlier run's."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out / "approx.csv", out / "approx.md"
    write_csv(csv_path, rows, APPROX_FIELDS)
    layers = sorted({r["layer"] for r in rows})
    cells = {(r["method"], r["ratio"], r["layer"]): r for r in rows}
    with_mean = len(layers) > 1
    head = ["method", "ratio"] + [f"layer {layer}" for layer in layers] + (["mean over layers"] if with_mean else [])
    table = []
    for method, ratio in dict.fromkeys((r["method"], r["ratio"]) for r in rows):
        vals = [cells.get((method, ratio, layer)) for layer in layers]
        mean = [f"{sum(c['error_mean'] for c in vals) / len(vals):.3f}" if all(vals) else ""] if with_mean else []
        table.append(dict(zip(head, [method, f"{ratio:g}"] + [f"{c['error_mean']:.3f} ± {c['error_std']:.3f}" if c else "" for c in vals] + mean)))
    settings = "" if config is None else (f"Text seed {config.text_seed}, {config.tokens} tokens, the last {config.n_queries} "
                                          f"as queries, a sink of {config.sink}, {config.seeds} seeds per cell.\n\n")
    md_path.write_text(settings + markdown_table(table, head) + "\n", encoding="utf-8")
    return csv_path, md_path
