"""Re-compression slack of block-wise streams: stream time and peak slots against the slack (issue 17).

One process, one torch thread count, synthetic tensors of the default model's shape
(`kvcompress.eval.bench.synthetic_layer`). For each slack, each block-wise method streams n tokens
in blocks of `--block` (half kept: budget n/2, no sink or window), compacted at the end
(`kvcompress.eval.bench.streamed`); the time is the min of `--repeats` runs, divided by one exact
causal attention pass over the same n tokens measured in the same run. The time exponent is fitted
over `--sizes`; peak_over_budget is the most slots the state held at once (the buffer a
re-compression scores) over the budget, at most 1: the slack and the block come out of the budget
(`kvcompress.methods.budget.stream_split`). Slack 0 leaves one slot of room, a re-compression at
every token once the buffer is full.

Writes stream_slack.{csv,md} into `--out`.

    PYTHONPATH=. nice -n 10 python benchmarks/tuning/stream_slack.py      # into benchmarks/results/bench/slack/
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvcompress.eval.bench import SHAPES, exact_attention_pass, fit_exponent, kept_budget, machine_description, streamed, synthetic_layer, time_calls, write_table

RESULTS = Path(__file__).parents[1] / "results" / "bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="keydiff,snapkv,h2o,compactor,hybrid")
    parser.add_argument("--slacks", default="0,0.125,0.25,0.5,1")
    parser.add_argument("--sizes", default="2048,8192")
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, default=RESULTS / "slack")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_description(args.threads)
    methods, slacks, sizes = args.methods.split(","), [float(s) for s in args.slacks.split(",")], [int(n) for n in args.sizes.split(",")]
    rows = []
    for n in sizes:
        layer = synthetic_layer(SHAPES[args.shape], n, torch.Generator().manual_seed(n))
        exact = min(time_calls(lambda: exact_attention_pass(layer), args.repeats))
        for method in methods:
            for slack in slacks:
                run = streamed(method, layer, 0.5, args.block, 0, slack)
                times = time_calls(run, args.repeats)
                peak = run().state.peak_slots
                rows.append({"method": method, "slack": slack, "n": n, "min_s": min(times), "exact_s": exact,
                             "ratio": min(times) / exact, "peak_over_budget": peak / kept_budget(n, 0.5)})
                print(rows[-1], flush=True)
    for method in methods:
        for slack in slacks:
            mine = [r for r in rows if r["method"] == method and r["slack"] == slack]
            exponent = fit_exponent([r["n"] for r in mine], [r["min_s"] for r in mine])[0] if len(mine) > 1 else float("nan")
            for r in mine:
                r["time_exponent"] = exponent
    heading = (f"# Block-wise stream cost against the re-compression slack\n\nMachine: {machine} (shared, noisy).\n\n"
               f"{args.shape} shape, blocks of {args.block}, half kept, no sink or window, compacted at the end; min of "
               f"{args.repeats} runs; ratio = stream time / one exact causal attention pass of the same n; exponent fitted over "
               f"n = {args.sizes}; peak = most slots the block-wise buffer held at once / budget (the hybrid: its exact set's "
               f"buffer, beside what its coreset stream holds).")
    print(write_table(rows, args.out, "stream_slack", heading, ["method", "slack", "n", "min_s", "ratio", "time_exponent", "peak_over_budget"]))


if __name__ == "__main__":
    main()
