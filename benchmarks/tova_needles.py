"""TOVA on the filler needle task: 2k tokens, 11 depths, ratio 0.75, layer-wide vs per-group averaging.

RULER-style single needle (`eval.tasks.niah_single`, filler haystack, 7-digit number) at depths
0, 0.1, ..., 1.0 of a 2048-token context, one sample per depth (seed = depth index). Each sample
is prefilled once (`capture_qkv`) and answered greedily from that prefill: by the full cache
(compression ratio 0, every token kept) and by TOVA at compression ratio 0.75 (TOVA's default
sink 4 + window 64), with `average="layer"` (the paper's and kvpress's definition,
the default) and `average="group"` (the earlier per-KV-head averaging). Hits are counted with the
task's own score; 95% Wilson intervals. Writes benchmarks/results/tova_needles.{csv,md}.

    PYTHONPATH=. python benchmarks/tova_needles.py
"""

from __future__ import annotations

from pathlib import Path

import torch
from scipy.stats import binomtest

import kvcompress as kvc
from kvcompress.eval.bench import machine_description
from kvcompress.eval.capture import capture_qkv
from kvcompress.eval.tables import write_csv
from kvcompress.eval.tasks import niah_single, score
from kvcompress.integration import build_prompt, generate_ids

RESULTS = Path(__file__).parent / "results"
DEPTHS = [i / 10 for i in range(11)]
RATIO = 0.75
CELLS = (("full", {}, 0.0), ("tova layer", {"average": "layer"}, RATIO), ("tova group", {"average": "group"}, RATIO))


def main() -> None:
    torch.set_num_threads(1)
    machine = machine_description(1)
    model, tok = kvc.load_model()
    rows = []
    for index, depth in enumerate(DEPTHS):
        sample = niah_single(target_tokens=2048, depth=depth, seed=index, tokenizer=tok, haystack="filler")
        context_ids, question_ids = build_prompt(tok, sample.context, sample.question, sample.answer_prefix)
        captured = capture_qkv(model, context_ids)
        for label, params, ratio in CELLS:
            res = generate_ids(model, context_ids, question_ids, method="tova", compression_ratio=ratio, max_new_tokens=32,
                               prefill=captured, **params)
            text = tok.decode(res.token_ids, skip_special_tokens=True)
            rows.append({"cell": label, "depth": depth, "context_tokens": context_ids.shape[1], "hit": score(sample, text),
                         "answer": sample.answers[0], "prediction": text.strip().replace("\n", " ")})
            print(rows[-1], flush=True)
    RESULTS.mkdir(exist_ok=True)
    write_csv(RESULTS / "tova_needles.csv", rows)
    lines = [
        f"# TOVA on the filler needle task: 2048 tokens, {len(DEPTHS)} depths, compression ratio {RATIO}",
        "",
        f"Machine: {machine}; "
        "default model, greedy, one sample per depth. 95% Wilson intervals.",
        "",
        "| cell | hits | rate | 95% interval | depths missed |",
        "|---|---|---|---|---|",
    ]
    for label, _, _ in CELLS:
        sel = [r for r in rows if r["cell"] == label]
        hits = int(sum(r["hit"] for r in sel))
        ci = binomtest(hits, len(sel)).proportion_ci(confidence_level=0.95, method="wilson")
        missed = ", ".join(f"{r['depth']:g}" for r in sel if r["hit"] < 1) or "-"
        lines.append(f"| {label} | {hits}/{len(sel)} | {hits / len(sel):.2f} | [{ci.low:.2f}, {ci.high:.2f}] | {missed} |")
    (RESULTS / "tova_needles.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
