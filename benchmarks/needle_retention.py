"""Which of a needle's tokens a compressed cache keeps, beside whether the answer was found.

A missed needle can mean two things: its tokens were evicted, or they were kept and the model still
answered from the surrounding text. This script tells them apart. For a folder dumped by
`kvpress_side_by_side.py` (its `manifest.json` and `samples.jsonl`) and a kvcompress cell of that
harness, it compresses each chosen sample's context as the harness does (one recorded prefill, or one
recorded reconstruction for KVzip-scored cells), finds the needle sentence's tokens in the context
ids, and counts the (layer, KV head, token) slots of the sentence and of its answer the cache holds.
Each is set beside the fraction of the whole context the cache holds, and beside the answer the
harness recorded for that cell, sample and ratio (if the folder has it).

Appends one JSON line per (cell, sample, ratio) to OUT/retention.jsonl (a rerun skips what is there) and
writes every line of it as tables to OUT/retention.md, one per cell and ratio, each with the mean
fractions kept over the samples whose needle the full cache finds, split by whether the cell finds it too:

    .venv/bin/python benchmarks/needle_retention.py --out results/kvpress_side_by_side_prose_4k \\
        --cell 'adakv[scorer=kvzip,scope=model,window=0,alpha=0.05]' --ratios 0.75,0.9 --sample-indices 2,7,12,21,23,26
"""

from __future__ import annotations

import argparse
import bisect
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvpress_side_by_side as harness  # noqa: E402  (the dumped samples, the cells and their records)

from kvcompress.cache import CompressedCache  # noqa: E402
from kvcompress.integration.capture import capture_qkv  # noqa: E402
from kvcompress.integration.generation import compress_context_ids  # noqa: E402
from kvcompress.integration.reconstruction import load_reconstruction, shared_reconstruction, with_repeat_prompt  # noqa: E402
from kvcompress.options import CompressionOptions  # noqa: E402


def token_span(tokenizer, ids: list[int], text: str) -> list[int]:
    """Indices of the tokens of `ids` whose decoded characters overlap the first occurrence of `text` in the
    decoded ids. Raises ValueError when the ids do not contain `text`."""
    decoded = tokenizer.decode(ids)
    begin = decoded.find(text)
    if begin < 0:
        raise ValueError(f"the context ids do not contain {text!r}")
    # the characters of ids[:i + 1] grow with i: the span runs from the first prefix that reaches past `begin`
    # to the first that covers the text's end, found by bisection (O(log n) decodes, not one per token)
    decoded_length = lambda i: len(tokenizer.decode(ids[: i + 1]))  # noqa: E731
    first = bisect.bisect_right(range(len(ids)), begin, key=decoded_length)
    last = bisect.bisect_left(range(len(ids)), begin + len(text), key=decoded_length)
    return list(range(first, last + 1))


def held(cache: CompressedCache, span: list[int]) -> list[torch.Tensor]:
    """Per layer: bool [H_kv, len(span)], whether each KV head holds each token of `span` (by original position)."""
    wanted = torch.tensor(span)
    masks = []
    for layer in cache.layers:
        stored = layer.stored()
        positions = stored.positions[0].masked_fill(~torch.isfinite(stored.log_weights[0]), -1)  # [H_kv, slots]; empty slots -1
        masks.append((positions.unsqueeze(-1) == wanted.to(positions.device)).any(-2).cpu())
    return masks


