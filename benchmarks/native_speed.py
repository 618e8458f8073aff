"""Native-precision speed: kvcompress's cache and attention against plain transformers SDPA (issue 13).

Default model run (all ratios measured in one process, one thread count, plain and kvcompress
interleaved, min over repeats):
- prefill_ratio: a ratio-0 prefill through CompressedCache + the 'kvcompress' attention, over a
  plain prefill (DynamicCache + 'sdpa'); target <= 1.05;
- full_decode_ratio: full-cache decode tokens/s through kvcompress (the ratio-0 cache) over plain
  SDPA decode; target >= 0.95;
- kept_speedup: decode tokens/s with `--kept` of the context kept (a query-free eviction method
  compressing the ratio-0 cache's own keys) over plain full-cache decode; target >= 1.5 at 16k.

Contexts are real prose. The default model has 8192 positions: for longer contexts its
`max_position_embeddings` is raised in this process only, so those rows measure speed, not
quality (RoPE beyond the trained length).

`--llama8b` instead decodes a randomly initialised Llama-3-8B-shaped model (32 layers, 32 query
heads, 8 KV heads, head dim 128) at `--contexts` (default 32768): tokens/s and peak device
memory while decoding for the full cache and for each `--kept-fractions`. It is meant for a GPU
(`--device cuda --dtype bfloat16`).

    PYTHONPATH=. nice -n 10 python benchmarks/native_speed.py --threads 1
    PYTHONPATH=. python benchmarks/native_speed.py --llama8b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from kvcompress.cache import CompressedCache
from kvcompress.options import CompressionOptions
from kvcompress.eval.bench import context_ids, machine_description
from kvcompress.eval.tables import markdown_table, write_csv
from kvcompress.integration import load_model, use_compressed_attention
from kvcompress.integration.model import parse_device, parse_dtype
from kvcompress.methods.budget import resolve_budget
from kvcompress.methods.registry import build_method

SINK, WINDOW = 4, 64


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    """(result, seconds) of fn(), synchronising the device around it."""
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def plain_prefill(model, ids):
    """(DynamicCache, last logits, seconds) with transformers' own SDPA attention."""
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    out, seconds = timed(lambda: model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1), ids.device)
    return cache, out.logits[:, -1], seconds


def kvcompress_cache(model, method: str, budget: int) -> CompressedCache:
    return CompressedCache(model, CompressionOptions(method=method, mode="prefill", budget=budget, sink=SINK, window=WINDOW))


def ratio0_prefill(model, ids, method: str):
    """(CompressedCache holding every token, last logits, seconds) through the 'kvcompress' attention."""
    n = ids.shape[1]
    cache = kvcompress_cache(model, method, resolve_budget(n, None, 0.0, SINK, WINDOW))
    with use_compressed_attention(model):
        out, seconds = timed(lambda: model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1), ids.device)
    return cache, out.logits[:, -1], seconds


def compressed_copy(model, full: CompressedCache, method: str, kept: float) -> CompressedCache:
    """A prefill-mode cache keeping `kept` of the tokens of a ratio-0 cache (query-free method, no new prefill)."""
    fronts = [layer.front.summary() for layer in full.layers]
    n = fronts[0].num_slots
    budget = resolve_budget(n, None, 1.0 - kept, SINK, WINDOW)
    captured = {i: (None, f.keys, f.values) for i, f in enumerate(fronts)}
    settings = CompressionOptions(method=method, mode="prefill", budget=budget, sink=SINK, window=WINDOW)
    return CompressedCache.from_prefill(model, settings, captured)


def decode_seconds(model, cache, token: torch.Tensor, steps: int, compressed: bool) -> float:
    """Seconds per token of `steps` greedy-shaped decode steps (same token fed each step)."""

    def run():
        for _ in range(steps):
            model(token, past_key_values=cache, use_cache=True)

    if compressed:
        with use_compressed_attention(model):
            return timed(run, token.device)[1] / steps
    model.set_attn_implementation("sdpa")
    return timed(run, token.device)[1] / steps


