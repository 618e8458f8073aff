"""Peak stored KV bytes: chunked KeyDiff (block prompt processing) against full-cache prefill.

On the default model (SmolLM2-135M-Instruct, float32), for prompts of real prose of growing
length:
- keydiff_peak_bytes: the compressed cache's peak of stored bytes over the whole chunked prefill
  (blocks of B tokens, cache budget N per head, sink 0 / window 0 as in the KeyDiff paper), as the
  CompressedCache measures it (keys, values, log-weights and positions of every layer);
- full_bytes: the bytes a plain transformers DynamicCache holds after a full prefill of the same
  prompt (keys and values of every layer), measured on the cache's tensors.
Writes benchmarks/results/keydiff_memory.{csv,md,png}.

    python benchmarks/keydiff_memory.py [--lengths 2048 4096 8192] [--budget 512] [--block 128]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import kvcompress as kvc  # noqa: E402
from kvcompress.eval.capture import prose_text  # noqa: E402
from kvcompress.integration import generate_ids  # noqa: E402
from kvcompress.eval.tables import write_csv  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def full_cache_bytes(model, ids: torch.Tensor) -> int:
    """Bytes of keys + values a DynamicCache stores after prefilling `ids` [1, n]."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True)
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvc.load_model()
    text = prose_text(6 * max(args.lengths), seed=0)
    all_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    if all_ids.shape[1] < max(args.lengths):
        raise ValueError(f"the prose source gave {all_ids.shape[1]} tokens, fewer than {max(args.lengths)}")
    rows = []
    for n in args.lengths:
        ids = all_ids[:, :n]
        start = time.perf_counter()
        res = generate_ids(model, ids, None, method="keydiff", budget=args.budget, mode="chunked",
                           chunk_size=args.block, max_new_tokens=1, stop_at_eos=False)
        keydiff_seconds = time.perf_counter() - start
        start = time.perf_counter()
        full = full_cache_bytes(model, ids)
        full_seconds = time.perf_counter() - start
        rows.append(dict(prompt_tokens=n, budget=args.budget, block=args.block, keydiff_peak_bytes=res.peak_kv_bytes,
                         keydiff_final_bytes=res.kv_bytes, full_bytes=full, ratio=round(full / res.peak_kv_bytes, 2),
                         keydiff_prefill_s=round(keydiff_seconds, 1), full_prefill_s=round(full_seconds, 1)))
        print(rows[-1], flush=True)
    RESULTS.mkdir(exist_ok=True)
    write_csv(RESULTS / "keydiff_memory.csv", rows)
    mib = 1 << 20
    lines = [
        f"# KeyDiff chunked prefill (B={args.block}, N={args.budget}) vs full-cache prefill, SmolLM2-135M float32",
        "",
        "| prompt tokens | KeyDiff peak KV (MiB) | full cache KV (MiB) | full / KeyDiff | KeyDiff prefill (s) | full prefill (s) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['prompt_tokens']} | {r['keydiff_peak_bytes'] / mib:.2f} | {r['full_bytes'] / mib:.2f} | {r['ratio']} | "
        f"{r['keydiff_prefill_s']} | {r['full_prefill_s']} |"
        for r in rows
    ]
    (RESULTS / "keydiff_memory.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = [r["prompt_tokens"] for r in rows]
    ax.plot(xs, [r["full_bytes"] / mib for r in rows], "o-", label="full cache (prefill)")
    ax.plot(xs, [r["keydiff_peak_bytes"] / mib for r in rows], "s-", label=f"KeyDiff chunked, N={args.budget}, B={args.block}")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("peak stored KV (MiB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "keydiff_memory.png", dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
