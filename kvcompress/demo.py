"""`kvcompress demo`: one needle-in-a-haystack question answered with the full cache and with
several methods at the same compression, printing answers, correctness and memory saved.

The context is prefilled once; every method compresses its own copy of that prefill (prefill
mode, the question appended exactly after compression).
"""

from __future__ import annotations

import time

from .commands.common import method_list

DEFAULT_METHODS = ("streamingllm", "snapkv", "knorm", "keydiff", "compactor", "balancekv", "express", "clustergen")


def run_demo(methods=DEFAULT_METHODS, compression_ratio=0.75, tokens=3000, depth=0.4, seed=0, model_path=None, max_new_tokens=32) -> list[dict]:
    """Rows of {method, answer, correct, kv_bytes, kv_bytes_full, seconds}; prints them as they come."""
    import kvcompress as kvc
    from .eval.capture import capture_qkv
    from .eval.tasks import niah_single, score
    from .integration import build_prompt, generate_ids, load_model

    unknown = [m for m in methods if m not in kvc.methods()]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known methods: {', '.join(kvc.methods())}")
    if not 0.0 <= compression_ratio < 1.0:
        raise ValueError(f"--compression-ratio (fraction of the context removed) must be in [0, 1), got {compression_ratio}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"--depth (needle depth) must be in [0, 1], got {depth}")
    if tokens < 64 or max_new_tokens < 1:
        raise ValueError(f"--tokens must be >= 64 and max_new_tokens >= 1, got {tokens} and {max_new_tokens}")
    model, tokenizer = load_model(model_path)
    sample = niah_single(target_tokens=tokens, depth=depth, seed=seed, tokenizer=tokenizer)
    context_ids, question_ids = build_prompt(tokenizer, sample.context, sample.question)
    print(f"context: {context_ids.shape[1]} tokens, needle at depth {sample.depth:.0%}: {sample.needles[0]!r}")
    print(f"question: {sample.question}\n")
    start = time.perf_counter()
    prefill = capture_qkv(model, context_ids)
    print(f"one full prefill, reused by every method: {time.perf_counter() - start:.1f}s\n")
    print(f"{'method':<14}{'correct':<9}{'KV stored':>12}{'saved':>8}  answer")
    rows = []
    for method in (None, *methods):
        start = time.perf_counter()
        size = {} if method is None else {"compression_ratio": compression_ratio, "prefill": prefill}
        res = generate_ids(model, context_ids, question_ids, method=method, max_new_tokens=max_new_tokens, **size)
        answer = tokenizer.decode(res.token_ids, skip_special_tokens=True).strip()
        correct = score(sample, answer) == 1.0
        saved = 1 - res.kv_bytes / res.kv_bytes_full
        print(f"{res.method:<14}{'yes' if correct else 'no':<9}{res.kv_bytes / 2**20:>9.2f} MiB{saved:>8.0%}  {answer!r}")
        rows.append({"method": res.method, "answer": answer, "correct": correct, "kv_bytes": res.kv_bytes,
                     "kv_bytes_full": res.kv_bytes_full, "seconds": time.perf_counter() - start})
    return rows


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("demo", help="needle-in-a-haystack demo: full cache vs several methods at the same compression")
    p.add_argument("--methods", type=method_list, default=list(DEFAULT_METHODS),
                   help=f"comma-separated methods to compare with the full cache (default: {','.join(DEFAULT_METHODS)})")
    p.add_argument("--compression-ratio", type=float, default=0.75, help="fraction of the context removed (default 0.75 = 4x)")
    p.add_argument("--tokens", type=int, default=3000, help="context length in tokens (default 3000)")
    p.add_argument("--depth", type=float, default=0.4, help="needle depth in [0, 1] (default 0.4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="local Hugging Face checkpoint directory (default: SmolLM2-135M-Instruct)")
    p.set_defaults(func=lambda a: run_demo(a.methods, a.compression_ratio, a.tokens, a.depth, a.seed, a.model) and 0)
