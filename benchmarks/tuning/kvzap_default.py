"""Choosing the default on tuning samples: needles in the tuning prose (`niah_prose(split="tuning")`, seeds from
`TUNING_SEEDS`), each answered by the full cache and by every variant at one compression ratio, with each answer's
time, so quality and cost are read from one run (same process, same thread count).

Appends one JSON line per (variant, mode, seed, length, ratio) to OUT (a rerun skips what is there; the full cache,
ratio 0, serves every ratio) and prints, per variant, mode and ratio, the full cache's hits it keeps (paired per needle)
and the median time per answer ÷ the full cache's:

    .venv/bin/python benchmarks/tuning/kvzap_default.py --out benchmarks/results/tuning/kvzap_default.jsonl \\
        --lengths 2048 --seeds 1000-1011 --ratio 0.75 --threads 1 --prompt-layout newline
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.eval.tasks import TUNING_SEEDS, niah_prose, score
from kvcompress.commands.common import list_of
from kvcompress.names import DEFAULT_PROMPT_LAYOUT, MODES

# name -> (method, method_params, exact sink/window, stream slack and chunk_size settings, modes)
VARIANTS = {
    "full": (None, {}, {}, ("prefill",)),
    "adakv_kvzip_refit": ("adakv", {"scorer": "kvzip", "scope": "model", "alpha_safeguard": 0.05, "refit": "log_weights_values"},
                          {"window": 0}, ("prefill",)),
    "kvzap": ("kvzap", {}, {}, ("prefill", "chunked", "decode")),
    # the default's allocation with KVzip's exact scores (its reconstruction forward) in place of the surrogate's, the
    # same exact window: what a perfect surrogate would keep
    "adakv_kvzip_model": ("adakv", {"scorer": "kvzip", "scope": "model", "alpha_safeguard": 0.05}, {"window": 64}, ("prefill",)),
    "adakv_kvzap": ("adakv", {"scorer": "kvzap", "alpha_safeguard": 0.05}, {}, ("prefill", "chunked", "decode")),
    # scope "model": prefill ranks every layer's heads together; a stream gives each layer its learned share of the budget
    "adakv_kvzap_model": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05}, {}, ("prefill", "chunked", "decode")),
    "adakv_kvzap_model_slack_0.1": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05}, {"slack": 0.1},
                                    ("chunked", "decode")),
    # the same settings, answered by streams that turn away tokens they could never keep and leave themselves at least 16
    # slots of room (adakv.AdaptiveBlockwiseState.admission, adakv.ENTRY_SCORE_ROOM); the variant above was answered without
    "adakv_kvzap_model_slack_0.1_admission": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05},
                                              {"slack": 0.1}, ("chunked", "decode")),
    # the stream default (the variant above) with its prompt fed in blocks of 128 and of 256 tokens (`chunk_size`)
    "adakv_kvzap_model_slack_0.1_admission_chunk_128": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05},
                                                        {"slack": 0.1, "chunk_size": 128}, ("chunked", "decode")),
    "adakv_kvzap_model_slack_0.1_admission_chunk_256": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05},
                                                        {"slack": 0.1, "chunk_size": 256}, ("chunked", "decode")),
    # the stream default (chunk_256's settings) once a block whose admitted tokens overflow the room costs one re-compression:
    # what is held and the block's admitted tokens but the last room's worth ranked together, only those kept stored, the
    # last ones then waiting in the room (adakv.AdaptiveBlockwiseState.absorb); chunk_256 took the block a room at a time,
    # re-compressing each time the room was full
    "adakv_kvzap_model_slack_0.1_block_then_room": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05},
                                                    {"slack": 0.1, "chunk_size": 256}, ("chunked", "decode")),
    # the stream default with a longer exact window in decode mode, where the question and the answer enter the window and
    # push the context's last tokens out of it; the window's slots come out of the same budget (equal memory)
    "adakv_kvzap_model_slack_0.1_window_96": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05},
                                              {"slack": 0.1, "chunk_size": 256, "window": 96}, ("decode",)),
    "adakv_kvzap_model_slack_0.1_window_128": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05},
                                               {"slack": 0.1, "chunk_size": 256, "window": 128}, ("chunked", "decode")),
    "adakv_kvzap_model_slack_0.1_window_192": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05},
                                               {"slack": 0.1, "chunk_size": 256, "window": 192}, ("decode",)),
    # the prefill default with each head's evicted tokens summarised in 8 or 32 slots within its budget (runs of equal
    # count, each a mean key and value of log-weight log(count): AdaKV's evicted_slots), not dropped
    "adakv_kvzap_model_evicted_8": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05, "evicted_slots": 8},
                                    {}, ("prefill",)),
    "adakv_kvzap_model_evicted_32": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05, "evicted_slots": 32},
                                     {}, ("prefill",)),
    # the stream default taking the whole context as one block (chunk_size past any tuning length): the block's attention
    # exact as in prefill mode, then each layer's stream keeping its learned share of the budget
    "adakv_kvzap_model_slack_0.1_admission_one_block": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05},
                                                        {"slack": 0.1, "chunk_size": 8192}, ("chunked",)),
    # the prefill default with that split in one shot: each layer its learned share, one top-k over the layer's heads
    "adakv_kvzap_model_learned_split": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05, "layer_split": "learned"},
                                        {}, ("prefill",)),
    "adakv_keydiff": ("adakv", {"scorer": "keydiff"}, {}, ("chunked", "decode")),
    # streams re-compressing to a larger share of their budget (slack 0.5, the library's default, compresses to 2/3)
    "adakv_kvzap_slack_0.1": ("adakv", {"scorer": "kvzap", "alpha_safeguard": 0.05}, {"slack": 0.1}, ("chunked", "decode")),
}


def seed_range(text: str) -> list[int]:
    """Seeds from "first-last" ranges and single seeds, comma-separated ("1000-1003,1010")."""
    seeds = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        seeds += range(int(first), int(last or first) + 1)
    return seeds


def tuning_seeds(text: str) -> list[int]:
    """`seed_range(text)`, refused unless every seed is a tuning seed."""
    seeds = seed_range(text)
    if not set(seeds) <= set(TUNING_SEEDS):
        raise SystemExit(f"--seeds must be tuning seeds ({TUNING_SEEDS})")
    return seeds


def needle_run_parser(doc: str, variants: str) -> argparse.ArgumentParser:
    """The arguments every prefill-mode needle run of the tuning scripts shares (ratio 0.9, one thread, 30 seeds by
    default; `variants` the default of --variants); a script adds its own."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--lengths", default="2048")
    p.add_argument("--seeds", default="1000-1029")
    p.add_argument("--ratio", type=float, default=0.9)
    p.add_argument("--variants", default=variants)
    p.add_argument("--threads", type=int, default=1)
    return p


