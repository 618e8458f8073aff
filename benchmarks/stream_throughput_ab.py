"""Before/after streaming throughput in one process: two kvcompress trees, interleaved (issue 17).

Loads the package twice (`--before`: a plain export of the baseline commit, e.g.
`git archive 5ba79db | tar -x -C /tmp/base`; `--after`: this tree), each through its own
`kvcompress.api`, and times the same calls alternately, so load changes of a shared machine hit
both alike. Each call feeds the workload of `kvcompress bench`'s throughput section (synthetic layer of `--shape`,
`--tokens` tokens in blocks of `--block`, `--compression-ratio` removed (default half), no sink or window, then `compact()`) or, with
`--kinds compress`, one-shot compression of the same tokens. Checks first that both trees give
identical summaries (positions, log-weights, keys), then reports the min of `--rounds` per
variant, the after/before ratio and tokens/s over KeyDiff's within each variant.

    PYTHONPATH=. python benchmarks/stream_throughput_ab.py --before /tmp/base --out benchmarks/results/bench/tput-hyb
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import torch

VARIANTS = ("before", "after")


def evict() -> None:
    """Forget every loaded kvcompress module, so that the next import reads another tree."""
    for name in [k for k in sys.modules if k == "kvcompress" or k.startswith("kvcompress.")]:
        del sys.modules[name]


def report(text: str, out: Path | None, name: str) -> None:
    """Print a report, and write it as out/name when a folder is given."""
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)


def ab_parser(description: str, report_name: str, rounds: int) -> argparse.ArgumentParser:
    """A parser with the options of every before/after script: --before, --after, --rounds, --threads, --out."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--before", type=Path, required=True, help="root of the baseline tree (holds kvcompress/)")
    parser.add_argument("--after", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help=f"folder for {report_name} (printed only when absent)")
    return parser


def load(path: Path) -> dict:
    """The api and bench modules of the kvcompress package under `path` (evicting any loaded one first)."""
    evict()
    sys.path.insert(0, str(path))
    try:
        return {name: importlib.import_module("kvcompress." + name) for name in ("api", "eval.bench", "eval.bench.overhead")}
    finally:
        sys.path.remove(str(path))


def workload(modules: dict, method: str, kind: str, layer: dict, block: int, compression_ratio: float):
    """A call running `method` on the layer with this tree's api: streamed block by block, or one-shot."""
    api, overhead = modules["api"], modules["eval.bench.overhead"]
    n = layer["keys"].shape[2]
    budget = overhead.kept_budget(n, compression_ratio)
    extra = overhead.method_inputs(method, layer)
    if kind == "compress":
        return lambda: api.compress(method, layer["keys"], layer["values"], budget=budget, sink=0, window=0, seed=0, **extra)

    def run():
        st = api.stream(method, budget=budget, sink=0, window=0, seed=0)
        for start in range(0, n, block):
            part = {k: v[:, :, start : start + block] for k, v in extra.items()}
            st.update(layer["keys"][:, :, start : start + block], layer["values"][:, :, start : start + block], **part)
        st.compact()
        return st.summary()

    return run


def main() -> None:
    parser = ab_parser(__doc__.splitlines()[0], "stream_throughput_ab.md", rounds=5)
    parser.add_argument("--shape", default="llama8b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--methods", default="keydiff,compactor,hybrid")
    parser.add_argument("--kinds", default="stream", help="comma-separated: stream, compress")
    parser.add_argument("--compression-ratio", type=float, default=0.5, help="share of the tokens removed (0.75: `generate`'s prefill setting)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    methods, kinds = args.methods.split(","), args.kinds.split(",")
    trees = {"before": load(args.before), "after": load(args.after)}
    bench = trees["after"]["eval.bench"]
    layer = bench.synthetic_layer(bench.SHAPES[args.shape], args.tokens, torch.Generator().manual_seed(0))
    calls = {(m, k, v): workload(trees[v], m, k, layer, args.block, args.compression_ratio) for m in methods for k in kinds for v in VARIANTS}
    same = {}
    for m in methods:
        for k in kinds:
            a, b = calls[(m, k, "before")](), calls[(m, k, "after")]()
            same[(m, k)] = all(torch.equal(x, y) for x, y in ((a.positions, b.positions), (a.log_weights, b.log_weights), (a.keys, b.keys)))
    times: dict = {key: [] for key in calls}
    for i in range(args.rounds):
        # each round reverses the order of the last, so neither variant always runs right after the other
        for key, call in (calls.items() if i % 2 == 0 else reversed(calls.items())):
            start = time.perf_counter()
            call()
            times[key].append(time.perf_counter() - start)
    best = {key: min(t) for key, t in times.items()}
    lines = [
        f"# Before/after streaming throughput, one process\n\nMachine: {bench.machine_description(args.threads)}.\n",
        f"{args.shape} shape, {args.tokens} tokens, blocks of {args.block}, {args.compression_ratio:g} of the tokens removed, no sink or window; min of {args.rounds} "
        f"interleaved rounds (the order reversed every other round); before = `{args.before}`, after = `{args.after}`.\n",
        "| method | kind | identical output | before s | after s | after / before | before tokens/s over KeyDiff | after tokens/s over KeyDiff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        for k in kinds:
            b, a = best[(m, k, "before")], best[(m, k, "after")]
            over = [f"{best[('keydiff', k, v)] / best[(m, k, v)]:.3f}" if ("keydiff", k, v) in best else "" for v in VARIANTS]
            lines.append(f"| {m} | {k} | {'yes' if same[(m, k)] else 'NO'} | {b:.4f} | {a:.4f} | {a / b:.3f} | {over[0]} | {over[1]} |")
    report("\n".join(lines) + "\n", args.out, "stream_throughput_ab.md")


if __name__ == "__main__":
    main()
