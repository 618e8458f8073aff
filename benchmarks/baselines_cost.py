"""Compression cost of H2O and SubGen against one exact causal attention pass, and SubGen's streaming throughput.

One process, one thread, synthetic tensors of the default model's shapes (`eval.bench.SHAPES`,
`eval.bench.synthetic_layer`): for each n, the exact causal SDPA pass over n tokens, then each
method keeping half of the n tokens (no sink or window), one-shot (`kvc.compress`) and streamed
(`kvc.stream`, blocks of 128 with their own queries); min over repeats, ratio to the exact pass
of the same n; the time exponent a of time ≈ c·n^a fitted over the sizes. Streaming throughput:
tokens absorbed per second on the Llama-8B-like shape (H_kv = 8, d = 128), SubGen and H2O
against KeyDiff in the same run. Writes benchmarks/results/baselines_cost.{csv,md}.

    PYTHONPATH=. python benchmarks/baselines_cost.py [--sizes 1024 2048 4096 8192 16384]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvcompress.eval.bench import SHAPES, exact_attention_pass, fit_exponent, machine_description, one_shot, streamed, synthetic_layer, time_calls
from kvcompress.eval.tables import write_csv

RESULTS = Path(__file__).parent / "results"
METHODS = ("h2o", "subgen", "keydiff")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=20.0, help="stop repeating a measurement once it has taken this long")
    parser.add_argument("--throughput-tokens", type=int, default=8192)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.machine = machine_description(1)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for n in args.sizes:
        layer = synthetic_layer(SHAPES["smollm2"], n, generator)
        exact = min(time_calls(lambda: exact_attention_pass(layer), args.repeats, args.max_seconds))
        rows.append({"shape": "smollm2", "n": n, "method": "exact", "kind": "exact", "min_s": exact, "ratio": 1.0})
        for method in METHODS:
            for kind, call in (("one-shot", one_shot(method, layer, 0.5, 0)), ("stream", streamed(method, layer, 0.5, 128, 0))):
                t = min(time_calls(call, args.repeats, args.max_seconds))
                rows.append({"shape": "smollm2", "n": n, "method": method, "kind": kind, "min_s": t, "ratio": t / exact})
                print(rows[-1], flush=True)
    n = args.throughput_tokens
    big = synthetic_layer(SHAPES["llama8b"], n, generator)
    for method in METHODS:
        t = min(time_calls(streamed(method, big, 0.5, 128, 0), args.repeats, args.max_seconds))
        rows.append({"shape": "llama8b", "n": n, "method": method, "kind": "throughput", "min_s": t, "ratio": n / t})
        print(rows[-1], flush=True)
    RESULTS.mkdir(exist_ok=True)
    write_csv(RESULTS / "baselines_cost.csv", rows)
    write_markdown(rows, args)


def write_markdown(rows: list[dict], args) -> None:
    sizes = args.sizes
    lines = [
        "# H2O and SubGen: compression time ÷ one exact causal attention pass",
        "",
        f"Machine: {args.machine} (shared with other jobs: noisy). Default model's shape (3 KV heads, 9 query heads, "
        f"d = 64), half of n kept, no sink/window, min of up to {args.repeats} repeats; ratios taken within one run.",
        "",
        "| method | kind | " + " | ".join(f"n={n}" for n in sizes) + " | time exponent |",
        "|---|---|" + "---|" * (len(sizes) + 1),
    ]
    exact = [r for r in rows if r["kind"] == "exact"]
    lines.append("| exact | SDPA seconds | " + " | ".join(f"{r['min_s']:.3g}s" for r in exact) +
                 f" | {fit_exponent([r['n'] for r in exact], [r['min_s'] for r in exact])[0]:.2f} |")
    for method in METHODS:
        for kind in ("one-shot", "stream"):
            sel = [r for r in rows if r["method"] == method and r["kind"] == kind and r["shape"] == "smollm2"]
            a = fit_exponent([r["n"] for r in sel], [r["min_s"] for r in sel])[0]
            lines.append(f"| {method} | {kind} | " + " | ".join(f"{r['ratio']:.3f}" for r in sel) + f" | {a:.2f} |")
    thr = {r["method"]: r["ratio"] for r in rows if r["kind"] == "throughput"}
    lines += ["", f"Streaming throughput, H_kv = 8, d = 128, {args.throughput_tokens} tokens in blocks of 128, half kept (tokens/s):", "",
              "| method | tokens/s | ÷ KeyDiff |", "|---|---|---|"]
    lines += [f"| {m} | {thr[m]:.0f} | {thr[m] / thr['keydiff']:.2f} |" for m in METHODS]
    (RESULTS / "baselines_cost.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
