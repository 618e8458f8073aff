"""Decode speed: greedy tokens/s on a real model over one long context (full cache vs each method), and the attention-only decode step on synthetic tensors."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .common import add_row, context_ids, save_figure, subplots, synthetic_layer, time_calls
from .config import BenchConfig


def decode_prompt(tokenizer, config: BenchConfig) -> tuple:
    """(context ids [1, n], question ids [1, m]) of the decode run: config.decode_context tokens of real prose in the chat
    template, then the question."""
    from ...integration import build_prompt

    text = tokenizer.decode(context_ids(tokenizer, config.decode_context)[0])
    return build_prompt(tokenizer, text, "Summarise the text above in one sentence.")


def check_decode_fits(model, tokenizer, config: BenchConfig) -> None:
    """ValueError naming --decode-context and --decode-tokens when the decode run's prompt and answer need more positions than
    the model has (`check_context_length`), before anything is measured."""
    from ...integration.model import check_context_length

    ctx, question = decode_prompt(tokenizer, config)
    try:
        check_context_length(model, ctx.shape[1] + question.shape[1], config.decode_tokens)
    except ValueError as err:
        raise ValueError(f"--decode-context {config.decode_context} with --decode-tokens {config.decode_tokens} (the chat template "
                         f"and question add {ctx.shape[1] + question.shape[1] - config.decode_context} tokens): {err}") from None


def decode_rows(model, tokenizer, config: BenchConfig, log: Callable[[str], None] = print,
                on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Rows {model, method, kept, context_tokens, new_tokens, decode_s, tokens_per_s, speedup, kv_bytes, kv_bytes_full} for config's
    methods at each kept fraction (model: the checkpoint's folder or file name).

    The context (real prose, config.decode_context tokens plus the chat template) is prefilled once
    and every method compresses its own copy (prefill mode, question appended exactly); then
    config.decode_tokens greedy tokens are decoded without stopping at EOS. speedup is tokens/s over
    the full cache's tokens/s (full cache: transformers' DynamicCache and SDPA).
    """
    from ...integration import generate_ids
    from ..capture import capture_qkv

    new_tokens = config.decode_tokens
    ctx, question = decode_prompt(tokenizer, config)
    log(f"decode: context {ctx.shape[1]} tokens, question {question.shape[1]} tokens, {new_tokens} new tokens")
    prefill = capture_qkv(model, ctx)
    common = {"max_new_tokens": new_tokens, "stop_at_eos": False}
    full = generate_ids(model, ctx, question, method=None, **common)  # draws nothing: no seed
    rows: list[dict] = []
    name = Path(getattr(model.config, "_name_or_path", "") or "").name
    add_row(rows, on_row, _decode_row(full, 1.0, full, name))
    log(f"decode full: {full.decode_tokens_per_second:.2f} tokens/s")
    for method in config.methods:
        for k in config.kept:
            res = generate_ids(model, ctx, question, method=method, compression_ratio=1.0 - k, prefill=prefill, seed=config.seed,
                               **common)
            add_row(rows, on_row, _decode_row(res, k, full, name))
            log(f"decode {method} kept={k}: {res.decode_tokens_per_second:.2f} tokens/s = {rows[-1]['speedup']:.2f}x full")
    return rows


def _decode_row(res, kept: float, full, model_name: str) -> dict:
    # kept_realised: what the compressed layers hold of the prompt and answer, their exact sink, window, question and
    # answer included; a short context keeps more than `kept` asks
    return {"model": model_name, "method": res.method, "kept": kept, "kept_realised": round(1.0 - res.realised_compression_ratio, 4),
            "context_tokens": res.context_tokens, "new_tokens": len(res.token_ids),
            "decode_s": res.decode_seconds, "tokens_per_s": res.decode_tokens_per_second,
            "speedup": res.decode_tokens_per_second / full.decode_tokens_per_second,
            "kv_bytes": res.kv_bytes, "kv_bytes_full": res.kv_bytes_full}


def attention_step_rows(config: BenchConfig, log: Callable[[str], None] = print) -> list[dict]:
    """Rows {shape, context, path, kept, slots, min_s, median_s, speedup} for one decode step's attention on
    config.step_shape at each of step_contexts (tensors on config's device in its dtype, step_repeats calls).

    path "sdpa": one query over the full n keys with SDPA (the full cache's step);
    "weighted": `weighted_attention` over the full n (same code path as compressed, kept=1) and
    over kept·n slots (the compressed cache's step). speedup is the full SDPA time over the row's
    time (minimum over repeats).
    """
    from ...attention import weighted_attention
    from ...summary import KVSummary

    shape, repeats, device = config.step_shape, config.step_repeats, config.device
    rows = []
    for n in config.step_contexts:
        layer = synthetic_layer(shape, n, torch.Generator().manual_seed(config.seed + n), config.dtype, device)
        q = layer["queries"][:, :, -1:]
        full = time_calls(lambda: F.scaled_dot_product_attention(q, layer["keys"], layer["values"], enable_gqa=True), repeats, device=device)
        cases = [("sdpa", 1.0, full)]
        for k in (1.0, *config.kept):
            m = max(1, round(k * n))
            summary = KVSummary.exact(layer["keys"][:, :, :m], layer["values"][:, :, :m], torch.arange(m, device=device))
            cases.append(("weighted", k, time_calls(lambda: weighted_attention(q, summary), repeats, device=device)))
        for path, k, times in cases:
            rows.append({"shape": shape.name, "context": n, "path": path, "kept": k, "slots": max(1, round(k * n)),
                         "min_s": min(times), "median_s": statistics.median(times), "speedup": min(full) / min(times)})
            log(f"attention step {shape.name} n={n} {path} kept={k}: {min(times) * 1e3:.3f} ms = {rows[-1]['speedup']:.2f}x faster than full")
    return rows


def _tokens(n: int) -> str:
    """A context length for a label: 4k for 4096, 1536 for 1536."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def plot_decode(decode: Sequence[dict], step: Sequence[dict], path: Path) -> None:
    """A panel of decode tokens/s over the full cache's per method and kept fraction, and one of attention-step speed-ups (those with rows)."""
    panels = [(kind, rows) for kind, rows in (("decode", decode), ("step", step)) if rows]
    fig, axes = subplots(len(panels), (7 * len(panels), 5))
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
            model = f"{rows[0]['model']}, " if rows[0].get("model") else ""  # a record without the column: no name
            ax.set_title(f"greedy decoding, {model}{rows[0]['context_tokens']}-token context")
            ax.legend()
        else:
            labels = [f"{_tokens(r['context'])} {r['path']} {r['kept']:.0%}" for r in rows]
            ax.bar(np.arange(len(rows)), [r["speedup"] for r in rows])
            ax.set_xticks(np.arange(len(rows)), labels, rotation=45, ha="right")
            ax.set_ylabel("full-cache SDPA step time / step time")
            ax.set_title(f"attention-only decode step, {rows[0]['shape']} shape")
        ax.axhline(1.0, color="black", linewidth=1)
    save_figure(fig, path)