def default_model_rows(args, log) -> list[dict]:
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    device = next(model.parameters()).device
    rows = []
    for i, n in enumerate(args.contexts):
        prefill_repeats = args.prefill_repeats[min(i, len(args.prefill_repeats) - 1)]
        if n > model.config.max_position_embeddings:
            model.config.max_position_embeddings = n  # speed-only rows: see the module docstring
        ids = context_ids(tokenizer, n).to(device)
        plain_prefill(model, ids[:, :256])  # warm-up: first calls pay allocation and dispatch setup
        ratio0_prefill(model, ids[:, :256], args.method)
        plain_s, ours_s = [], []
        for r in range(prefill_repeats):  # alternate which goes first
            for kind in ("plain", "ours") if r % 2 == 0 else ("ours", "plain"):
                if kind == "plain":
                    plain, plain_logits, s = plain_prefill(model, ids)
                    plain_s.append(s)
                else:
                    ours, ours_logits, s = ratio0_prefill(model, ids, args.method)
                    ours_s.append(s)
            log(f"n={n} prefill plain {plain_s[-1]:.2f}s kvcompress {ours_s[-1]:.2f}s")
        max_logit_diff = float((plain_logits.float() - ours_logits.float()).abs().max())
        kept = compressed_copy(model, ours, args.method, args.kept)
        token = plain_logits.argmax(-1, keepdim=True)
        best = best_decode_seconds(model, (plain, ours, kept), token, args, lambda text: log(f"n={n} decode s/token {text}"))
        rows.append({
            "context_tokens": n, "dtype": str(args.dtype).removeprefix("torch."), "device": str(device),
            "method_kept": args.method, "kept": args.kept, "prefill_repeats": prefill_repeats,
            "decode_repeats": args.repeats, "new_tokens": args.new_tokens,
            "plain_prefill_s": min(plain_s), "kvcompress_prefill_s": min(ours_s),
            "prefill_ratio": min(ours_s) / min(plain_s),
            "plain_decode_tok_s": 1 / best["plain"], "kvcompress_full_decode_tok_s": 1 / best["full"],
            "full_decode_ratio": best["plain"] / best["full"],
            "kept_decode_tok_s": 1 / best["kept"], "kept_speedup": best["plain"] / best["kept"],
            "prefill_max_logit_diff": max_logit_diff,
        })
        del plain, ours, kept
    return rows


def best_decode_seconds(model, caches, token, args, log) -> dict[str, float]:
    """Min over `args.repeats` of seconds per decoded token for the (plain, kvcompress full, kvcompress kept)
    caches, measured in turns so load drifts hit all three alike."""
    steps = {"plain": [], "full": [], "kept": []}
    for _ in range(args.repeats):
        for (name, times), cache in zip(steps.items(), caches):
            times.append(decode_seconds(model, cache, token, args.new_tokens, name != "plain"))
        log(", ".join(f"{k} {v[-1]:.4f}" for k, v in steps.items()))
    return {k: min(v) for k, v in steps.items()}


def synthetic_decode_rows(args, log) -> list[dict]:
    """Decode speed only: every layer's cache holds `n` random keys/values of the model's shape and dtype
    (decode cost does not depend on their values), so no n-token prefill is needed. Same three caches as
    `default_model_rows`: plain DynamicCache + SDPA, kvcompress at ratio 0, kvcompress keeping `--kept`."""
    model, _ = load_model(args.model, device=args.device, dtype=args.dtype)
    device = next(model.parameters()).device
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rows = []
    for n in args.contexts:
        model.config.max_position_embeddings = max(n + 64, cfg.max_position_embeddings)  # speed-only rows
        g = torch.Generator().manual_seed(n)
        captured = {}
        plain = DynamicCache(config=cfg)
        for layer in range(cfg.num_hidden_layers):
            k, v = (torch.randn(1, cfg.num_key_value_heads, n, head_dim, generator=g).to(device, args.dtype) for _ in range(2))
            plain.update(k, v, layer)
            captured[layer] = (None, k, v)
        settings = CompressionOptions(method=args.method, mode="prefill", budget=resolve_budget(n, None, 0.0, SINK, WINDOW), sink=SINK, window=WINDOW)
        ours = CompressedCache.from_prefill(model, settings, captured)
        kept = compressed_copy(model, ours, args.method, args.kept)
        del captured
        token = torch.tensor([[42]], device=device)
        best = best_decode_seconds(model, (plain, ours, kept), token, args, lambda text: log(f"n={n} synthetic decode s/token {text}"))
        rows.append({
            "context_tokens": n, "cache": "synthetic", "dtype": str(args.dtype).removeprefix("torch."), "device": str(device),
            "method_kept": args.method, "kept": args.kept, "decode_repeats": args.repeats, "new_tokens": args.new_tokens,
            "plain_decode_tok_s": 1 / best["plain"], "kvcompress_full_decode_tok_s": 1 / best["full"],
            "full_decode_ratio": best["plain"] / best["full"],
            "kept_decode_tok_s": 1 / best["kept"], "kept_speedup": best["plain"] / best["kept"],
        })
        del plain, ours, kept
    return rows


