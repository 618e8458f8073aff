"""TOVA on the filler needle task: 2k tokens, 11 depths, ratio 0.75, with the question kept out of or put into compression.

RULER-style single needle (`eval.tasks.niah_single`, filler haystack, 7-digit number) at depths
0, 0.1, ..., 1.0 of a 2048-token context, one sample per depth (seed = depth index), greedy
answers of up to 32 tokens scored with the task's own score; 95% Wilson intervals.

Cells:
- question kept out (the eval's and kvpress's default): the context is prefilled once
  (`capture_qkv`) and compressed, so TOVA scores with the last *context* token's query; the
  question is then read exactly. Answered from that one prefill: the full cache (ratio 0), TOVA
  with its defaults (layer-averaged, no sink/window, as the paper), TOVA with the previous
  defaults (sink 4 + window 64), and per-group averaging.
- question compressed (`compress_question=True`, TOVA's own protocol, where the policy runs on
  the whole prompt): the prompt's last token, after the question, scores; the ratio applies to
  the whole prompt.
Writes benchmarks/results/tova_needles.{csv,md}.

    PYTHONPATH=. python benchmarks/tova_needles.py
"""

from __future__ import annotations

from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.eval.bench import machine_description
from kvcompress.eval.capture import capture_qkv
from kvcompress.eval.stats import wilson
from kvcompress.eval.tables import write_csv
from kvcompress.eval.tasks import niah_single, score
from kvcompress.integration import build_prompt, generate_ids

RESULTS = Path(__file__).parent / "results"
DEPTHS = [i / 10 for i in range(11)]
RATIO = 0.75
MAX_NEW_TOKENS = 32
# (label, question compressed, method parameters, compression ratio)
CELLS = (
    ("full", False, {}, 0.0),
    ("tova (defaults: layer average, no sink/window)", False, {}, RATIO),
    ("tova, sink 4 + window 64", False, {"sink": 4, "window": 64}, RATIO),
    ("tova, per-group average", False, {"average": "group"}, RATIO),
    ("tova (defaults)", True, {}, RATIO),
    ("tova, per-group average", True, {"average": "group"}, RATIO),
)


def main() -> None:
    torch.set_num_threads(1)
    machine = machine_description(1)
    model, tok = kvc.load_model()
    rows = []
    for index, depth in enumerate(DEPTHS):
        sample = niah_single(target_tokens=2048, depth=depth, seed=index, tokenizer=tok, haystack="filler")
        context_ids, question_ids = build_prompt(tok, sample.context, sample.question, sample.answer_prefix)
        captured = capture_qkv(model, context_ids)
        for label, compress_question, params, ratio in CELLS:
            prefill = None if compress_question else captured
            res = generate_ids(model, context_ids, question_ids, method="tova", compression_ratio=ratio, max_new_tokens=MAX_NEW_TOKENS,
                               prefill=prefill, compress_question=compress_question, **params)
            text = tok.decode(res.token_ids, skip_special_tokens=True)
            rows.append({"question": "compressed" if compress_question else "kept out", "cell": label, "depth": depth,
                         "context_tokens": context_ids.shape[1], "prompt_tokens": res.prompt_tokens, "hit": score(sample, text),
                         "answer": sample.answers[0], "prediction": text.strip().replace("\n", " ")})
            print(rows[-1], flush=True)
    RESULTS.mkdir(exist_ok=True)
    write_csv(RESULTS / "tova_needles.csv", rows)
    lines = [
        f"# TOVA on the filler needle task: 2048 tokens, {len(DEPTHS)} depths, compression ratio {RATIO}",
        "",
        f"Machine: {machine}; default model, greedy ({MAX_NEW_TOKENS} new tokens), one sample per depth. 95% Wilson intervals. "
        "Command: `PYTHONPATH=. python benchmarks/tova_needles.py`.",
        "",
        "| question | cell | hits | rate | 95% interval | depths missed |",
        "|---|---|---|---|---|---|",
    ]
    for label, compress_question, _, _ in CELLS:
        question = "compressed" if compress_question else "kept out"
        sel = [r for r in rows if r["cell"] == label and r["question"] == question]
        hits = int(sum(r["hit"] for r in sel))
        low, high = wilson(hits, len(sel))
        missed = ", ".join(f"{r['depth']:g}" for r in sel if r["hit"] < 1) or "-"
        lines.append(f"| {question} | {label} | {hits}/{len(sel)} | {hits / len(sel):.2f} | [{low:.2f}, {high:.2f}] | {missed} |")
    (RESULTS / "tova_needles.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