def answer_prefill_needle(model, tokenizer, sample, args, variant: str, seed: int, length: int, ratio: float, settings: dict,
                          **fields) -> None:
    """Answer `sample` in prefill mode in the library's prompt layout with kvc.generate's method `settings` (args: the
    run's --out, --threads and --new-tokens), append its row to args.out (`fields` added to it) and print it."""
    start = time.perf_counter()
    res = kvc.generate(model, tokenizer, sample.context, sample.question, mode="prefill", max_new_tokens=args.new_tokens,
                       progress=False, prompt_layout=DEFAULT_PROMPT_LAYOUT, **settings)
    row = {"variant": variant, "mode": "prefill", "seed": seed, "length": length, "ratio": ratio, "hit": score(sample, res.text),
           "seconds": round(time.perf_counter() - start, 3), "text": res.text, "answers": sample.answers, **fields,
           "threads": args.threads, "prompt_layout": DEFAULT_PROMPT_LAYOUT, "date": time.strftime("%Y-%m-%d")}
    append_row(args.out, row)
    print(json.dumps({k: row[k] for k in ("variant", "seed", "ratio", "hit", "text")}), flush=True)


def answered_variants_run(doc: str, variants: tuple[str, ...]) -> tuple[argparse.Namespace, list[int], list[str]]:
    """(arguments, seeds, variants) of a run that answers needles with `variants` (`needle_run_parser`'s arguments and
    --new-tokens, 24 by default), its torch threads set."""
    p = needle_run_parser(doc, ",".join(variants))
    p.add_argument("--new-tokens", type=int, default=24)
    return parsed_variants_run(p, variants)


