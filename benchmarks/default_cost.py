"""What one answer costs: `kvc.generate` with a method against a plain transformers `model.generate` of the same prompt
tokens, on the default model, at one thread count (the ratio is what is reported).

For each context length (real prose, `eval.capture.prose_text`, cut to the length in tokens) the prompt is built once
(`build_prompt`, the layout `kvc.generate` uses); every call answers `--new-tokens` tokens (no stop at the end of text,
so every call writes as many): a plain greedy `model.generate` of those ids, or a (method, mode, ratio) cell. Each cell
is measured beside plain generates of its own: `--warmup` untimed then `--repeats` timed pairs (a plain generate, then
the cell), and its ratio is its median over the median of those plain generates, so that the host's drift over the run
cancels. With `--pairing process` (the default) each cell runs in a fresh process of this script: what a process ran
before moves a call's time (its allocator's state: a plain generate after a stream's answers paid some 300k page faults
in this project's measurements, and a stream's answer takes longer after other cells' than after its own), so no cell
runs after another; `--pairing cell` measures every cell in this process, one after the other. With `--pairing round`
(the records before 2026-12-03) each round calls a plain generate and then every cell in turn, and every cell is
divided by the one plain median. The median seconds per call, the plain median it is divided by (`plain_s`; the
`plain` row: the median over the cells) and the ratio are written to OUT as CSV, with the KV bytes the answer's cache
stored after the answer ÷ the full cache's for the same tokens (`GenerationResult.kv_bytes`, not the peak), the machine,
threads and date:

    .venv/bin/python benchmarks/default_cost.py --lengths 2048,4096,8192 --methods default,kvzap --threads 1 \\
        --out benchmarks/results/default_cost.csv
"""

from __future__ import annotations

import argparse
import csv
import functools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.commands.common import count_list, list_of, ratio_list
from kvcompress.eval.bench.common import machine_description
from kvcompress.eval.capture import prose_text
from kvcompress.integration import build_prompt
from kvcompress.names import MODES
from kvcompress.options import CompressionOptions

QUESTION = "What is the main subject of the text above? Answer in one sentence."
# name -> (method, method_params, exact sink/window and chunk_size settings)
VARIANTS = {
    "default": ("default", {}, {}),
    # the default storing what it keeps in 4 bits, its ratio in tokens (a lower ratio for equal memory)
    "default_4bit": ("default", {}, {"kv_bits": 4, "budget_unit": "tokens"}),
    # the streams' method and slack at full precision, its ratio in tokens (the default in chunked and decode modes stores
    # 8-bit slots, the ratio read as memory); and the same with the prompt in blocks of 128 tokens (the library's 256)
    "streams_full_precision": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05}, {"slack": 0.1}),
    "streams_full_precision_chunk_128": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05},
                                         {"slack": 0.1, "chunk_size": 128}),
    "kvzip_refit": ("kvzip_refit", {}, {}),
    "kvzap": ("kvzap", {}, {}),
    "adakv_kvzap": ("adakv", {"scorer": "kvzap", "alpha_safeguard": 0.05}, {}),
    # the default's method at full precision, its ratio in tokens (in the streams at the library's slack, 0.5)
    "adakv_kvzap_model": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05}, {}),
    "snapkv": ("snapkv", {}, {}),
}


