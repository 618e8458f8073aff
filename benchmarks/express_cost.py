"""What Express compression costs next to one exact attention pass (issue 17), one-shot and streamed.

Same protocol as `kvcompress bench` (eval/bench.py, whose helpers it calls): synthetic post-RoPE
tensors of a layer shape, 50% removed, sink = window = 0, one exact causal SDPA pass over the same
n tokens as the unit; streamed use feeds blocks of 128 tokens to a fresh `kvc.stream` and reads
the summary. Per n: min and median of `--repeats` calls, ratio to the exact pass's min. Fitted
time exponents (time ≈ c·n^a) over the sizes. Then streaming throughput (tokens absorbed per
second, 8k tokens, blocks of 128, Llama-8B-like shape: H_kv = 8, d = 128) of Express and KeyDiff
measured one after the other in this run.

    python benchmarks/express_cost.py [--sizes 1024 2048 4096 8192 16384] [--repeats 3] [--out DIR]
Writes DIR/express_cost.{csv,md} and DIR/express_stream_throughput.csv (default benchmarks/results/express_cost).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from pathlib import Path

import torch

from kvcompress.eval.bench import SHAPES, exact_attention_pass, fit_exponent, machine_description, one_shot, streamed, synthetic_layer, time_calls
from kvcompress.eval.tables import write_csv

RESULTS = Path(__file__).parent / "results" / "express_cost"
RATIO, BLOCK = 0.5, 128


def timing(fn, repeats: int, max_seconds: float) -> dict:
    """Wall-clock min/median of the calls and min process CPU time (what a quiet machine's 1-thread wall time would be)."""
    fn()  # warm-up
    cpu = []

    def measured():
        start = time.process_time()
        fn()
        cpu.append(time.process_time() - start)

    times = time_calls(measured, repeats, max_seconds)
    return {"min_s": min(times), "median_s": statistics.median(times), "cpu_min_s": min(cpu), "repeats": len(times)}


def cost_rows(sizes, repeats: int, max_seconds: float) -> list[dict]:
    rows = []
    for n in sizes:
        layer = synthetic_layer(SHAPES["smollm2"], n, torch.Generator().manual_seed(n))
        exact = timing(lambda: exact_attention_pass(layer), repeats, max_seconds)
        rows.append({"shape": "smollm2", "n": n, "kind": "exact", **exact, "ratio_min": 1.0, "cpu_ratio": 1.0})
        for kind, fn in (("compress", one_shot("express", layer, RATIO, 0)), ("stream", streamed("express", layer, RATIO, BLOCK, 0))):
            t = timing(fn, repeats, max_seconds)
            rows.append({"shape": "smollm2", "n": n, "kind": kind, **t, "ratio_min": t["min_s"] / exact["min_s"],
                         "cpu_ratio": t["cpu_min_s"] / exact["cpu_min_s"]})
        print(rows[-3:], flush=True)
    return rows


def throughput_rows(n: int, repeats: int, max_seconds: float) -> list[dict]:
    layer = synthetic_layer(SHAPES["llama8b"], n, torch.Generator().manual_seed(0))
    rows = []
    for method in ("keydiff", "express"):
        t = timing(streamed(method, layer, RATIO, BLOCK, 0), repeats, max_seconds)
        rows.append({"shape": "llama8b", "n": n, "kind": f"stream {method}", **t, "tokens_per_s": n / t["min_s"],
                     "cpu_tokens_per_s": n / t["cpu_min_s"]})
    for row in rows:
        row["vs_keydiff"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        row["cpu_vs_keydiff"] = row["cpu_tokens_per_s"] / rows[0]["cpu_tokens_per_s"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-seconds", type=float, default=20.0, help="stop repeating a call once its times add up to this")
    p.add_argument("--throughput-tokens", type=int, default=8192)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    threads = int(os.environ.get("KVCOMPRESS_THREADS", "1"))
    torch.set_num_threads(threads)
    machine = machine_description(threads)
    rows = cost_rows(args.sizes, args.repeats, args.max_seconds)
    exponents = []
    for kind in ("exact", "compress", "stream"):
        cell = [r for r in rows if r["kind"] == kind]
        a, _ = fit_exponent([r["n"] for r in cell], [r["min_s"] for r in cell])
        a_cpu, _ = fit_exponent([r["n"] for r in cell], [r["cpu_min_s"] for r in cell])
        exponents.append({"kind": kind, "n_min": cell[0]["n"], "n_max": cell[-1]["n"], "time_exponent": a, "cpu_time_exponent": a_cpu})
    stream = throughput_rows(args.throughput_tokens, args.repeats, args.max_seconds)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "express_cost.csv", rows)
    write_csv(args.out / "express_stream_throughput.csv", stream)
    lines = [f"# Express compression cost ({datetime.date.today()})", "", f"Machine: {machine}. Shared, noisy machine: "
             "compare ratios within this run only. Wall: min wall-clock seconds; CPU: min process CPU seconds of the "
             "same calls, which time-sharing with other jobs inflates far less.", "",
             "| n | exact wall s | compress wall s | compress / exact wall | stream wall s | stream / exact wall | exact CPU s | "
             "compress / exact CPU | stream / exact CPU |", "|---|---|---|---|---|---|---|---|---|"]
    for n in args.sizes:
        e, c, s = ([r for r in rows if r["n"] == n and r["kind"] == k][0] for k in ("exact", "compress", "stream"))
        lines.append(f"| {n} | {e['min_s']:.4g} | {c['min_s']:.4g} | {c['ratio_min']:.3g} | {s['min_s']:.4g} | {s['ratio_min']:.3g} | "
                     f"{e['cpu_min_s']:.4g} | {c['cpu_ratio']:.3g} | {s['cpu_ratio']:.3g} |")
    lines += ["", "| kind | n range | fitted exponent, wall | fitted exponent, CPU |", "|---|---|---|---|"]
    lines += [f"| {e['kind']} | {e['n_min']}–{e['n_max']} | {e['time_exponent']:.3f} | {e['cpu_time_exponent']:.3f} |" for e in exponents]
    lines += ["", f"Streaming throughput, {args.throughput_tokens} tokens in blocks of {BLOCK}, H_kv = 8, d = 128, 50% kept:", "",
              "| method | wall s | tokens/s (wall) | CPU s | tokens/s (CPU) |", "|---|---|---|---|---|"]
    lines += [f"| {r['kind'].split()[1]} | {r['min_s']:.4g} | {r['tokens_per_s']:.0f} | {r['cpu_min_s']:.4g} | {r['cpu_tokens_per_s']:.0f} |"
              for r in stream]
    lines += ["", f"Express / KeyDiff throughput: {stream[-1]['vs_keydiff']:.2f} (wall), {stream[-1]['cpu_vs_keydiff']:.2f} (CPU)"]
    (args.out / "express_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
