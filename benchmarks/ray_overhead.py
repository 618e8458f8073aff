"""Overhead of running a sweep on Ray: a 4-cell sweep on a local 2-CPU Ray cluster vs in-process.

The sweep: `--samples` samples of one task on the default model (or `--model PATH`), each with the full cache and one
compressed cell (2 x 2 = 4 cells by default). Measured in one process, in this order:
1. local: `run_sweep` in this process at `--threads` torch threads (model already loaded);
2. Ray start: `ray.init(num_cpus=2)`;
3. Ray cold: `run_sweep_ray` with 1 CPU (1 torch thread) per task, so the 2 samples run side by
   side; it includes starting the worker processes and each worker loading the model;
4. Ray warm: the same sweep again into a fresh directory (worker processes already up, each
   loads the model again: the model is cached per sweep).
Records of the local and Ray runs are checked to agree (timings aside). This measures overhead,
not a speed-up: on one small machine Ray only adds process start-up, model loading and transfer.
Writes benchmarks/results/ray_overhead[_<name>].csv and .md (`--name`).

    python benchmarks/ray_overhead.py --length 1024 --threads 1
    python benchmarks/ray_overhead.py --model /tmp/tiny --name tiny   # a tiny checkpoint: wall time is nearly all overhead
"""

from __future__ import annotations

import argparse
import functools
import platform
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from kvcompress.eval.ray_sweep import run_sweep_ray
from kvcompress.eval.runner import SweepConfig, run_sweep
from kvcompress.eval.tables import write_csv
from kvcompress.integration import load_model

OUT = Path(__file__).parent / "results"
TIMINGS = {"wall_s", "capture_s", "prefill_s", "compress_s", "decode_s"}


def _comparable(records: list[dict]) -> list[dict]:
    return sorted(({k: v for k, v in r.items() if k not in TIMINGS} for r in records), key=lambda r: r["key"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="local checkpoint directory (default: the default model)")
    p.add_argument("--name", default="", help="suffix of the output files")
    p.add_argument("--method", default="knorm", help="the compressed cell's method")
    p.add_argument("--task", default="niah_single", help="task of the sweep")
    p.add_argument("--length", type=int, default=1024, help="context tokens")
    p.add_argument("--samples", type=int, default=2, help="samples (2 cells each: full cache + the method)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="answer tokens per cell")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the local run (Ray tasks get 1 CPU each)")
    args = p.parse_args()
    import ray

    torch.set_num_threads(args.threads)
    config = SweepConfig(methods=[args.method], ratios=[0.5], tasks=[args.task], lengths=[args.length], samples=args.samples,
                         max_new_tokens=args.max_new_tokens)
    model, tokenizer = load_model(args.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        local = run_sweep(model, tokenizer, config, Path(tmp) / "local", progress=False)
        rows.append({"run": f"local, {args.threads} thread(s)", "cells": len(local), "wall_s": time.perf_counter() - start})
        start = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        rows.append({"run": "ray.init(num_cpus=2)", "cells": 0, "wall_s": time.perf_counter() - start})
        for label in ("Ray cold (workers start, load model)", "Ray warm (workers up, load model)"):
            start = time.perf_counter()
            records, failures = run_sweep_ray(functools.partial(load_model, args.model), config, Path(tmp) / label.split()[1], progress=False)
            rows.append({"run": label, "cells": len(records), "wall_s": time.perf_counter() - start})
            if failures or _comparable(records) != _comparable(local):
                raise RuntimeError(f"Ray run differs from the local run (failures: {failures})")
        ray.shutdown()
    local_s = rows[0]["wall_s"]
    for r in rows:
        r["vs_local"] = r["wall_s"] / local_s
    OUT.mkdir(parents=True, exist_ok=True)
    stem = OUT / ("ray_overhead" + (f"_{args.name}" if args.name else ""))
    write_csv(stem.with_suffix(".csv"), rows)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"Ray overhead: {len(local)}-cell sweep ({args.samples} x {args.task} at {args.length} tokens, full cache + "
             f"{args.method} @ 0.5, {args.max_new_tokens} answer tokens), model {args.model or 'default'}; host {platform.node()}, "
             f"{when}. Shared, noisy machine: one run each.", "",
             "| run | cells | wall s | x local |", "|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['cells']} | {r['wall_s']:.1f} | {r['vs_local']:.2f} |" for r in rows]
    lines += ["", "Local and Ray records agree apart from timings. Overhead only, not a speed-up claim."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
