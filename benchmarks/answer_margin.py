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

With --cells (kvcompress cells of the harness, the first one the reference) and --ratios, the same answer is also
fed through each cell's compressed cache (`kvcompress.integration.answer_log_probs_ids`, built as the harness
builds it, KVzip's reconstruction recorded once per sample): OUT/margin_cells.jsonl gets, per sample, cell and
ratio, every answer step's margin and the first step's KL divergence from the full cache's distribution (nats),
and OUT/margin_cells.md the mean KL per cell and ratio (95% bootstrap interval), each cell's paired difference
from the reference, and how many of the full cache's hits keep a positive first-step margin. A continuous
measure: it tells two caches apart on samples where both give the same answer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
from scipy.stats import bootstrap, mannwhitneyu

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvpress_side_by_side as harness  # noqa: E402  (the dumped samples and their records)


def answer_margins(model, prompt_ids: list[int], answer_ids: list[int]) -> tuple[list[float], list[int]]:
    """(margins, runner_up): for each answer step i, log p(answer_ids[i]) minus the highest log p of any other token,
    given the prompt and answer_ids[:i], and that other token's id; one forward over prompt + answer."""
    ids = torch.tensor([prompt_ids + answer_ids], device=model.device)
    with torch.no_grad():
        logits = model(ids, logits_to_keep=len(answer_ids) + 1).logits[0, : len(answer_ids)]
    return step_margins(logits.float().log_softmax(-1), answer_ids)


def step_margins(log_probs: torch.Tensor, answer_ids: list[int]) -> tuple[list[float], list[int]]:
    """(margins, runner_up) from log_probs [a, V] (row i: the distribution of answer token i): log p(answer_ids[i])
    minus the highest log p of any other token, and that token's id."""
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
    parser.add_argument("--cells", default=None, help="kvcompress cells to feed the answer through, comma-separated, the first the reference")
    parser.add_argument("--ratios", type=harness.parse_ratios, default=None,
                        help="their compression ratios, comma-separated, each in [0, 1) (with --cells)")
    parser.add_argument("--sample-indices", default=None, help="only these samples (their indices in the dump, comma-separated); default all")
    args = parser.parse_args(argv)
    if bool(args.cells) != bool(args.ratios):
        parser.error(f"--cells and --ratios go together, got --cells {args.cells!r} and --ratios {args.ratios!r}")
    cells = harness.parse_list(args.cells, harness.KVCOMPRESS_CELLS) if args.cells else []
    if harness.FULL in cells:
        parser.error("--cells takes compressed cells: the full cache is what they are measured against")
    ratios = args.ratios or []
    args.cells, args.ratios, args.device, args.shard, args.skip_checkpoint_hash, args.full_cache_hits = (
        harness.FULL, None, "cpu", None, False, False)  # what open_run reads: the samples are --sample-indices
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
    if cells:
        cells_path = Path(args.out) / "margin_cells.jsonl"
        run_cells(run, records, cells, ratios, cells_path)
        write_cell_tables(Path(args.out) / "margin_cells.md", harness.read_jsonl(cells_path), cells, ratios)


def run_cells(run, records: dict, cells: list[str], ratios: list[float], path: Path) -> None:
    """Append to `path` one row per (sample, cell, ratio) not there yet: the full cache's answer fed through the cell's
    cache, its margins at every step and the first step's KL divergence from the full cache (nats)."""
    from kvcompress.eval.capture import capture_qkv
    from kvcompress.integration import answer_log_probs_ids

    done = {(r["sample"], r["cell"], r["ratio"]) for r in harness.read_jsonl(path)} if path.exists() else set()
    for sample in run.samples:
        full = records.get(harness.cell_key("kvcompress", harness.FULL, None, sample["id"]))
        todo = [(cell, ratio) for cell in cells for ratio in ratios if (sample["id"], cell, ratio) not in done]
        if full is None or full.get("error") or not todo:
            continue
        context_ids = torch.tensor([sample["context_ids"]], device=run.device)
        question_ids = torch.tensor([sample["question_ids"]], device=run.device)
        answer_ids = torch.tensor([full["token_ids"]], device=run.device)
        reference = answer_log_probs_ids(run.model, context_ids, question_ids, answer_ids, method=None)
        captured, reconstructions = None, {}
        for cell, ratio in todo:
            options = harness.kvcompress_options(cell, ratio, run.manifest, run.tokenizer)
            if not options.compressor.requirements.needs("reconstruction") and not options.streams and captured is None:
                captured = capture_qkv(run.model, context_ids)
            own = harness.recorded_inputs(run.model, options, context_ids, captured, reconstructions)
            log_probs = answer_log_probs_ids(run.model, context_ids, question_ids, answer_ids, options, **own)
            margins, _ = step_margins(log_probs, full["token_ids"])
            kl = float((reference[0].exp() * (reference[0] - log_probs[0])).sum())
            row = {"sample": sample["id"], "index": sample["index"], "full_score": full["score"], "cell": cell, "ratio": ratio,
                   "margins": margins, "kl": kl}
            harness.append_jsonl(path, row)
            print(f"{sample['id']} {cell} {ratio}: first-step margin {margins[0]:.2f}, KL {kl:.4f}", flush=True)


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its 95% percentile-bootstrap interval (a fixed seed; one value: the value)."""
    if len(values) < 2:
        return (values[0],) * 3
    res = bootstrap((np.asarray(values),), np.mean, confidence_level=0.95, method="percentile", random_state=0)
    return float(np.mean(values)), float(res.confidence_interval.low), float(res.confidence_interval.high)


def write_cell_tables(path: Path, rows: list[dict], cells: list[str], ratios: list[float]) -> None:
    """margin_cells.md from margin_cells.jsonl's rows: per cell and ratio, over the samples every listed cell has at
    that ratio, the mean first-step KL (95% interval), the paired difference from the first cell, and the full
    cache's hits whose first-step margin stays positive."""
    by = {(r["cell"], r["ratio"], r["sample"]): r for r in rows}
    lines = ["| cell | ratio | samples | first-step KL, mean (95%) | minus the first cell's (95%) | full cache's hits with margin > 0 | "
             "their median first-step margin |", "|---|---|---|---|---|---|---|"]
    for ratio in ratios:
        samples = sorted({r["sample"] for r in rows if r["ratio"] == ratio and all((c, ratio, r["sample"]) in by for c in cells)})
        if not samples:
            continue
        base = [by[(cells[0], ratio, s)]["kl"] for s in samples]
        for cell in cells:
            got = [by[(cell, ratio, s)] for s in samples]
            kl = mean_interval([r["kl"] for r in got])
            diff = "–" if cell == cells[0] else "{:+.4f} ({:+.4f} to {:+.4f})".format(*mean_interval([r["kl"] - b for r, b in zip(got, base)]))
            hits = [r["margins"][0] for r in got if r["full_score"] == 1.0]
            held = sum(m > 0 for m in hits)
            lines.append(f"| {cell} | {ratio} | {len(samples)} | {kl[0]:.4f} ({kl[1]:.4f}–{kl[2]:.4f}) | {diff} | {held} of {len(hits)} | "
                         f"{statistics.median(hits) if hits else float('nan'):.2f} |")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_tables(path: Path, rows: list[dict], records: list[dict]) -> None:
    """margin.md from margin.jsonl's `rows` and the folder's answer `records`: one line per compressed cell and ratio."""
    hits = sorted((r for r in rows if r["full_score"] == 1.0), key=lambda r: r["index"])
    if not hits:
        path.write_text(f"The full cache finds none of the {len(rows)} samples: no hit to keep.\n", encoding="utf-8")
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
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
