"""Before/after H2O's fused prefill kernel on the default model's own q/k/v, one process (issue 17).

`integration.attention.causal_attention_with_mass` is the attention of H2O's prefill: SDPA's output
plus every key's received mass. This script captures the q/k/v of every layer of one `--tokens`
prefill of real prose (the bench's context), then, layer by layer, times SDPA's causal pass and the
kernel of two kvcompress trees (`--before`: a plain export of the baseline commit; `--after`: this
tree), taking turns with the order reversed every other round, min of `--rounds`. It reports the
kernels' time over SDPA's summed over the layers, and what the change does to H2O's choice: the
largest relative difference between the two masses and the share of the tokens each kernel's mass
ranks in its top (1 - `--ratio`) per head that the other ranks there too.

    PYTHONPATH=benchmarks:. python benchmarks/h2o_kernel_ab.py --before /tmp/base --threads 2
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from stream_throughput_ab import VARIANTS, ab_parser, evict, report


def kernel_of(path: Path):
    """`causal_attention_with_mass` of the kvcompress package under `path` (evicting any loaded one first)."""
    evict()
    sys.path.insert(0, str(path))
    try:
        return importlib.import_module("kvcompress.integration.attention").causal_attention_with_mass
    finally:
        sys.path.remove(str(path))


def main() -> None:
    parser = ab_parser(__doc__.splitlines()[0], "h2o_kernel_ab.md", rounds=3)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--ratio", type=float, default=0.75, help="share of the context removed (for the top-k comparison)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = {variant: kernel_of(getattr(args, variant)) for variant in VARIANTS}
    from kvcompress.cache import attention_scales
    from kvcompress.eval.bench import context_ids, machine_description
    from kvcompress.eval.capture import capture_qkv
    from kvcompress.integration.model import load_model

    model, tokenizer = load_model()
    layers = capture_qkv(model, context_ids(tokenizer, args.tokens))
    scales = attention_scales(model)
    seconds = {name: 0.0 for name in ("sdpa", *VARIANTS)}
    kept = budget_total = 0
    largest = 0.0
    with torch.inference_mode():
        for layer, (q, k, v) in layers.items():
            calls = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scales[layer], enable_gqa=True)}
            calls |= {variant: (lambda kernel=kernels[variant]: kernel(q, k, v, scales[layer])) for variant in VARIANTS}
            best = {name: float("inf") for name in calls}
            for i in range(args.rounds):
                for name in calls if i % 2 == 0 else list(calls)[::-1]:
                    start = time.perf_counter()
                    calls[name]()
                    best[name] = min(best[name], time.perf_counter() - start)
            for name, value in best.items():
                seconds[name] += value
            before, after = (calls[variant]()[1] for variant in VARIANTS)
            largest = max(largest, float(((after - before).abs() / before.abs()).max()))
            budget = round((1.0 - args.ratio) * k.shape[2])
            top_before, top_after = (mass.topk(budget, -1).indices for mass in (before, after))
            same = (top_before.unsqueeze(-1) == top_after.unsqueeze(-2)).any(-1)
            kept += int(same.sum())
            budget_total += same.numel()
    lines = [
        f"# H2O's fused prefill kernel, before/after, one process\n\nMachine: {machine_description(args.threads)}.\n",
        f"Default model's q/k/v of {args.tokens} tokens of real prose, {len(layers)} layers; min of {args.rounds} interleaved rounds "
        f"per layer, summed over the layers; before = `{args.before}`, after = `{args.after}`.\n",
        "| kernel | seconds | over SDPA (s) |",
        "|---|---|---|",
        f"| SDPA (causal) | {seconds['sdpa']:.3f} | 0 |",
        *(f"| {variant} | {seconds[variant]:.3f} | {seconds[variant] - seconds['sdpa']:.3f} |" for variant in VARIANTS),
        "",
        f"Largest relative difference between the two masses: {largest:.2e}. Tokens in both kernels' top "
        f"{1 - args.ratio:g} per head: {kept} of {budget_total} ({kept / budget_total:.4%}).",
    ]
    report("\n".join(lines) + "\n", args.out, "h2o_kernel_ab.md")


if __name__ == "__main__":
    main()
