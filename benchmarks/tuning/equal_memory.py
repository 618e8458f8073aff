"""Dropped tokens or fewer bits, at equal memory: the default against the same method storing what it keeps in 4 bits
(`kv_bits=4`, packed per head) at a lower compression ratio, so that both store about the same bytes, on tuning needles.

Each variant answers the tuning needles of `kvzap_default.py` (`tuning_needle`, 24 answer tokens, the library's prompt
layout) with the default's method and settings for its mode (`options.DEFAULT_METHODS`, less its storage:
`options.without_storage`), at the compression ratio, in tokens, and storage it names; `memory` names the default's ratio whose bytes it matches (the stored bytes ÷ the full cache's of
every answer are in its row, `kv_over_full`, and the peak, `peak_over_full`, so the match is read, not assumed):
- `full`: the full cache (ratio 0);
- `default_0.9`, `default_0.75`: the default at full precision;
- `q4_0.55`, `q4_0.6`: 4 bits at ratio 0.55 and 0.6, which store about the default's bytes at 0.9 (2k and 4k tokens);
- `q4_0.5`: 4 bits at ratio 0.5, within the bytes the ratio 0.9 allows at 4k tokens (0.1 of the full cache's plus the
  exact sink and window);
- `q4_0`: 4 bits at ratio 0, every token kept: below the default's bytes at 0.75;
- `q4_0.4`: 4 bits at ratio 0.4, below the default's bytes at 0.75 with fewer slots to read at each step;
- `q4m_0.9`: the default in prefill mode as it is at 0.9 (4 bits, groups of 32, the ratio read as memory:
  `budget_unit="memory"`);
- `q4g16_0`, `q4g16m_0.9`: `q4_0` and `q4m_0.9` with groups of 16 (`kv_group_size=16`): at 0.75 every token still fits
  the ratio's bytes in float32 (4 bits and a float32 scale and zero point per 16 elements, 8 bits an element), at
  0.9 fewer slots with finer scales;
- `q8m_0.75`, `q8m_0.9`, `q2m_0.9`: the default's method with 8 bits (fewer slots, finer codes: in prefill mode about
  8 in 10 middle tokens fit the bytes of 0.75 in float32) or 2 bits (more slots, coarser codes), the ratio read as memory;
  in decode mode the stream stores each slot quantized as it enters (keys per slot, `quantization.QuantizedSlots`);
- `q4m_0.9_window_0`, `q4m_0.9_window_16`: `q4m_0.9` with no exact window or one of 16 tokens (the default's is 64, at
  full precision within the ratio's bytes: about a third of them at 0.9 and 2k tokens), so that the bytes hold more
  quantized slots, every token ranked by its score;
- `q4g64m_0.9`: `q4m_0.9` with groups of 64 (coarser scales, more slots);
- `q4m_0.9_span_3`, `q4m_0.9_window_0_span_3`: `q4m_0.9` and `q4m_0.9_window_0` with each score max-pooled over the 3
  tokens centred on it before the ranking (AdaKV's `span`), so that a kept token keeps its neighbours;
- `q4m_0.9_learned_split`: `q4m_0.9` with each layer given the share of the budget the scorer learned on its training
  text, one ranking per layer (AdaKV's `layer_split="learned"`, as the streams share it), not one over every layer;
- `q4m_0.9_kvzip`: `q4m_0.9` ranking by KVzip's exact scores (its reconstruction forward, about twice the prefill) in
  place of the surrogate's: what a perfect surrogate would keep in the same bytes.

One JSON line per (variant, mode, seed, length) goes to OUT in `kvzap_default.py`'s format (a rerun skips what is
there), and the summary (`kvzap_default.summary_rows`: the full cache's hits each variant keeps, paired per needle, its
median time per answer ÷ the full cache's and its median stored bytes ÷ the full cache's) is printed:

    .venv/bin/python benchmarks/tuning/equal_memory.py --out benchmarks/results/tuning/equal_memory.jsonl \\
        --lengths 2048 --seeds 1000-1029 --variants full,default_0.9,q4_0.55,q4_0.6,q4_0 --modes prefill --threads 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import kvcompress as kvc
from kvcompress.eval.tasks import score
from kvcompress.commands.common import list_of
from kvcompress.names import DEFAULT_PROMPT_LAYOUT, MODES
from kvcompress.options import DEFAULT_METHODS, without_storage
from kvzap_default import append_row, parsed_variants_run, recorded, summarise, tuning_needle

# name -> (compression ratio, kv_bits, the default's ratio whose memory it matches)
VARIANTS = {
    "full": (0.0, None, None),
    "default_0.9": (0.9, None, 0.9),
    "default_0.75": (0.75, None, 0.75),
    "q4_0.55": (0.55, 4, 0.9),
    "q4_0.6": (0.6, 4, 0.9),
    "q4_0.5": (0.5, 4, 0.9),
    "q4_0": (0.0, 4, 0.75),
    "q4_0.4": (0.4, 4, 0.75),
    "q4m_0.9": (0.9, 4, 0.9),
    "q4g16_0": (0.0, 4, 0.75),
    "q4g16m_0.9": (0.9, 4, 0.9),
    "q8m_0.75": (0.75, 8, 0.75),
    "q8m_0.9": (0.9, 8, 0.9),
    "q2m_0.9": (0.9, 2, 0.9),
    "q4m_0.9_window_0": (0.9, 4, 0.9),
    "q4m_0.9_window_16": (0.9, 4, 0.9),
    "q4g64m_0.9": (0.9, 4, 0.9),
    "q4m_0.9_span_3": (0.9, 4, 0.9),
    "q4m_0.9_window_0_span_3": (0.9, 4, 0.9),
    "q4m_0.9_learned_split": (0.9, 4, 0.9),
    "q4m_0.9_kvzip": (0.9, 4, 0.9),
}
# the storage settings a variant adds to its bits (the default's group size and the ratio in tokens where it names none)
STORAGE = {"q4m_0.9": {"budget_unit": "memory"}, "q4g16_0": {"kv_group_size": 16},
           "q4g16m_0.9": {"kv_group_size": 16, "budget_unit": "memory"}, "q8m_0.75": {"budget_unit": "memory"},
           "q8m_0.9": {"budget_unit": "memory"}, "q2m_0.9": {"budget_unit": "memory"},
           "q4m_0.9_window_0": {"budget_unit": "memory", "window": 0}, "q4m_0.9_window_16": {"budget_unit": "memory", "window": 16},
           "q4g64m_0.9": {"kv_group_size": 64, "budget_unit": "memory"},
           "q4m_0.9_span_3": {"budget_unit": "memory"}, "q4m_0.9_window_0_span_3": {"budget_unit": "memory", "window": 0},
           "q4m_0.9_learned_split": {"budget_unit": "memory"}, "q4m_0.9_kvzip": {"budget_unit": "memory"}}
# the method parameters a variant adds to the default's
METHOD_PARAMS = {"q4m_0.9_span_3": {"span": 3}, "q4m_0.9_window_0_span_3": {"span": 3},
                 "q4m_0.9_learned_split": {"layer_split": "learned"}, "q4m_0.9_kvzip": {"scorer": "kvzip"}}


def default_of_equal_memory(variant: str) -> tuple[str, None, float] | None:
    """The default's variant whose memory `variant` matches, as `report.paired_needle_section` pairs it (in the same mode,
    at that ratio); None for the default and the full cache."""
    ratio, bits, memory = VARIANTS[variant]
    return None if bits is None else (f"default_{memory:g}", None, memory)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--lengths", default="2048")
    p.add_argument("--seeds", default="1000-1029")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--modes", type=list_of(MODES, "mode"), default="prefill",
                   help=f"comma-separated among {', '.join(MODES)} (the full cache runs in prefill mode)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=24)
    args, seeds, names = parsed_variants_run(p, VARIANTS)
    model, tokenizer = kvc.load_model()
    done = recorded(args.out, ("variant", "mode", "seed", "length"))
    for length in map(int, args.lengths.split(",")):
        for seed in seeds:
            sample = tuning_needle(length, seed, tokenizer)
            for name in names:
                ratio, bits, memory = VARIANTS[name]
                for mode in ("prefill",) if name == "full" else args.modes:
                    if (name, mode, seed, length) in done:
                        continue
                    if name == "full":
                        settings = {"method": None}
                    else:
                        method, params, exact = DEFAULT_METHODS[mode]
                        settings = dict(method=method, method_params=params | METHOD_PARAMS.get(name, {}), compression_ratio=ratio, kv_bits=bits, **without_storage(exact),
                                        **STORAGE.get(name, {}))
                    start = time.perf_counter()
                    res = kvc.generate(model, tokenizer, sample.context, sample.question, mode=mode, max_new_tokens=args.new_tokens,
                                       progress=False, prompt_layout=DEFAULT_PROMPT_LAYOUT, **settings)
                    row = {"variant": name, "mode": mode, "seed": seed, "length": length, "ratio": ratio, "kv_bits": bits, **STORAGE.get(name, {}),
                           **METHOD_PARAMS.get(name, {}),
                           "memory_of_ratio": memory, "hit": score(sample, res.text), "seconds": round(time.perf_counter() - start, 3),
                           "text": res.text, "answers": sample.answers, "kv_over_full": round(res.kv_bytes / res.kv_bytes_full, 4),
                           "peak_over_full": round(res.peak_kv_bytes / res.kv_bytes_full, 4), "threads": args.threads,
                           "prompt_layout": DEFAULT_PROMPT_LAYOUT, "date": time.strftime("%Y-%m-%d")}
                    append_row(args.out, row)
                    print(json.dumps({k: row[k] for k in ("variant", "mode", "seed", "hit", "kv_over_full", "text")}), flush=True)
    summarise(args.out)


if __name__ == "__main__":
    main()
