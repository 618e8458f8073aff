"""BalanceKV's stream before and after the issue-17 speed-up, with KeyDiff, in one process.

The implementation of `kvcompress/methods/balancekv.py` at git revision `--before` is loaded
from git history as a second registered method ("balancekv_before"). On the synthetic layer of
`kvcompress bench`'s throughput section (Llama-8B-like shape: H_kv = 8, H_q = 32, d = 128;
`--tokens` tokens in blocks of `--block`, half kept, no sink or window) KeyDiff, the old and the
current BalanceKV stream take turns within each of `--repeats` rounds (so load changes of the shared
machine hit all three); each row gives the min and median wall time of a stream, tokens/s from the
min, and the ratio to KeyDiff's tokens/s (target: >= 0.25). The old and new streams are run with
the same seed and their summaries compared: `same_output` says whether kept positions, log-weights
and the normaliser's are identical.

Writes balancekv_stream_before_after.{csv,md} into `--out`.

    PYTHONPATH=. nice -n 10 python benchmarks/balancekv_stream_before_after.py --out benchmarks/results/bench/tput-bkv
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kvcompress.eval.bench import SHAPES, kept_budget, machine_description, streamed, synthetic_layer, time_calls, write_table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "bench" / "tput-bkv"
SPEED_UP_BASE = "5ba79db"  # main when the speed-up started


def register_before(revision: str) -> str:
    """Import balancekv.py at `revision` as kvcompress.methods._balancekv_before, registered as "balancekv_before"."""
    source = subprocess.run(["git", "show", f"{revision}:kvcompress/methods/balancekv.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    name = 'name = "balancekv"'
    if source.count(name) != 1:
        raise ValueError(f"--before {revision}: expected one {name!r} in its balancekv.py, found {source.count(name)}")
    path = Path(tempfile.mkdtemp()) / "balancekv_before.py"
    path.write_text(source.replace(name, 'name = "balancekv_before"'))
    spec = importlib.util.spec_from_file_location("kvcompress.methods._balancekv_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return "balancekv_before"


def same_summary(a, b) -> bool:
    pairs = [(a.positions, b.positions), (a.log_weights, b.log_weights),
             (a.normalizer.positions, b.normalizer.positions), (a.normalizer.log_weights, b.normalizer.log_weights)]
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--before", default=SPEED_UP_BASE, help="git revision of the old implementation")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_description(args.threads)
    before = register_before(args.before)
    layer = synthetic_layer(SHAPES["llama8b"], args.tokens, torch.Generator().manual_seed(0))
    runs = {m: streamed(m, layer, 0.5, args.block, 0) for m in ("keydiff", before, "balancekv")}
    same = same_summary(runs[before]().summary(), runs["balancekv"]().summary())  # also the warm-up
    runs["keydiff"]()
    times: dict[str, list[float]] = {m: [] for m in runs}
    for i in range(args.repeats):
        for method, run in runs.items() if i % 2 == 0 else reversed(runs.items()):  # every other round reversed
            times[method] += time_calls(run, 1)
            print(f"{method} {args.tokens / times[method][-1]:.0f} tokens/s", flush=True)
    reference = args.tokens / min(times["keydiff"])
    rows = [{"method": m, "tokens": args.tokens, "budget": kept_budget(args.tokens, 0.5), "block": args.block, "runs": len(t),
             "min_s": min(t), "median_s": statistics.median(t), "tokens_per_s": args.tokens / min(t),
             "over_keydiff": args.tokens / min(t) / reference} for m, t in times.items()]
    speed_up = min(times[before]) / min(times["balancekv"])
    heading = (f"# BalanceKV stream before/after (issue 17)\n\nMachine: {machine}.\n\n"
               f"Llama-8B-like shape (H_kv = 8, H_q = 32, d = 128), {args.tokens} tokens in blocks of {args.block}, half kept, "
               f"no sink or window; wall times, min and median of {args.repeats} interleaved runs. `balancekv_before` is "
               f"balancekv.py at {args.before}. Speed-up (min/min): {speed_up:.2f}x. Same output (kept positions and "
               f"log-weights of numerator and normaliser, same seed): {'yes' if same else 'NO'}.")
    print(write_table(rows, args.out, "balancekv_stream_before_after", heading,
                      ["method", "runs", "min_s", "median_s", "tokens_per_s", "over_keydiff"]))


if __name__ == "__main__":
    main()
