"""End-to-end prefill overhead (issue 17): `generate` prefill with compression over a plain transformers prefill.

One process, one torch thread count, the default model (SmolLM2-135M-Instruct), one context of real
prose of `--tokens` tokens. The plain prefill is `generate_ids(method=None)`: transformers'
DynamicCache and the model's own SDPA attention. Each method runs the same prefill through
kvcompress's cache in prefill mode, `--ratio` of the context removed, every layer compressed once
at the end of its forward (the method's default sink and window). Both are timed by
`GenerationResult.prefill_seconds` (the context's forward, compression included; no question,
one answer token from the last logits); `compress_seconds` (the compression calls alone) is
reported beside it, as a share of the same prefill: under a load that changes between runs (one
4k prefill took 407 s, a later one 130 s) that share, and the overhead it implies, 1 / (1 - share),
is the robust figure. Repeats go round all methods in turn, with a plain prefill
before every `--plain-every` methods, so slow phases of the shared machine hit both. A method's
ratio is its min over repeats divided by the min of every plain prefill of the run (medians in the
CSV).

Writes prefill_overhead.{csv,md} into `--out`.

    PYTHONPATH=. nice -n 10 python benchmarks/prefill_overhead.py --out benchmarks/results/bench/cost2
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.eval.bench import context_ids, machine_description, markdown_table, write_csv
from kvcompress.integration import generate_ids

RESULTS = Path(__file__).parent / "results" / "bench"


def prefill_seconds(model, ids: torch.Tensor, method: str | None, ratio: float) -> tuple[float, float]:
    """(seconds of the context's prefill, of which compression) through `generate_ids`."""
    options = {"compression_ratio": ratio} if method is not None else {}
    res = generate_ids(model, ids, None, method=method, max_new_tokens=1, stop_at_eos=False, **options)
    return res.prefill_seconds, res.compress_seconds


def overhead_rows(times: dict[str, list[float]], compress: dict[str, list[float]], tokens: int, ratio: float) -> list[dict]:
    """One row per method measured so far (and the plain prefill): min/median seconds and their ratios to the plain prefill's."""
    plain_min, plain_median = min(times["plain"]), statistics.median(times["plain"])
    return [{"method": m, "tokens": tokens, "ratio_removed": ratio if m != "plain" else 0.0, "runs": len(t),
             "min_s": min(t), "median_s": statistics.median(t), "overhead_min": min(t) / plain_min,
             "overhead_median": statistics.median(t) / plain_median,
             "compress_min_s": min(compress[m]) if compress[m] else 0.0,
             "compress_over_plain": min(compress[m]) / plain_min if compress[m] else 0.0} for m, t in times.items() if t]


def write_markdown(rows: list[dict], path: Path, machine: str, ratio: float, plain_runs: int) -> None:
    """The table, with each method's compression share of its own prefill (compress_min_s / min_s: both from the
    same runs, so a load change between runs cancels) and the overhead that share implies, 1 / (1 - share)."""
    shown = [{**r, "compress_share": r["compress_min_s"] / r["min_s"], "implied_overhead": r["min_s"] / (r["min_s"] - r["compress_min_s"])}
             for r in rows]
    table = markdown_table(sorted(shown, key=lambda row: row["implied_overhead"]),
                           ["method", "runs", "min_s", "overhead_min", "compress_min_s", "compress_share", "implied_overhead"])
    path.write_text(f"# `generate` prefill with compression ÷ plain transformers prefill\n\nMachine: {machine}.\n\n"
                    f"{rows[0]['tokens']} tokens of real prose, {ratio:.0%} of the context removed, default model, prefill mode; "
                    f"min and median over repeats, each over the min (median) of the {plain_runs} plain prefills of the same run.\n\n{table}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--ratio", type=float, default=0.75, help="fraction of the context removed (default 0.75)")
    parser.add_argument("--methods", default=None, help="comma-separated methods (default: every registered method)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--plain-every", type=int, default=4, help="a plain prefill before every this many methods (default 4)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "prefill")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_description(args.threads)
    methods = args.methods.split(",") if args.methods else kvc.methods()
    model, tokenizer = kvc.load_model()
    ids = context_ids(tokenizer, args.tokens)
    prefill_seconds(model, ids[:, :256], None, args.ratio)  # warm-up: first calls pay allocation and dispatch setup
    times: dict[str, list[float]] = {"plain": [], **{m: [] for m in methods}}
    compress: dict[str, list[float]] = {"plain": [], **{m: [] for m in methods}}
    rows: list[dict] = []
    for r in range(args.repeats):
        for i, method in enumerate(methods):
            if i % args.plain_every == 0:
                seconds, _ = prefill_seconds(model, ids, None, args.ratio)
                times["plain"].append(seconds)
                print(f"repeat {r} plain {seconds:.2f}s", flush=True)
            seconds, compressing = prefill_seconds(model, ids, method, args.ratio)
            times[method].append(seconds)
            compress[method].append(compressing)
            print(f"repeat {r} {method} {seconds:.2f}s (compression {compressing:.2f}s)", flush=True)
            rows = overhead_rows(times, compress, ids.shape[1], args.ratio)
            write_csv(rows, args.out / "prefill_overhead.csv")  # saved as it goes: a long run under load keeps what it measured
            write_markdown(rows, args.out / "prefill_overhead.md", machine, args.ratio, len(times["plain"]))
    print((args.out / "prefill_overhead.md").read_text())


if __name__ == "__main__":
    main()