def compressed(model, tokenizer, options: CompressionOptions, context_ids: torch.Tensor, recorded: dict) -> CompressedCache:
    """The context compressed as the harness's kvcompress step does: from one recorded reconstruction for a method
    scored by it, by its own forward for a method that reads the layers' hidden states (KVzap, which a recording does
    not keep), else from one recorded prefill (the recordings kept in `recorded` for the sample's other ratios)."""
    needs = options.compressor.requirements
    if needs.needs("reconstruction"):
        options = with_repeat_prompt(options, tokenizer)
        cache = CompressedCache(model, options)
        reconstructions = recorded.setdefault("reconstructions", {})
        load_reconstruction(model, cache, shared_reconstruction(model, options, context_ids, reconstructions))
        return cache
    if not needs.compresses_a_recorded_prefill:
        return compress_context_ids(model, context_ids, options)
    if "prefill" not in recorded:
        recorded["prefill"] = capture_qkv(model, context_ids)
    return CompressedCache.from_prefill(model, options, recorded["prefill"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="a folder dumped by kvpress_side_by_side.py")
    prefill_cells = sorted(label for label, (method, _) in harness.KVCOMPRESS_CELLS.items()
                           if method is not None and not harness.streams(label))  # the cells that compress a recorded prefill
    parser.add_argument("--cell", required=True, help=f"a compressing kvcompress prefill cell (no streaming one) among {prefill_cells}")
    parser.add_argument("--ratios", type=harness.parse_ratios, required=True, help="comma-separated compression ratios, each in [0, 1)")
    parser.add_argument("--sample-indices", required=True, help="comma-separated sample indices of the folder")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.cell not in prefill_cells:
        parser.error(f"--cell must be a compressing prefill cell of the harness, among {prefill_cells}; got {args.cell!r}")
    ratios = args.ratios

    # what open_run reads: the samples are --sample-indices
    args.cells, args.device, args.shard, args.skip_checkpoint_hash, args.full_cache_hits = args.cell, "cpu", None, False, False
    run = harness.open_run(args, "kvcompress", harness.KVCOMPRESS_CELLS)
    answers = {r["key"]: r for r in harness.read_records(Path(args.out))}
    method, params = harness.KVCOMPRESS_CELLS[args.cell]
    out_path = Path(args.out) / "retention.jsonl"
    done = {(r["cell"], r["sample"], r["ratio"]) for r in harness.read_jsonl(out_path)} if out_path.exists() else set()
    for sample in run.samples:
        context_ids = torch.tensor([sample["context_ids"]])
        needle = sample["needles"][0]
        needle_span = token_span(run.tokenizer, sample["context_ids"], needle)
        answer_columns = token_span(run.tokenizer, [sample["context_ids"][p] for p in needle_span], sample["answers"][0])
        recorded: dict = {}
        for ratio in [r for r in ratios if (args.cell, sample["id"], r) not in done]:
            options = CompressionOptions.build(method=method, compression_ratio=ratio, seed=run.manifest["samples"]["seed"], **params)
            cache = compressed(run.model, run.tokenizer, options, context_ids, recorded)
            masks = held(cache, needle_span)
            per_layer = [mask.float().mean().item() for mask in masks]
            record = answers.get(harness.cell_key("kvcompress", args.cell, ratio, sample["id"]), {})
            full = answers.get(harness.cell_key("kvcompress", harness.FULL, None, sample["id"]), {})
            row = {
                "sample": sample["id"], "index": sample["index"], "cell": args.cell, "ratio": ratio, "needle": needle,
                "needle_tokens": len(needle_span),
                "context_kept": sum(layer.slots() for layer in cache.layers) / (len(cache.layers) * len(sample["context_ids"])),
                "needle_kept": sum(per_layer) / len(per_layer),
                "answer_kept": sum(mask[:, answer_columns].float().mean().item() for mask in masks) / len(masks),
                "needle_kept_per_layer": per_layer, "full_score": full.get("score"),
                "score": record.get("score"), "prediction": record.get("prediction"),
            }
            harness.append_jsonl(out_path, row)
            print(f"{sample['id']} @ {ratio}: needle {row['needle_kept']:.2f} answer {row['answer_kept']:.2f} "
                  f"context {row['context_kept']:.2f} score {row['score']} {row['prediction']!r}", flush=True)
    write_tables(Path(args.out) / "retention.md", harness.read_jsonl(out_path))


def write_tables(path: Path, rows: list[dict]) -> None:
    """One table per (cell, ratio) of `rows` (retention.jsonl's lines), by sample, then the means over the full
    cache's hits that the cell finds and that it misses."""
    lines = []
    for cell, ratio in sorted({(r["cell"], r["ratio"]) for r in rows}):
        group = sorted((r for r in rows if (r["cell"], r["ratio"]) == (cell, ratio)), key=lambda r: r["index"])
        lines += [f"## {cell} @ {ratio}", "",
                  "| sample | full cache | cell's answer | needle kept % | answer kept % | context kept % | layers keeping < 10 % of the needle |",
                  "|---|---|---|---|---|---|---|"]
        for r in group:
            low = sum(f < 0.1 for f in r["needle_kept_per_layer"])
            lines.append(f"| {r['index']} | {r['full_score']} | {r['score']} {r['prediction']!r} | {100 * r['needle_kept']:.0f} | "
                         f"{100 * r['answer_kept']:.0f} | {100 * r['context_kept']:.0f} | {low} of {len(r['needle_kept_per_layer'])} |")
        lines.append("")
        for found, label in ((1.0, "found by the cell too"), (0.0, "missed by the cell")):
            picked = [r for r in group if r["full_score"] == 1.0 and r["score"] == found]
            if picked:
                mean = {k: 100 * sum(r[k] for r in picked) / len(picked) for k in ("needle_kept", "answer_kept", "context_kept")}
                lines.append(f"- the full cache's hits {label}: {len(picked)}; mean kept: needle {mean['needle_kept']:.0f} %, "
                             f"answer {mean['answer_kept']:.0f} %, context {mean['context_kept']:.0f} %")
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    main()