@functools.cache
def mode_refusal(name: str, mode: str) -> str | None:
    """Why the variant `name` (of VARIANTS) does not run in mode `mode` (what `CompressionOptions` says when it refuses the
    variant's settings in that mode: a prefill-only named setting in a stream, a stream's slack or block size in mode
    "prefill"), None when it runs. The variants' settings are this script's own, so a mode is the only thing refused."""
    method, params, exact = VARIANTS[name]
    try:
        CompressionOptions.build(method=method, method_params=params, compression_ratio=0.75, mode=mode, **exact)
    except ValueError as error:
        return str(error)
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, checked before any model loads: --methods among VARIANTS, --modes among `names.MODES`, --ratios in
    [0, 1), --lengths integers >= 1, and at least one (method, mode) cell that runs (`mode_refusal`)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=count_list, default="2048,4096,8192", help="comma-separated context lengths in tokens")
    p.add_argument("--methods", type=list_of(list(VARIANTS), "variant"), default="default",
                   help=f"comma-separated, among {','.join(VARIANTS)}")
    p.add_argument("--modes", type=list_of(MODES, "mode"), default=",".join(MODES),
                   help=f"comma-separated, among {','.join(MODES)} (a variant that does not run in a mode is left out of it, "
                        "with the reason printed)")
    p.add_argument("--ratios", type=ratio_list, default="0.75", help="comma-separated compression ratios (each a round of every cell)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1, help="untimed pairs (or rounds) of calls before the timed ones (default 1)")
    p.add_argument("--pairing", choices=("process", "cell", "round"), default="process",
                   help="process: each cell in a fresh process, beside plain generates of its own (default); cell: the same, every cell in "
                        "this process; round: one plain generate, then every cell, per round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if not cells_of(args):
        p.error(f"no variant of --methods {','.join(args.methods)} runs in any of --modes {','.join(args.modes)}: "
                + "; ".join(f"{name} in {mode}: {mode_refusal(name, mode)}" for name in args.methods for mode in args.modes))
    return args


def context_of(tokenizer, tokens: int) -> str:
    ids = tokenizer(prose_text(n_chars=6 * tokens), add_special_tokens=False)["input_ids"][:tokens]
    return tokenizer.decode(ids)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for name in args.methods:
        for mode in args.modes:
            reason = mode_refusal(name, mode)
            if reason is not None:
                print(f"{name} is not measured in mode {mode}: {reason}", file=sys.stderr, flush=True)
    if args.pairing == "process":
        return write_rows(args.out, rows_in_processes(args))
    torch.set_num_threads(args.threads)
    model, tokenizer = kvc.load_model()
    rows = []
    for length in args.lengths:
        context = context_of(tokenizer, length)
        context_ids, question_ids = build_prompt(tokenizer, context, QUESTION)
        prompt = torch.cat([context_ids, question_ids], 1)
        cells = cells_of(args)
        stored: dict[tuple, float] = {}

        def plain_generate() -> float:
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                               do_sample=False, pad_token_id=tokenizer.eos_token_id)
            return time.perf_counter() - start

        def answer(cell) -> float:
            """Seconds of one answer of the cell."""
            name, mode, ratio = cell
            method, params, exact = VARIANTS[name]
            start = time.perf_counter()
            res = kvc.generate(model, tokenizer, context, QUESTION, method=method, method_params=params, compression_ratio=ratio,
                               mode=mode, max_new_tokens=args.new_tokens, stop_at_eos=False, progress=False, **exact)
            seconds = time.perf_counter() - start
            stored[cell] = res.kv_bytes / res.kv_bytes_full
            return seconds

        # cell -> (its timed answers, the timed plain generates it is divided by)
        measured: dict[tuple, tuple[list[float], list[float]]] = {}
        if args.pairing == "cell":
            for cell in cells:
                times, plains = [], []
                for round_index in range(args.warmup + args.repeats):
                    plain_seconds, seconds = plain_generate(), answer(cell)
                    if round_index >= args.warmup:
                        plains.append(plain_seconds)
                        times.append(seconds)
                measured[cell] = (times, plains)
            every_plain = [seconds for _, plains in measured.values() for seconds in plains]
        else:
            every_plain = []
            for round_index in range(args.warmup + args.repeats):
                plain_seconds = plain_generate()
                if round_index >= args.warmup:
                    every_plain.append(plain_seconds)
                for cell in cells:
                    seconds = answer(cell)
                    if round_index >= args.warmup:
                        measured.setdefault(cell, ([], every_plain))[0].append(seconds)
        for (name, mode, ratio), (seconds, plains) in {("plain", "generate", 0.0): (every_plain, every_plain), **measured}.items():
            plain = statistics.median(plains)
            row = {"tokens": prompt.shape[1], "context_tokens": length, "method": name, "mode": mode, "ratio": ratio,
                   "median_s": round(statistics.median(seconds), 3), "plain_s": round(plain, 3),
                   "over_plain": round(statistics.median(seconds) / plain, 3), "pairing": args.pairing,
                   "kv_over_full": round(stored.get((name, mode, ratio), 1.0), 4),
                   "repeats": args.repeats, "new_tokens": args.new_tokens, "threads": args.threads,
                   "machine": machine_description(torch.get_num_threads()),
                   "date": time.strftime("%Y-%m-%d")}
            rows.append(row)
            print(row, flush=True)
    write_rows(args.out, rows)


def cells_of(args) -> list[tuple[str, str, float]]:
    """The (method, mode, ratio) cells the arguments name, ratio by ratio, less those whose variant does not run in their
    mode (`mode_refusal`)."""
    return [(m, mode, r) for r in args.ratios for m in args.methods for mode in args.modes if mode_refusal(m, mode) is None]


def rows_in_processes(args) -> list[dict]:
    """`--pairing process`: each (length, cell) measured by a fresh process of this script (`--pairing cell`, that cell alone),
    so that no cell runs after another in the same process; their rows, and per length a `plain` row whose `plain_s` is the
    median of the cells' plain medians."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "cell.csv"
        for length in args.lengths:
            plains, cells = [], []
            for name, mode, ratio in cells_of(args):
                out.unlink(missing_ok=True)
                subprocess.run([sys.executable, __file__, "--lengths", str(length), "--methods", name, "--modes", mode, "--ratios", str(ratio),
                                "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--warmup", str(args.warmup),
                                "--threads", str(args.threads), "--pairing", "cell", "--out", str(out)], check=True)
                plain_row, cell_row = csv.DictReader(out.open(encoding="utf-8"))  # the cell's process measures it or fails
                plains.append(plain_row)
                cells.append({**cell_row, "pairing": "process"})
            plain = round(statistics.median(float(row["plain_s"]) for row in plains), 3)
            rows += [{**plains[0], "median_s": plain, "plain_s": plain, "pairing": "process"}, *cells]
    return rows


def write_rows(path: Path, rows: list[dict]) -> None:
    """rows as CSV at path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