def parsed_variants_run(p: argparse.ArgumentParser, variants) -> tuple[argparse.Namespace, list[int], list[str]]:
    """(arguments, seeds, variants) of `p` (with --variants, --seeds and --threads): --variants checked against `variants`,
    --seeds against the tuning seeds, torch threads set."""
    args = p.parse_args()
    names = args.variants.split(",")
    if not set(names) <= set(variants):
        raise SystemExit(f"--variants takes a comma-separated list among {', '.join(variants)}; got {args.variants!r}")
    torch.set_num_threads(args.threads)
    return args, tuning_seeds(args.seeds), names


def answer_prefill_variants(model, tokenizer, args, seeds: list[int], names: list[str], settings) -> None:
    """Every tuning needle of `seeds` at each of args.lengths answered by each variant of `names` (`answer_prefill_needle`;
    settings(name, ratio): its kvc.generate settings; "full" at ratio 0, the others at args.ratio), skipping what args.out
    holds, then the record's summary printed."""
    done = recorded(args.out, ("variant", "seed", "length", "ratio"))
    for length in map(int, args.lengths.split(",")):
        for seed in seeds:
            sample = tuning_needle(length, seed, tokenizer)
            for name in names:
                ratio = 0.0 if name == "full" else args.ratio
                if (name, seed, length, ratio) not in done:
                    answer_prefill_needle(model, tokenizer, sample, args, name, seed, length, ratio, settings(name, ratio))
    summarise(args.out)


