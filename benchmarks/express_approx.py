"""Express beside BalanceKV on the attention-approximation bench (eval/approx.py), 1/4 and 1/8 of the middle kept.

Real q/k/v of the default model (2,048 tokens of prose, layers 1, 2, 5, 15), sink 256 and the
last 256 queries exact (seed 000 App. B.1 protocol), 5 seeds per cell.

    python benchmarks/express_approx.py OUT_DIR [--methods express,balancekv]
Writes OUT_DIR/approx.{csv,md}. benchmarks/results/express_approx/before was written by this
script run on the main branch before issue 15/17's Express changes (PYTHONPATH=<main checkout>),
after/ on this branch.
"""

from __future__ import annotations

import argparse
import os

import torch

import kvcompress as kvc
from kvcompress.eval.approx import ApproxConfig, run_approx, write_approx


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--methods", default="express,balancekv")
    p.add_argument("--seeds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("KVCOMPRESS_THREADS", "1")))
    model, tokenizer = kvc.load_model()
    config = ApproxConfig(methods=args.methods.split(","), ratios=[0.75, 0.875], seeds=args.seeds)
    write_approx(run_approx(model, tokenizer, config, progress=False), args.out)
    print(open(os.path.join(args.out, "approx.md")).read())


if __name__ == "__main__":
    main()
