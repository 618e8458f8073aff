"""Prefill reuse in the eval sweep: one recorded context prefill for every method vs re-prefilling per method.

Runs the same small sub-sweep (prefill mode, no full-cache cells) twice on the default model:
with `reuse_prefill=True` (one `capture_qkv` per sample, each method compresses its own copy)
and with `reuse_prefill=False` (every cell runs the whole context again). The two runs alternate
sample by sample so that both see the same machine load. Writes
benchmarks/results/eval_prefill_reuse.csv (one row per cell and variant) and .md (per-method
cell times and the total speed-up; the reused sweep's total includes its captures).

    python benchmarks/eval_prefill_reuse.py --methods knorm,snapkv,streamingllm,tova,keydiff --length 2048
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.eval.runner import SweepConfig, read_results, run_sweep
from kvcompress.eval.tables import write_csv

OUT = Path(__file__).parent / "results"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="knorm,snapkv,streamingllm,tova,keydiff", help="comma-separated methods")
    p.add_argument("--ratio", type=float, default=0.75, help="compression ratio of every cell")
    p.add_argument("--task", default="niah_single", help="task of the sub-sweep")
    p.add_argument("--length", type=int, default=2048, help="context tokens")
    p.add_argument("--samples", type=int, default=1, help="samples (each sample: one capture vs one prefill per method)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="answer tokens per cell")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvc.load_model()
    methods = [m for m in args.methods.split(",") if m]
    rows, totals = [], {True: 0.0, False: 0.0}
    scratch = Path(tempfile.mkdtemp(prefix="kvc-reuse-"))
    try:
        for reuse in (True, False):
            (scratch / str(reuse)).mkdir()
        for i in range(args.samples):
            for reuse in (True, False):
                config = SweepConfig(methods=methods, ratios=[args.ratio], tasks=[args.task], lengths=[args.length],
                                     samples=i + 1, include_full=False, reuse_prefill=reuse, max_new_tokens=args.max_new_tokens)
                start = time.perf_counter()
                run_sweep(model, tokenizer, config, scratch / str(reuse), progress=False)
                totals[reuse] += time.perf_counter() - start
                print(f"sample {i}: reuse={reuse} {time.perf_counter() - start:.1f} s", flush=True)
        for reuse in (True, False):
            for r in read_results(scratch / str(reuse) / "results.jsonl"):
                rows.append({"reuse_prefill": reuse, "method": r["method"], "index": r["index"], "context_tokens": r["context_tokens"],
                             "capture_s": r["capture_s"], "cell_s": r["wall_s"], "prefill_s": r["prefill_s"],
                             "compress_s": r["compress_s"], "decode_s": r["decode_s"], "score": r["score"]})
    finally:
        shutil.rmtree(scratch)
    OUT.mkdir(exist_ok=True)
    write_csv(OUT / "eval_prefill_reuse.csv", rows)
    lines = [
        f"Sub-sweep: {len(methods)} methods at ratio {args.ratio}, {args.task}, {args.length} tokens, {args.samples} sample(s), "
        f"{args.max_new_tokens} answer tokens, {args.threads} thread(s).",
        "",
        "| method | cell s, reused prefill | cell s, re-prefilled | score (reused / re-prefilled) |",
        "|---|---|---|---|",
    ]
    for m in methods:
        a = [r for r in rows if r["method"] == m and r["reuse_prefill"]]
        b = [r for r in rows if r["method"] == m and not r["reuse_prefill"]]
        lines.append(f"| {m} | {sum(r['cell_s'] for r in a) / len(a):.1f} | {sum(r['cell_s'] for r in b) / len(b):.1f} | "
                     f"{sum(r['score'] for r in a) / len(a):.2f} / {sum(r['score'] for r in b) / len(b):.2f} |")
    capture = sum({(r["index"]): r["capture_s"] for r in rows if r["reuse_prefill"]}.values())
    lines += ["", f"Total wall time: reused {totals[True]:.1f} s (of which captures {capture:.1f} s), "
              f"re-prefilled {totals[False]:.1f} s: speed-up {totals[False] / totals[True]:.2f}x.", ""]
    (OUT / "eval_prefill_reuse.md").write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