def llama8b_rows(args, log) -> list[dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=max(args.contexts),
        rope_theta=500000.0,
    )
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(args.dtype).eval()
    device = torch.device(args.device)
    rows = []
    for n in args.contexts:
        ids = torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
        for kept in (1.0, *args.kept_fractions):
            with torch.inference_mode():
                cache, logits, prefill_s = ratio0_prefill(model, ids, args.method)
                if kept < 1.0:
                    cache = compressed_copy(model, cache, args.method, kept)
                if device.type == "cuda":  # peak over decoding: weights + this cache + activations
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                token = logits.argmax(-1, keepdim=True)
                per_token = min(decode_seconds(model, cache, token, args.new_tokens, True) for _ in range(args.repeats))
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan")
            rows.append({"model": "llama3-8b-shaped (random)", "context_tokens": n, "kept": kept, "device": str(device),
                         "dtype": str(args.dtype).removeprefix("torch."), "prefill_s": prefill_s,
                         "decode_tok_s": 1 / per_token, "peak_memory_gib": peak / 2**30, "kv_gib": cache.nbytes() / 2**30})
            log(f"llama8b n={n} kept={kept}: {1 / per_token:.2f} tok/s, peak {peak / 2**30:.2f} GiB")
            del cache
    return rows


def weighted_path_rows(args, log) -> list[dict]:
    """One decode step's attention (default model's shape, 9 query / 3 KV heads x 64) over n slots of which a
    quarter are weighted: `weighted_attention` (additive log-weight bias, one SDPA call) against the
    split alternative (SDPA over the exact slots and over the weighted slots with their bias, merged by
    log-sum-exp via torch's CPU flash kernel, which returns the LSE) and against plain SDPA with no mask."""
    from kvcompress.attention import weighted_attention
    from kvcompress.summary import KVSummary

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    rows = []
    for n in args.contexts:
        g = torch.Generator().manual_seed(n)
        q = torch.randn(1, 9, 1, 64, generator=g).to(args.device, args.dtype)
        k, v = (torch.randn(1, 3, n, 64, generator=g).to(args.device, args.dtype) for _ in range(2))
        log_weights = torch.zeros(1, 3, n, device=args.device)
        log_weights[:, :, : n // 4] = math.log(4.0)
        summary = KVSummary(k, v, log_weights, torch.arange(n, device=args.device).expand(1, 3, n))
        plain = KVSummary.exact(k, v, torch.arange(n, device=args.device))
        folded = q.reshape(1, 3, 3, 64)
        w = n // 4

        def split():
            bias = log_weights[:, :, None, :w].to(args.dtype)
            out_w, lse_w = flash(folded, k[:, :, :w], v[:, :, :w], attn_mask=bias)
            out_e, lse_e = flash(folded, k[:, :, w:], v[:, :, w:])
            top = torch.maximum(lse_w, lse_e)
            a, b = (lse_w - top).exp(), (lse_e - top).exp()
            return (out_w * a[..., None] + out_e * b[..., None]) / (a + b)[..., None]

        paths = {"bias": lambda: weighted_attention(q, summary), "split_lse": split,
                 "plain_no_mask": lambda: weighted_attention(q, plain)}
        best = {}
        for name, fn in paths.items():
            fn()
            best[name] = min(timed(lambda: [fn() for _ in range(20)], q.device)[1] / 20 for _ in range(args.repeats))
        rows.append({"slots": n, "weighted_fraction": 0.25, "dtype": str(args.dtype).removeprefix("torch."),
                     **{f"{k}_us": v * 1e6 for k, v in best.items()}, "bias_over_split": best["bias"] / best["split_lse"],
                     "bias_over_plain": best["bias"] / best["plain_no_mask"]})
        log(f"weighted paths n={n}: " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in best.items()))
    return rows


