"""Time per sweep cell before and after decoding stops at the answer (issue 16), measured in one process.

Before: the needle question with no answer prefix, up to 32 new tokens, stop at EOS only (the
sweep's settings until now; the model answers with a whole sentence). After: RULER's answer
prefix ("The special magic number for X mentioned in the provided text is"), the task's own
limit (`Sample.max_new_tokens`) and its stop strings (`Sample.stop`) besides EOS. Both answer the
same samples from the same recorded prefill, interleaved, with the same method and ratio, so the
ratio of their times is what the change buys; the score shows what it costs (nothing, if both
find the needle equally often). niah_single at 2048 tokens, seeds 2000 + i (not the reported ones).

    PYTHONPATH=. python benchmarks/answer_stopping.py [--samples 4] [--methods keydiff compactor] [--threads 1]
"""

from __future__ import annotations

import argparse
import csv
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.eval.capture import capture_qkv
from kvcompress.eval.runner import sample_depth
from kvcompress.eval.stopping import stop_token_ids
from kvcompress.eval.tasks import generate_sample, score
from kvcompress.integration.generation import generate_ids
from kvcompress.integration.model import build_prompt

RESULTS = Path(__file__).parent / "results"
SEED = 2000
BEFORE_MAX_NEW_TOKENS = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--methods", nargs="+", default=["keydiff", "compactor"])
    parser.add_argument("--ratio", type=float, default=0.75)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvc.load_model()
    rows = []
    for i in range(args.samples):
        after = generate_sample("niah_single", target_tokens=2048, depth=sample_depth(i), seed=SEED + i, tokenizer=tokenizer)
        before = replace(after, answer_prefix="", max_new_tokens=BEFORE_MAX_NEW_TOKENS, stop=())
        context_ids, _ = build_prompt(tokenizer, after.context, after.question, after.answer_prefix)
        captured = capture_qkv(model, context_ids)
        for method in args.methods:
            for setting, sample in (("before", before), ("after", after)):
                _, question_ids = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
                start = time.perf_counter()
                res = generate_ids(model, context_ids, question_ids, method=method, compression_ratio=args.ratio, prefill=captured,
                                   max_new_tokens=sample.max_new_tokens, stop_token_ids=stop_token_ids(tokenizer, sample.stop))
                wall = time.perf_counter() - start
                prediction = tokenizer.decode(res.token_ids, skip_special_tokens=True)
                rows.append({"sample": i, "method": method, "setting": setting, "new_tokens": len(res.token_ids),
                             "wall_s": wall, "decode_s": res.decode_seconds, "score": score(sample, prediction), "prediction": prediction})
        print(f"sample {i} done", flush=True)
    RESULTS.mkdir(exist_ok=True)
    with (RESULTS / "answer_stopping.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = [
        "# Time per cell before / after stopping at the answer",
        "",
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {args.threads} thread(s), shared 2-core CPU (other jobs running: "
        f"absolute times are noisy, the before/after pairs ran interleaved in one process). niah_single, 2048 tokens, "
        f"{args.samples} samples, ratio {args.ratio:g}, one recorded prefill per sample (its capture is not in the cell time).",
        "",
        "| method | setting | cells | decoded tokens (mean) | wall s per cell (mean) | decode s (mean) | score |",
        "|---|---|---|---|---|---|---|",
    ]
    for method in args.methods:
        for setting in ("before", "after"):
            rs = [r for r in rows if (r["method"], r["setting"]) == (method, setting)]
            mean = lambda key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
            lines.append(f"| {method} | {setting} | {len(rs)} | {mean('new_tokens'):.1f} | {mean('wall_s'):.2f} | "
                         f"{mean('decode_s'):.2f} | {sum(r['score'] for r in rs):g}/{len(rs)} |")
    (RESULTS / "answer_stopping.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