def recorded(path: Path, fields: tuple[str, ...]) -> set[tuple]:
    """The `fields` of every row of the JSON-lines record at `path` (none when it does not exist yet), for a rerun to skip
    what is there; the record's folder is created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        return set()
    return {tuple(r[f] for f in fields) for r in map(json.loads, path.read_text(encoding="utf-8").splitlines())}


def append_row(path: Path, row: dict) -> None:
    """One JSON line appended to the record at `path`."""
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def tuning_needle(length: int, seed: int, tokenizer):
    """The tuning prose needle of `seed` at `length` tokens, its depth spread over the context by the seed."""
    return niah_prose(length, depth=((seed - 1000) * 0.618) % 1.0, seed=seed, tokenizer=tokenizer, split="tuning")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--lengths", default="2048")
    p.add_argument("--seeds", default="1000-1011")
    p.add_argument("--ratio", type=float, default=0.75)
    p.add_argument("--variants", type=list_of(list(VARIANTS), "variant"), default=",".join(VARIANTS))
    p.add_argument("--modes", type=list_of(MODES, "mode"), default="prefill,chunked",
                   help=f"comma-separated among {', '.join(MODES)}; each variant runs in those of its own modes (VARIANTS) only")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=24, help="answer tokens (enough for the whole answer sentence)")
    p.add_argument("--prompt-layout", default="newline", help="how the question follows the context (kvc.generate's prompt_layout)")
    p.add_argument("--scorer", default="default", help="the KVzap surrogate of every variant that scores with one: 'default' "
                   "(the shipped weights) or a file `kvcompress train-scorer` wrote (each row records it; give each scorer its own OUT)")
    args = p.parse_args()
    idle = [name for name in args.variants if not set(VARIANTS[name][3]) & set(args.modes)]
    if idle:
        p.error(f"--variants {','.join(idle)} run in none of --modes {','.join(args.modes)}: "
                + "; ".join(f"{name} runs in {','.join(VARIANTS[name][3])}" for name in idle))
    for name in args.variants:
        left_out = [mode for mode in args.modes if mode not in VARIANTS[name][3]]
        if left_out:
            print(f"{name} is not run in mode {','.join(left_out)}: it runs in {','.join(VARIANTS[name][3])} only", flush=True)
    torch.set_num_threads(args.threads)
    seeds = tuning_seeds(args.seeds)
    model, tokenizer = kvc.load_model()
    done = recorded(args.out, ("variant", "mode", "seed", "length", "ratio"))
    modes = args.modes
    for length in map(int, args.lengths.split(",")):
        for seed in seeds:
            sample = tuning_needle(length, seed, tokenizer)
            for name in args.variants:
                method, params, exact, variant_modes = VARIANTS[name]
                for mode in (m for m in modes if m in variant_modes):
                    ratio = 0.0 if method is None else args.ratio
                    if (name, mode, seed, length, ratio) in done:
                        continue
                    settings = {"method": None} if method is None else dict(method=method, method_params=with_scorer(method, params, args.scorer),
                                                                               compression_ratio=ratio, **exact)
                    start = time.perf_counter()
                    res = kvc.generate(model, tokenizer, sample.context, sample.question, mode=mode, max_new_tokens=args.new_tokens, progress=False,
                                       prompt_layout=args.prompt_layout, **settings)
                    seconds = time.perf_counter() - start
                    row = {"variant": name, "mode": mode, "seed": seed, "length": length, "ratio": ratio, "hit": score(sample, res.text),
                           "seconds": round(seconds, 3), "text": res.text, "answers": sample.answers, "kv_bytes": res.kv_bytes,
                           "kv_bytes_full": res.kv_bytes_full, "threads": args.threads, "prompt_layout": args.prompt_layout,
                           "scorer": args.scorer, "date": time.strftime("%Y-%m-%d")}
                    append_row(args.out, row)
                    print(json.dumps({k: row[k] for k in ("variant", "mode", "seed", "hit", "seconds", "text")}), flush=True)
    summarise(args.out)


def with_scorer(method: str, params: dict, scorer: str) -> dict:
    """`params` with KVzap's surrogate set to `scorer` where the variant scores with KVzap (itself or as AdaKV's scorer)."""
    if method == "kvzap":
        return {**params, "scorer": scorer}
    if params.get("scorer") == "kvzap":
        return {**params, "scorer_params": {"scorer": scorer}}
    return params


def summary_rows(path: Path) -> list[dict]:
    """Per (variant, mode, ratio): the needles the full cache finds that it also finds (paired per needle), the median
    of its time per answer ÷ the full cache's on the same needle, and the median of its stored KV bytes ÷ the full
    cache's ("–" where the rows do not record them)."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    full = {(r["seed"], r["length"]): r for r in rows if r["variant"] == "full"}
    found = {k for k, r in full.items() if r["hit"] >= 1}
    out = []
    for variant, mode, ratio in sorted({(r["variant"], r["mode"], r["ratio"]) for r in rows}):
        mine = {(r["seed"], r["length"]): r for r in rows if (r["variant"], r["mode"], r["ratio"]) == (variant, mode, ratio)}
        paired = [k for k in found if k in mine]
        over_full = [mine[k]["seconds"] / full[k]["seconds"] for k in mine if k in full]
        stored = [stored_over_full(r) for r in mine.values()]
        out.append({"variant": variant, "mode": mode, "ratio": ratio, "needles": len(mine), "full_cache_hits": len(paired),
                    "hits_kept": sum(1 for k in paired if mine[k]["hit"] >= 1),
                    "median_time_over_full": round(statistics.median(over_full), 2) if over_full else "–",
                    "median_kv_over_full": round(statistics.median(stored), 4) if None not in stored else "–"})
    return out


def stored_over_full(row: dict) -> float | None:
    """A row's stored KV bytes ÷ the full cache's (`kv_over_full`, or its `kv_bytes` ÷ `kv_bytes_full`), None if it has neither."""
    if "kv_over_full" in row:
        return row["kv_over_full"]
    return row["kv_bytes"] / row["kv_bytes_full"] if "kv_bytes" in row and "kv_bytes_full" in row else None


def summarise(path: Path) -> None:
    for row in summary_rows(path):
        print(row)


if __name__ == "__main__":
    main()