def check_kept(p: argparse.ArgumentParser, args) -> None:
    """Before any model loads: each fraction kept (--kept; --kept-fractions with --llama8b) is in (0, 1], and every context
    of --contexts leaves the ratio-0 cache and each fraction kept room beyond the exact sink and window (`resolve_budget`,
    the check the caches make), so that no run fails after its timed prefills."""
    flag, fractions = ("--kept-fractions", args.kept_fractions) if args.llama8b else ("--kept", [args.kept])
    wrong = [f for f in fractions if not 0 < f <= 1]
    if wrong:
        p.error(f"{flag} takes fractions of the context kept, each in (0, 1]; got {', '.join(map(str, wrong))}")
    for n in args.contexts:
        for kept in (1.0, *fractions):
            try:
                resolve_budget(n, None, 1.0 - kept, SINK, WINDOW)
            except ValueError as error:
                p.error(f"--contexts {n} with {flag} {kept:g}: {error}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=None, help="context lengths (default 4096 16384; 32768 with --llama8b)")
    p.add_argument("--new-tokens", type=int, default=8, help="decode steps per timed repeat")
    p.add_argument("--repeats", type=int, default=3, help="decode repeats (min is reported)")
    p.add_argument("--prefill-repeats", type=int, nargs="+", default=[3, 1], help="prefill repeats for each context (the last value for the rest; min is reported)")
    p.add_argument("--kept", type=float, default=0.1, help="fraction of the context kept for kept_speedup")
    p.add_argument("--kept-fractions", type=float, nargs="+", default=[0.25, 0.1], help="--llama8b: fractions kept besides the full cache")
    p.add_argument("--method", default="keydiff", help="query-free method that compresses the ratio-0 cache")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--model", default=None, help="local checkpoint directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--llama8b", action="store_true", help="decode a random Llama-3-8B-shaped model instead (GPU)")
    p.add_argument("--synthetic-cache", action="store_true", help="decode only, over caches of random keys/values (no prefill)")
    p.add_argument("--weighted-paths", action="store_true", help="time one attention step: log-weight bias vs split + LSE merge (CPU)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/native"))
    args = p.parse_args(argv)
    runs = [("--llama8b", args.llama8b, "llama8b", llama8b_rows), ("--weighted-paths", args.weighted_paths, "weighted_paths", weighted_path_rows),
            ("--synthetic-cache", args.synthetic_cache, "synthetic_decode", synthetic_decode_rows)]
    chosen = [(name, rows) for _, given, name, rows in runs if given]
    if len(chosen) > 1:
        p.error(f"pass at most one of {', '.join(flag for flag, *_ in runs)}; got {', '.join(flag for flag, given, *_ in runs if given)}")
    name, run = chosen[0] if chosen else ("native_speed", default_model_rows)
    args.contexts = args.contexts or ([32768] if args.llama8b else [4096, 16384])
    if run is not weighted_path_rows:
        check_kept(p, args)
    torch.set_num_threads(args.threads)
    args.device = parse_device(args.device)
    args.dtype = parse_dtype(args.dtype, args.device)
    machine = machine_description(args.threads)
    log = print
    log(machine)
    with torch.inference_mode():
        rows = run(args, log)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{name}.csv", rows)
    (args.out / f"{name}.md").write_text(
        f"# {name}\n\nMachine: {machine}, device {args.device}, dtype {str(args.dtype).removeprefix('torch.')}.\n"
        f"Command: `benchmarks/native_speed.py {' '.join(argv) if argv else ''}`\n\n{markdown_table(rows)}\n"
    , encoding="utf-8")
    log(markdown_table(rows))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
