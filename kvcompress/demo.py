"""`kvcompress demo` (what `make demo` runs): what the library recommends, on one question about a document.

The default method (what `kvc.generate` runs when no method is named) answers first, then the full cache and a few
named methods at the same compression ratio. Each runs alone through `kvc.generate`, as a user would call it, and
prints its answer, whether the answer holds the needle, the KV bytes it stores against the full cache's for the same
tokens, and its wall time (prefill, compression and answer together), every row after one untimed answer of the full
cache, so that the process's first-call costs fall on no row.

The document is one sample of `niah_prose`: 700 tokens of the Python language reference with one plain-English
fact whose answer is a town (seed 0), a sample the default model answers with its full cache. One sample shows what a
run looks like; the measured scores and costs of every method are in docs/results.md.
"""

from __future__ import annotations

import time

from .commands.common import add_threads_arg, method_list, seed, set_threads, user_path_text

DEFAULT_METHODS = ("snapkv", "keydiff", "kvzip")


def run_demo(methods=DEFAULT_METHODS, compression_ratio=0.75, tokens=700, depth=0.5, seed=0, model_path=None,
             max_new_tokens=16, scorer=None) -> list[dict]:
    """Rows of {method, answer, correct, kv_bytes, kv_bytes_full, seconds}, the default's first and the full cache's
    second; prints them as they come. scorer: the path of a KVzap scorer file for a model none ships for (`kvcompress
    train-scorer`), which the default's scores then come from."""
    import kvcompress as kvc
    from .eval.tasks import niah_prose, score
    from .integration import build_prompt, load_model
    from .methods.kvzap import SurrogateError
    from .options import DEFAULT, DEFAULT_METHODS as DEFAULTS, CompressionOptions

    unknown = [m for m in methods if m not in kvc.methods()]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known methods: {', '.join(kvc.methods())}")
    if not 0.0 <= compression_ratio < 1.0:
        raise ValueError(f"--compression-ratio (fraction of the context removed) must be in [0, 1), got {compression_ratio}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"--depth (needle depth) must be in [0, 1], got {depth}")
    if tokens < 64:
        raise ValueError(f"--tokens (the context's length) must be >= 64, got {tokens}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    model, tokenizer = load_model(model_path)
    sample = niah_prose(target_tokens=tokens, depth=depth, seed=seed, tokenizer=tokenizer)
    name, params, exact = DEFAULTS["prefill"]
    settings = ", ".join(f"{k}={v}" for k, v in {**params, **exact}.items())
    # the default, or with another model's scorer the same method and parameters over it
    default = {"method": DEFAULT} if scorer is None else {"method": name, **params, **exact, "scorer_params": {"scorer": str(scorer)}}
    n_context = build_prompt(tokenizer, sample.context, sample.question)[0].shape[1]
    for method in (DEFAULT, *methods):  # every budget before the first line is printed
        try:  # the method itself (with --scorer, its scorer file; weights for another model refused with the cache), not the length
            options = CompressionOptions.build(**(default if method == DEFAULT else {"method": method}),
                                               compression_ratio=compression_ratio)
            kvc.CompressedCache(model, options)
        except ValueError as error:
            if method == DEFAULT and scorer is None and isinstance(error, SurrogateError):
                raise ValueError(f"the default needs a KVzap scorer for this model: write one with `kvcompress train-scorer --model "
                                 f"... --out FILE` and pass --scorer FILE ({error})") from None
            raise ValueError(f"{'--scorer ' + repr(str(scorer)) if method == DEFAULT and scorer is not None else method}: {error}") from None
        try:
            options.token_budget_for(n_context)
        except ValueError as error:
            raise ValueError(f"--tokens {tokens} ({n_context} tokens with the chat template) is too short for --compression-ratio "
                             f"{compression_ratio} with {method}: {error}") from None
    print(f"context: {sample.n_tokens} tokens of real prose, needle at depth {sample.depths[0]:.0%}: {sample.needles[0]!r}")
    print(f"question: {sample.question}")
    print(f"compression ratio {compression_ratio} ({compression_ratio:.0%} of the context's KV bytes removed); "
          f"default = {name}({settings})\n")
    # one untimed answer first: a process's first forward pays one-time costs (allocations, thread pools) that would
    # otherwise be charged to the first row, the default's
    kvc.generate(model, tokenizer, sample.context, sample.question, max_new_tokens=1, progress=False, method=None)
    print(f"{'method':<10}{'correct':<9}{'KV stored':>12}{'saved':>7}{'time':>8}  answer")
    rows = []
    for method in (DEFAULT, None, *methods):
        size = {} if method is None else {"compression_ratio": compression_ratio}
        chosen = default if method == DEFAULT else {"method": method}
        start = time.perf_counter()
        res = kvc.generate(model, tokenizer, sample.context, sample.question, max_new_tokens=max_new_tokens, progress=False,
                           **chosen, **size)
        seconds = time.perf_counter() - start
        answer = res.text.strip()
        correct = score(sample, answer) == 1.0
        label = "full" if method is None else method
        saved = 1 - res.kv_bytes / res.kv_bytes_full
        print(f"{label:<10}{'yes' if correct else 'no':<9}{res.kv_bytes / 2**20:>8.2f} MiB{saved:>7.0%}{seconds:>7.1f}s  {answer!r}")
        rows.append({"method": label, "answer": answer, "correct": correct, "kv_bytes": res.kv_bytes,
                     "kv_bytes_full": res.kv_bytes_full, "seconds": seconds})
    return rows


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("demo", help="one question about a document: the default method, the full cache and a few "
                                           "methods at the same compression, with answers, KV memory and time")
    p.add_argument("--methods", type=method_list, default=list(DEFAULT_METHODS),
                   help=f"comma-separated methods shown after the default and the full cache (default: {','.join(DEFAULT_METHODS)})")
    p.add_argument("--compression-ratio", type=float, default=0.75, help="fraction of the context removed (default 0.75 = 4x)")
    p.add_argument("--tokens", type=int, default=700,
                   help="context length in tokens, at most: whole sentences of prose up to it (default 700; the length built is printed)")
    p.add_argument("--depth", type=float, default=0.5,
                   help="needle depth in [0, 1], at the nearest sentence boundary (default 0.5; the depth reached is printed)")
    p.add_argument("--seed", type=seed, default=0, help="which sample of the prose needle task (default 0)")
    p.add_argument("--model", type=user_path_text, default=None, help="local Hugging Face checkpoint directory or GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--scorer", type=user_path_text, default=None, help="KVzap scorer file for a --model none ships for (written by `kvcompress train-scorer`): "
                   "the default's scores come from it")
    add_threads_arg(p)
    p.set_defaults(func=_run)


def _run(args) -> int:
    set_threads(args.threads)
    run_demo(args.methods, args.compression_ratio, args.tokens, args.depth, args.seed, args.model, scorer=args.scorer)
    return 0
