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
stored ÷ the full cache's for the same tokens (`GenerationResult.kv_bytes`, the peak), the machine, threads and date:

    .venv/bin/python benchmarks/default_cost.py --lengths 2048,4096,8192 --methods default,kvzap --threads 1 \\
        --out benchmarks/results/default_cost.csv
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.eval.bench.common import machine_description
from kvcompress.eval.capture import prose_text
from kvcompress.integration import build_prompt

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


def context_of(tokenizer, tokens: int) -> str:
    ids = tokenizer(prose_text(n_chars=6 * tokens), add_special_tokens=False)["input_ids"][:tokens]
    return tokenizer.decode(ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--methods", default="default", help=f"comma-separated, among {','.join(VARIANTS)}")
    p.add_argument("--modes", default="prefill,chunked,decode")
    p.add_argument("--ratios", default="0.75", help="comma-separated compression ratios (each a round of every cell)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1, help="untimed pairs (or rounds) of calls before the timed ones (default 1)")
    p.add_argument("--pairing", choices=("process", "cell", "round"), default="process",
                   help="process: each cell in a fresh process, beside plain generates of its own (default); cell: the same, every cell in "
                        "this process; round: one plain generate, then every cell, per round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.pairing == "process":
        return write_rows(args.out, rows_in_processes(args))
    torch.set_num_threads(args.threads)
    model, tokenizer = kvc.load_model()
    rows = []
    for length in map(int, args.lengths.split(",")):
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

        def answer(cell) -> float | None:
            """Seconds of one answer of the cell, None when its method does not run in its mode."""
            name, mode, ratio = cell
            method, params, exact = VARIANTS[name]
            start = time.perf_counter()
            try:
                res = kvc.generate(model, tokenizer, context, QUESTION, method=method, method_params=params, compression_ratio=ratio,
                                   mode=mode, max_new_tokens=args.new_tokens, stop_at_eos=False, progress=False, **exact)
            except ValueError as error:  # a variant that does not run in this mode (e.g. kvzip_refit streams not)
                print(f"{name} {mode}: {error}")
                return None
            seconds = time.perf_counter() - start
            stored[cell] = res.kv_bytes / res.kv_bytes_full
            return seconds

        # cell -> (its timed answers, the timed plain generates it is divided by); cells that do not run are left out
        measured: dict[tuple, tuple[list[float], list[float]]] = {}
        if args.pairing == "cell":
            for cell in cells:
                times, plains = [], []
                for round_index in range(args.warmup + args.repeats):
                    plain_seconds, seconds = plain_generate(), answer(cell)
                    if seconds is None:
                        break
                    if round_index >= args.warmup:
                        plains.append(plain_seconds)
                        times.append(seconds)
                else:
                    measured[cell] = (times, plains)
            every_plain = [seconds for _, plains in measured.values() for seconds in plains]
        else:
            every_plain, running = [], list(cells)
            for round_index in range(args.warmup + args.repeats):
                plain_seconds = plain_generate()
                if round_index >= args.warmup:
                    every_plain.append(plain_seconds)
                for cell in list(running):
                    seconds = answer(cell)
                    if seconds is None:
                        running.remove(cell)
                    elif round_index >= args.warmup:
                        measured.setdefault(cell, ([], every_plain))[0].append(seconds)
            measured = {cell: measured[cell] for cell in running if cell in measured}
        if not measured:
            continue
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
    """The (method, mode, ratio) cells the arguments name, ratio by ratio."""
    return [(m, mode, float(r)) for r in args.ratios.split(",") for m in args.methods.split(",") for mode in args.modes.split(",")]


def rows_in_processes(args) -> list[dict]:
    """`--pairing process`: each (length, cell) measured by a fresh process of this script (`--pairing cell`, that cell alone),
    so that no cell runs after another in the same process; their rows, and per length a `plain` row whose `plain_s` is the
    median of the cells' plain medians."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "cell.csv"
        for length in args.lengths.split(","):
            plains, cells = [], []
            for name, mode, ratio in cells_of(args):
                out.unlink(missing_ok=True)
                subprocess.run([sys.executable, __file__, "--lengths", length, "--methods", name, "--modes", mode, "--ratios", str(ratio),
                                "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--warmup", str(args.warmup),
                                "--threads", str(args.threads), "--pairing", "cell", "--out", str(out)], check=True)
                measured = list(csv.DictReader(out.open()))
                if measured:  # else the method does not run in this mode
                    plains.append(measured[0])
                    cells.append({**measured[1], "pairing": "process"})
            if plains:
                plain = round(statistics.median(float(row["plain_s"]) for row in plains), 3)
                rows += [{**plains[0], "median_s": plain, "plain_s": plain, "pairing": "process"}, *cells]
    return rows


def write_rows(path: Path, rows: list[dict]) -> None:
    """rows as CSV at path (an empty file when no cell ran)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
