"""Cross-check: kvpress's own TOVAPress on the samples of benchmarks/tova_needles.py (question kept out).

kvpress is not a dependency (it pins transformers < 5.3); put a kvpress source checkout on the
path (tested with github NVIDIA/kvpress at 8bb29b9c, its package `__init__` emptied to skip
imports of other presses' optional dependencies). Two shims adapt its hook to transformers 5.23,
which no longer passes `cache_position` to attention modules: the press is entered for the
context's prefill only, so "is prefilling" is always true there. The protocol is kvpress's
pipeline: the context (chat template prefix + context) prefilled under the press, then the
question ids read exactly at the original positions, then greedy decoding (up to 32 tokens,
stopping at end of sequence). The same samples, prompts and score as tova_needles.py.
Writes tova_kvpress_check.{csv,md} into --out (default benchmarks/results).

    PYTHONPATH=.:/path/to/kvpress python benchmarks/tova_kvpress_check.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import DynamicCache

import kvcompress as kvc
from kvcompress.eval.bench import machine_description
from kvcompress.eval.stats import wilson
from kvcompress.eval.tables import write_csv
from kvcompress.eval.tasks import niah_single, score
from kvcompress.integration import build_prompt

RESULTS = Path(__file__).parent / "results"
DEPTHS = [i / 10 for i in range(11)]
RATIO = 0.75
MAX_NEW_TOKENS = 32


def tova_press(ratio: float):
    """kvpress's TOVAPress, its forward hook given the `cache_position` transformers 5.23 no longer passes."""
    import kvpress.presses.base_press as base_press
    from kvpress.presses.tova_press import TOVAPress

    hook = base_press.BasePress.forward_hook
    base_press.is_prefilling = lambda cache_position, q_len: True
    base_press.BasePress.forward_hook = lambda self, module, args, kwargs, output: hook(self, module, args, {"cache_position": None, **kwargs}, output)
    return TOVAPress(compression_ratio=ratio)


@torch.inference_mode()
def answer(model, press, context_ids: torch.Tensor, question_ids: torch.Tensor, eos: int) -> tuple[list[int], int]:
    """(greedy answer ids, tokens kept per layer) with the context compressed by `press`, as kvpress's pipeline does."""
    cache = DynamicCache()
    with press(model):
        model.model(input_ids=context_ids, past_key_values=cache)
    kept = cache.get_seq_length()
    n = context_ids.shape[1] + question_ids.shape[1]
    out = model(input_ids=question_ids, past_key_values=cache, position_ids=torch.arange(context_ids.shape[1], n).unsqueeze(0))
    ids = [int(out.logits[0, -1].argmax())]
    while len(ids) < MAX_NEW_TOKENS and ids[-1] != eos:
        out = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=cache, position_ids=torch.tensor([[n + len(ids) - 1]]))
        ids.append(int(out.logits[0, -1].argmax()))
    return ids, kept


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=RESULTS, help=f"folder of tova_kvpress_check.{{csv,md}} (default {RESULTS.relative_to(RESULTS.parent.parent)})")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    machine = machine_description(1)
    model, tok = kvc.load_model()
    press = tova_press(RATIO)
    rows = []
    for index, depth in enumerate(DEPTHS):
        sample = niah_single(target_tokens=2048, depth=depth, seed=index, tokenizer=tok, haystack="filler")
        context_ids, question_ids = build_prompt(tok, sample.context, sample.question, sample.answer_prefix)
        ids, kept = answer(model, press, context_ids, question_ids, tok.eos_token_id)
        text = tok.decode(ids, skip_special_tokens=True)
        rows.append({"cell": "kvpress TOVAPress", "depth": depth, "context_tokens": context_ids.shape[1], "kept_tokens": kept,
                     "hit": score(sample, text), "answer": sample.answers[0], "prediction": text.strip().replace("\n", " ")})
        print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "tova_kvpress_check.csv", rows)
    hits = int(sum(r["hit"] for r in rows))
    low, high = wilson(hits, len(rows))
    missed = ", ".join(f"{r['depth']:g}" for r in rows if r["hit"] < 1) or "-"
    lines = [
        f"# kvpress's TOVAPress on the filler needle task: 2048 tokens, {len(DEPTHS)} depths, compression ratio {RATIO}, question kept out",
        "",
        f"Machine: {machine}; default model, greedy, one sample per depth (the samples of tova_needles.md). 95% Wilson interval. "
        "Command: `PYTHONPATH=.:/path/to/kvpress python benchmarks/tova_kvpress_check.py` (kvpress github NVIDIA/kvpress 8bb29b9c).",
        "",
        "| cell | hits | rate | 95% interval | depths missed |",
        "|---|---|---|---|---|",
        f"| kvpress TOVAPress | {hits}/{len(rows)} | {hits / len(rows):.2f} | [{low:.2f}, {high:.2f}] | {missed} |",
    ]
    (args.out / "tova_kvpress_check.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
