"""How sure the full cache is of its own answer, beside which compressed caches keep that answer.

A compressed cache changes the logits a little; a sample where the full cache barely prefers its answer to
another token flips under a small change, whatever the method. This script tells those samples apart. For a
folder dumped by `kvpress_side_by_side.py` whose kvcompress full cache has run, it feeds each sample's prompt
followed by the full cache's recorded answer tokens through the model once (the full cache, teacher forcing)
and records at every answer step the margin in nats: log p of the answer's token minus log p of the best other
token (negative where another token is preferred; the full cache's greedy answer has margins >= 0 up to
rounding). The first step is where the answer is chosen (the name, or a word such as "the" that leads away).

Appends one JSON line per sample to OUT/margin.jsonl (a rerun skips what is there) and writes OUT/margin.md: for
every (library, cell, ratio) recorded in the folder, the full cache's hits split by whether the cell keeps them,
with the first-step margins of each group, a two-sided Mann-Whitney test between them, and the hits kept in each
third of the hits ranked by margin:

    .venv/bin/python benchmarks/answer_margin.py --out results/kvpress_side_by_side_prose_4k
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from scipy.stats import mannwhitneyu

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvpress_side_by_side as harness  # noqa: E402  (the dumped samples and their records)


def answer_margins(model, prompt_ids: list[int], answer_ids: list[int]) -> tuple[list[float], list[int]]:
    """(margins, runner_up): for each answer step i, log p(answer_ids[i]) minus the highest log p of any other token,
    given the prompt and answer_ids[:i], and that other token's id; one forward over prompt + answer."""
    ids = torch.tensor([prompt_ids + answer_ids], device=model.device)
    with torch.no_grad():
        logits = model(ids, logits_to_keep=len(answer_ids) + 1).logits[0, : len(answer_ids)]
    log_probs = logits.float().log_softmax(-1)
    chosen = torch.tensor(answer_ids, device=log_probs.device)
    answer_lp = log_probs.gather(-1, chosen[:, None])[:, 0]
    others = log_probs.scatter(-1, chosen[:, None], -torch.inf)
    best_other, runner_up = others.max(-1)
    return (answer_lp - best_other).tolist(), runner_up.tolist()


def thirds(values: list[float]) -> list[list[int]]:
    """Indices of `values` in three groups of (nearly) equal size by rank: lowest third first."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    cuts = [round(len(order) * k / 3) for k in range(4)]
    return [order[cuts[k]: cuts[k + 1]] for k in range(3)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="a folder dumped by kvpress_side_by_side.py, its kvcompress full cache run")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    args.cells, args.ratios, args.device, args.shard, args.skip_checkpoint_hash = harness.FULL, None, "cpu", None, False
    run = harness.open_run(args, "kvcompress", harness.KVCOMPRESS_CELLS)
    records = {r["key"]: r for r in harness.read_records(Path(args.out))}
    out_path = Path(args.out) / "margin.jsonl"
    done = {r["sample"] for r in harness.read_jsonl(out_path)} if out_path.exists() else set()
    for sample in run.samples:
        full = records.get(harness.cell_key("kvcompress", harness.FULL, None, sample["id"]))
        if full is None or full.get("error") or sample["id"] in done:
            continue
        margins, runner_up = answer_margins(run.model, sample["context_ids"] + sample["question_ids"], full["token_ids"])
        row = {"sample": sample["id"], "index": sample["index"], "full_score": full["score"], "answer": full["prediction"],
               "margins": margins, "runner_up": run.tokenizer.convert_ids_to_tokens(runner_up)}
        harness.append_jsonl(out_path, row)
        print(f"{sample['id']}: first-step margin {margins[0]:.2f} (runner-up {row['runner_up'][0]!r}), answer {full['prediction']!r}", flush=True)
    write_tables(Path(args.out) / "margin.md", harness.read_jsonl(out_path), list(records.values()))


def write_tables(path: Path, rows: list[dict], records: list[dict]) -> None:
    """margin.md from margin.jsonl's `rows` and the folder's answer `records`: one line per compressed cell and ratio."""
    hits = sorted((r for r in rows if r["full_score"] == 1.0), key=lambda r: r["index"])
    if not hits:
        path.write_text(f"The full cache finds none of the {len(rows)} samples: no hit to keep.\n")
        return
    first = {r["sample"]: r["margins"][0] for r in hits}
    groups = thirds([first[r["sample"]] for r in hits])
    bounds = [(min(first[hits[i]["sample"]] for i in g), max(first[hits[i]["sample"]] for i in g)) for g in groups if g]
    lines = [f"The full cache's hits: {len(hits)} of {len(rows)} samples; first-step margin (nats) median "
             f"{statistics.median(first.values()):.2f}, thirds by margin {', '.join(f'{lo:.2f}–{hi:.2f}' for lo, hi in bounds)}.", "",
             "| library | cell | ratio | hits kept | median margin, kept | median margin, lost | lost hits' margins | Mann-Whitney p | kept per third (low, mid, high) |",
             "|---|---|---|---|---|---|---|---|---|"]
    scores: dict[tuple, dict[str, float]] = {}
    for r in records:
        if r["cell"] != harness.FULL and not r.get("error"):
            scores.setdefault((r["library"], r["cell"], r["ratio"]), {})[r["sample"]] = r["score"]
    for (library, cell, ratio), by_sample in sorted(scores.items(), key=lambda kv: kv[0]):
        paired = [r for r in hits if r["sample"] in by_sample]
        if not paired:
            continue
        kept = [first[r["sample"]] for r in paired if by_sample[r["sample"]] == 1.0]
        lost = [first[r["sample"]] for r in paired if by_sample[r["sample"]] != 1.0]
        p = f"{mannwhitneyu(kept, lost).pvalue:.2g}" if kept and lost else "–"
        per_third = [f"{sum(by_sample.get(hits[i]['sample']) == 1.0 for i in g)}/{sum(hits[i]['sample'] in by_sample for i in g)}" for g in groups]
        lines.append(f"| {library} | {cell} | {ratio} | {len(kept)} of {len(paired)} | "
                     f"{statistics.median(kept) if kept else float('nan'):.2f} | {statistics.median(lost) if lost else float('nan'):.2f} | "
                     f"{', '.join(f'{m:.2f}' for m in sorted(lost))} | {p} | {', '.join(per_third)} |")
    lines += ["", "| sample | full cache's answer | first-step margin | runner-up token |", "|---|---|---|---|"]
    lines += [f"| {r['index']} | {r['answer']!r} | {r['margins'][0]:.2f} | {r['runner_up'][0]!r} |" for r in hits]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
