"""H2O's compression cost one-shot, on the prefill path and on the pure-tensor path, over one exact causal pass (issue 17).

Synthetic layers of a model's shape (`kvcompress.eval.bench.synthetic_layer`), one process, one thread count.
For each n, interleaved, min over `--repeats` each:

- `sdpa_s`: one exact causal attention pass (SDPA, the unfused prefill's kernel);
- `fused_s`: `integration.attention.causal_attention_with_mass`, the prefill's attention when the method
  scores with the attention mass: the same output plus every key's received mass;
- `topk_s`: H2O's compression given that mass (`Tokens.attention_mass`), as the cache calls it;
- `pure_s`: `kvc.compress("h2o", ...)` with no model attention (it computes the mass itself), as
  `kvcompress bench --sections overhead` times it.

H2O's cost on the prefill path is what it adds to the prefill, (fused_s - sdpa_s) + topk_s; on the pure
path it is pure_s. Both are reported over sdpa_s, with their fitted time exponents. Half the tokens
removed, sink = window = 0 (as the overhead bench). Writes h2o_prefill_cost.{csv,md} into `--out`.

    PYTHONPATH=. nice -n 10 python benchmarks/h2o_prefill_cost.py --sizes 1024,2048,4096,8192,16384 --out benchmarks/results/bench/h2o3
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

import kvcompress as kvc
from kvcompress.eval.bench import SHAPES, fit_exponent, machine_description, markdown_table, synthetic_layer, time_calls, write_csv
from kvcompress.eval.bench.overhead import kept_budget
from kvcompress.integration.attention import causal_attention_with_mass
from kvcompress.methods.base import Tokens, build_method, compress_tokens

RESULTS = Path(__file__).parent / "results" / "bench"


def measure(layer: dict[str, torch.Tensor], ratio: float, repeats: int) -> dict[str, float]:
    """Min seconds of the four calls (module docstring), interleaved `repeats` times."""
    q, k, v = layer["queries"], layer["keys"], layer["values"]
    n, scale = k.shape[2], k.shape[-1] ** -0.5
    budget = kept_budget(n, ratio)
    positions = torch.arange(n).expand(k.shape[0], k.shape[1], n)
    mass = causal_attention_with_mass(q, k, v, scale)[1]
    given = Tokens(k, v, positions, q, scale=scale, query_positions=torch.arange(n), attention_mass=mass)
    h2o = build_method("h2o")
    calls = {
        "sdpa_s": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True),
        "fused_s": lambda: causal_attention_with_mass(q, k, v, scale),
        "topk_s": lambda: compress_tokens(h2o, given, budget, 0, 0, torch.Generator()),
        "pure_s": lambda: kvc.compress("h2o", k, v, queries=q, budget=budget, sink=0, window=0),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            times[name] += time_calls(call, 1)
    return {name: min(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,2048,4096,8192,16384", help="comma-separated token counts n")
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--ratio", type=float, default=0.5, help="fraction of the n tokens removed (default 0.5)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "h2o3")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_description(args.threads)
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        layer = synthetic_layer(SHAPES[args.shape], n, torch.Generator().manual_seed(0))
        t = measure(layer, args.ratio, args.repeats)
        prefill_path = t["fused_s"] - t["sdpa_s"] + t["topk_s"]
        rows.append({"shape": args.shape, "n": n, **t, "prefill_path_s": prefill_path,
                     "prefill_path_over_exact": prefill_path / t["sdpa_s"], "fused_over_exact": t["fused_s"] / t["sdpa_s"],
                     "pure_over_exact": t["pure_s"] / t["sdpa_s"]})
        print(rows[-1], flush=True)
    sizes = [r["n"] for r in rows]
    exponents = {name: fit_exponent(sizes, [r[name] for r in rows])[0] for name in ("sdpa_s", "prefill_path_s", "pure_s")}
    write_csv(rows, args.out / "h2o_prefill_cost.csv")
    table = markdown_table(rows, ["n", "sdpa_s", "fused_s", "topk_s", "pure_s", "fused_over_exact", "prefill_path_over_exact", "pure_over_exact"])
    fitted = ", ".join(f"{name.removesuffix('_s')} n^{a:.2f}" for name, a in exponents.items())
    (args.out / "h2o_prefill_cost.md").write_text(
        f"# H2O one-shot cost over one exact causal pass: prefill path and pure-tensor path\n\nMachine: {machine}.\n\n"
        f"Shape {args.shape}, {args.ratio:.0%} removed, min of {args.repeats} interleaved calls each. "
        f"prefill path = fused_s - sdpa_s + topk_s (what H2O adds to a prefill); pure = `kvc.compress` computing the mass itself.\n\n"
        f"{table}\n\nFitted time exponents ({sizes[0]}-{sizes[-1]}): {fitted}.\n")
    print((args.out / "h2o_prefill_cost.md").read_text())


if __name__ == "__main__":
    main()
