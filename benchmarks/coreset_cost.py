"""Cost of BalanceKV and ClusterGen (issue 17): compression time over one exact causal attention pass.

One process, one thread count, synthetic layers of a `kvcompress.eval.bench.SHAPES` shape (the
default model's by default): for each n, the exact SDPA pass, then each method one-shot
(`kvc.compress`) and streamed (`kvc.stream`, blocks of `--block` tokens), all with sink = window = 0
and `--ratio` of the tokens removed, min of `--repeats` calls. The time exponent is fitted over
the sizes measured. ClusterGen's seed form (one k-center over all keys, `block_size=None`) is
timed at the sizes up to `--seed-max`. Streaming throughput (tokens absorbed per second) is
measured on `--throughput-shape` (H_kv = 8, d = 128) at `--throughput-n` tokens for BalanceKV,
ClusterGen (block-wise replay) and KeyDiff in the same run.

Writes benchmarks/results/coreset_cost.{csv,md}.

    PYTHONPATH=. nice -n 10 python benchmarks/coreset_cost.py
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvcompress.api import compress, stream
from kvcompress.eval.bench import (
    SHAPES,
    exact_attention_pass,
    fit_exponent,
    kept_budget,
    machine_description,
    synthetic_layer,
    time_calls,
)
from kvcompress.eval.tables import write_csv

RESULTS = Path(__file__).parent / "results"
# (label, method, parameters): the methods timed one-shot and streamed.
METHODS = [
    ("balancekv", "balancekv", {}),
    ("clustergen", "clustergen", {}),
    ("clustergen (seed: global k-center)", "clustergen", {"block_size": None}),
]


def timed(method: str, params: dict, kind: str, layer: dict, ratio: float, block: int, repeats: int) -> list[float]:
    """Seconds of `repeats` one-shot (kind "compress") or streamed ("stream") runs over the layer."""
    n = layer["keys"].shape[2]
    budget = kept_budget(n, ratio)
    if kind == "compress":
        return time_calls(lambda: compress(method, layer["keys"], layer["values"], budget=budget, sink=0, window=0, seed=0, **params), repeats)

    def run():
        st = stream(method, budget=budget, sink=0, window=0, seed=0, **params)
        for start in range(0, n, block):
            st.update(layer["keys"][:, :, start : start + block], layer["values"][:, :, start : start + block])
        return st.summary()

    return time_calls(run, repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed-max", type=int, default=4096, help="largest n for ClusterGen's global k-center")
    parser.add_argument("--throughput-shape", default="llama8b", choices=sorted(SHAPES))
    parser.add_argument("--throughput-n", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tag", default="", help="suffix of the output files")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_description(torch.get_num_threads())
    print(machine, flush=True)
    shape = SHAPES[args.shape]
    rows = []
    for n in args.sizes:
        layer = synthetic_layer(shape, n, torch.Generator().manual_seed(n))
        exact = min(time_calls(lambda: exact_attention_pass(layer), args.repeats))
        rows.append({"shape": shape.name, "n": n, "method": "exact", "kind": "exact", "min_s": exact, "ratio_to_exact": 1.0})
        for label, method, params in METHODS:
            if params.get("block_size", 0) is None and n > args.seed_max:
                continue
            for kind in ("compress", "stream"):
                if kind == "stream" and params.get("block_size", 0) is None:
                    continue
                best = min(timed(method, params, kind, layer, args.ratio, args.block, args.repeats))
                rows.append({"shape": shape.name, "n": n, "method": label, "kind": kind, "min_s": best, "ratio_to_exact": best / exact})
                print(rows[-1], flush=True)
    exponents = []
    for label in ["exact"] + [m[0] for m in METHODS]:
        for kind in ("exact", "compress", "stream"):
            pts = [r for r in rows if r["method"] == label and r["kind"] == kind]
            if len(pts) >= 2:
                exponents.append({"method": label, "kind": kind, "n_min": pts[0]["n"], "n_max": pts[-1]["n"],
                                  "time_exponent": fit_exponent([r["n"] for r in pts], [r["min_s"] for r in pts])[0]})
    throughput = []
    tshape = SHAPES[args.throughput_shape]
    layer = synthetic_layer(tshape, args.throughput_n, torch.Generator().manual_seed(1))
    for label, method in (("balancekv", "balancekv"), ("clustergen", "clustergen"), ("keydiff", "keydiff")):
        best = min(timed(method, {}, "stream", layer, args.ratio, args.block, args.repeats))
        throughput.append({"shape": tshape.name, "n": args.throughput_n, "method": label, "stream_s": best,
                           "tokens_per_s": args.throughput_n / best})
        print(throughput[-1], flush=True)
    keydiff = next(r["tokens_per_s"] for r in throughput if r["method"] == "keydiff")
    for r in throughput:
        r["vs_keydiff"] = r["tokens_per_s"] / keydiff

    RESULTS.mkdir(exist_ok=True)
    name = f"coreset_cost{args.tag}"
    write_csv(RESULTS / f"{name}.csv", rows)
    write_csv(RESULTS / f"{name}_throughput.csv", throughput)
    sizes = args.sizes
    lines = [
        f"# Cost of BalanceKV and ClusterGen vs one exact causal attention pass ({shape.name} shape, {args.ratio:.0%} removed, "
        f"sink = window = 0, stream blocks of {args.block}, min of {args.repeats})",
        "",
        f"Machine: {machine}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Shared machine: absolute times are noisy, "
        "ratios are measured in the same process.",
        "",
        "| method | kind | " + " | ".join(f"n={n}" for n in sizes) + " |",
        "|---|---|" + "---|" * len(sizes),
    ]
    exact_row = {r["n"]: r["min_s"] for r in rows if r["method"] == "exact"}
    lines.append("| exact attention (s) | exact | " + " | ".join(f"{exact_row[n]:.3f}" for n in sizes) + " |")
    for label, _, _ in METHODS:
        for kind in ("compress", "stream"):
            cell = {r["n"]: r["ratio_to_exact"] for r in rows if r["method"] == label and r["kind"] == kind}
            if cell:
                lines.append(f"| {label} | {kind} | " + " | ".join(f"{cell[n]:.3f}" if n in cell else "-" for n in sizes) + " |")
    lines += ["", "Time exponents (time ≈ c·n^a, least squares on log-log):", "", "| method | kind | n | a |", "|---|---|---|---|"]
    lines += [f"| {e['method']} | {e['kind']} | {e['n_min']}-{e['n_max']} | {e['time_exponent']:.3f} |" for e in exponents]
    lines += ["", f"Streaming throughput ({tshape.name}: H_kv = {tshape.kv_heads}, d = {tshape.head_dim}; {args.throughput_n} tokens "
              f"in blocks of {args.block}, budget {1 - args.ratio:.0%}):", "",
              "| method | tokens/s | vs KeyDiff |", "|---|---|---|"]
    lines += [f"| {r['method']} | {r['tokens_per_s']:.0f} | {r['vs_keydiff']:.2f} |" for r in throughput]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
