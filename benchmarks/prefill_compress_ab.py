"""Before/after compression time inside `generate`'s prefill, one process, interleaved (issue 17).

The synthetic A/B (`stream_throughput_ab.py`) times a method alone in a fresh process, where large
temporaries are often fresh pages; inside a model's prefill the allocator is already warm. This
script measures what the bench's prefill section counts: `GenerationResult.compress_seconds` of a
`generate` prefill on the default model (real prose, `--tokens`, `--ratio` removed, prefill mode),
for two kvcompress trees loaded side by side (`--before`: a plain export of the baseline commit,
e.g. `git archive 97d7757 | tar -x -C /tmp/base`; `--after`: this tree), taking turns with the
order reversed every other round. Reports the min per tree and the after/before ratio.
Before each call the tree's modules are put back into `sys.modules` (imports inside functions resolve
there at call time) and its attention function into transformers' registry.

    PYTHONPATH=. python benchmarks/prefill_compress_ab.py --before /tmp/base --methods balancekv,hybrid --threads 2
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch
from stream_throughput_ab import VARIANTS, ab_parser, evict, report


def load(path: Path) -> tuple[dict, dict]:
    """(the model loader, bench helpers and prefill timer of the kvcompress package under `path`, every
    kvcompress module it loaded by name), evicting any loaded one first."""
    evict()
    sys.path.insert(0, str(path))
    try:
        modules = {name: importlib.import_module("kvcompress." + name) for name in ("integration.model", "eval.bench", "eval.bench.prefill")}
    finally:
        sys.path.remove(str(path))
    return modules, {k: v for k, v in sys.modules.items() if k == "kvcompress" or k.startswith("kvcompress.")}


def activate(loaded: dict) -> None:
    """Make a tree's modules the ones `import` finds (imports inside functions resolve at call time) and its
    attention function the one transformers' registry holds."""
    from transformers import AttentionInterface

    evict()
    sys.modules.update(loaded)
    attention = loaded["kvcompress.integration.attention"]
    AttentionInterface.register(attention.ATTENTION_NAME, attention.kvcompress_attention)


def main() -> None:
    parser = ab_parser(__doc__.splitlines()[0], "prefill_compress_ab.md", rounds=4)
    parser.add_argument("--methods", default="balancekv,hybrid")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--ratio", type=float, default=0.75, help="share of the context removed")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    trees = {}
    for variant in VARIANTS:
        modules, loaded = load(getattr(args, variant))
        model, tokenizer = modules["integration.model"].load_model()
        trees[variant] = (modules, loaded, model, modules["eval.bench"].context_ids(tokenizer, args.tokens))
    seconds = {(m, v): [] for m in methods for v in VARIANTS}
    for i in range(args.rounds):
        for method in methods:
            for variant in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
                modules, loaded, model, ids = trees[variant]
                activate(loaded)
                seconds[(method, variant)].append(modules["eval.bench.prefill"].prefill_seconds(model, ids, method, args.ratio))
    machine = trees["after"][0]["eval.bench"].machine_description(args.threads)
    lines = [
        f"# Before/after compression time inside `generate`'s prefill, one process\n\nMachine: {machine}.\n",
        f"Default model, {args.tokens} tokens of real prose, {args.ratio:g} removed (prefill mode); min of {args.rounds} interleaved "
        f"rounds (the order reversed every other round); before = `{args.before}`, after = `{args.after}`.\n",
        "| method | before: compression s | after: compression s | after / before | before: prefill s | after: prefill s |",
        "|---|---|---|---|---|---|",
    ]
    for method in methods:
        before, after = (seconds[(method, v)] for v in VARIANTS)
        b, a = min(c for _, c in before), min(c for _, c in after)
        lines.append(f"| {method} | {b:.3f} | {a:.3f} | {a / b:.3f} | {min(t for t, _ in before):.2f} | {min(t for t, _ in after):.2f} |")
    report("\n".join(lines) + "\n", args.out, "prefill_compress_ab.md")


if __name__ == "__main__":
    main()
