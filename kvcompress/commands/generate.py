"""`kvcompress generate`: answer a question about a context file through a compressed KV cache (`kvc.generate`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import (add_device_args, add_model_arg, add_threads_arg, count, given_flags, kv_bits, load_cli_model, one_of, parse_params,
                     seed, set_threads, user_path)
from ..names import AUTO_KV_BITS, BUDGET_UNITS, DEFAULT_CHUNK_SIZE, DEFAULT_METHOD, FULL, KV_BITS, KVZIP_REFIT, METHODS, MODES



def _question(text: str) -> str:
    """--question's text: refused when empty or blank (leaving the flag out asks no question)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a question, got {text!r}; leave --question out to ask none")
    return text


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("generate", help="answer a question about a context through a compressed KV cache")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--context-file", type=user_path, help="text file holding the context (- reads standard input)")
    source.add_argument("--cache", type=user_path, default=None, metavar="FILE",
                        help="a compressed context saved by `kvcompress compress` (in place of --context-file; its own settings apply)")
    p.add_argument("--question", type=_question, action="append", default=None,
                   help="question appended after the (compressed) context (leave it out to ask none); given several times, "
                        "each is answered from the one compressed context, in order")
    p.add_argument("--max-new-tokens", type=count(1), default=64, help="answer tokens at most (default 64)")
    p.add_argument("--json", action="store_true",
                   help="print each answer and its statistics as one JSON object a line (the question and "
                        "GenerationResult.to_dict()) in place of the text")
    add_run_args(p, _run)


def add_run_args(p, run, later_questions: bool = False) -> None:
    """What `generate` and `compress` both take: the compression flags, threads, model and device; `run` handles the
    command. later_questions: the command compresses a context for questions asked later (`compress`), so it takes
    neither --compress-question nor --method full."""
    add_compression_args(p, later_questions)
    add_threads_arg(p)
    add_model_arg(p)
    add_device_args(p)
    p.set_defaults(func=run)


def add_compression_args(p, later_questions: bool = False) -> None:
    """The flags of a `CompressionOptions` (read back by `options_of`), shared by `generate` and `compress`; a command
    that compresses a context for questions asked later (`later_questions`) leaves out --compress-question and --method
    full. The parser's `compression_flags` default lists them, for `generate --cache`, which refuses every one."""
    first = len(p._actions)
    full = () if later_questions else (FULL,)
    p.add_argument("--method", type=one_of((*full, DEFAULT_METHOD, KVZIP_REFIT, *METHODS), "method"), default=None, metavar="NAME",
                   help="registered method name, " + (f"'{FULL}' for the uncompressed cache, " if full else "") + f"'{DEFAULT_METHOD}' (the default): the best "
                        "measured method for the mode within a plain generate's cost (adakv over KVzap's learned KVzip scores, one "
                        "budget over every layer: ranked across layers in prefill mode, each layer's stream its learned share when "
                        "streaming; see docs/design.md), or "
                        f"'{KVZIP_REFIT}' (prefill only: the slow default before KVzap, KVzip's exact scores and a refit); with "
                        "--calibration, the method it was fitted for")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--compression-ratio", type=float, default=None, help="fraction of the context removed, in [0, 1): of its tokens, or of its KV bytes with --budget-unit "
                      "memory (the default method's)")
    size.add_argument("--budget", type=int, default=None, help="tokens kept per KV head besides the exact sink and window (>= 1)")
    size.add_argument("--calibration", type=user_path, default=None, metavar="FILE",
                      help="a calibration file written by `kvcompress calibrate`: the compression ratio is chosen for this context "
                           "from the model's NLL of it, the smallest whose predicted quality meets --quality")
    p.add_argument("--quality", type=float, default=None, metavar="Q",
                   help="with --calibration: the predicted NLL ratio of the answer to keep (the quality budget gamma), in (0, 1]")
    p.add_argument("--mode", default="prefill", choices=MODES, help="when compression happens (default prefill)")
    p.add_argument("--seed", type=seed, default=0, help="seed of randomised methods (default 0)")
    p.add_argument("--sink", type=int, default=None, help="first tokens kept exactly (default: the method's own, docs/design.md)")
    p.add_argument("--window", type=int, default=None, help="last tokens kept exactly (default: the method's own, docs/design.md)")
    p.add_argument("--chunk-size", type=count(1), default=DEFAULT_CHUNK_SIZE,
                   help=f"prompt block size in chunked/decode mode (default {DEFAULT_CHUNK_SIZE})")
    p.add_argument("--slack", type=float, default=None,
                   help="chunked/decode mode: the room a re-compressing stream fills before it compresses again, as a fraction of what it "
                        "compresses back to, both within the budget (default: the default method's 0.1, back to 10/11 of the "
                        "budget; any other method's 0.5, back to 2/3; 0: one slot of room)")
    if not later_questions:
        p.add_argument("--compress-question", action="store_true", help="compress the question together with the context")
    else:
        p.set_defaults(compress_question=False)
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="a method parameter, e.g. --param anchor=median; numbers, true/false and None are converted (repeatable)")
    p.add_argument("--kv-bits", type=kv_bits, default=None, metavar="{" + ",".join(map(str, KV_BITS)) + f",{AUTO_KV_BITS}}}",
                   help="store the compressed context quantized in this many bits (keys per channel, values per token; in --mode chunked "
                        f"and decode the stream's slots as they enter, keys and values per slot); {AUTO_KV_BITS}, with --budget-unit memory "
                        "in --mode prefill: 8 where 8-bit slots in the ratio's bytes hold at least half the context, else 4 (default: full "
                        f"precision, but for the default method {AUTO_KV_BITS} in --mode prefill and 8 in the streams)")
    p.add_argument("--kv-group-size", type=count(8), default=None, metavar="N", help="with --kv-bits: values per quantization group, >= 8 (default 32)")
    p.add_argument("--budget-unit", default=None, choices=BUDGET_UNITS,
                   help="what --budget and --compression-ratio measure: tokens, or memory (with --kv-bits, as many quantized slots as fit "
                        "the bytes of that many tokens at full precision; default: memory for the default method, else tokens)")
    p.set_defaults(compression_flags=p._actions[first:])


def _run(args) -> int:
    from .. import cache_file
    from ..cache import load_cache
    from ..integration import generate

    if args.cache is not None:
        _check_no_compression_flags(args)
        if not args.cache.is_file():
            raise ValueError(f"--cache {str(args.cache)!r} is not a file: pass one written by `kvcompress compress --out FILE`")
        try:
            cache_file.read(args.cache)  # a file that is no cache (or a damaged one) is refused before the model loads
        except (ValueError, OSError) as err:
            raise ValueError(f"--cache {str(args.cache)!r}: {err}") from err
        set_threads(args.threads)
        model, tokenizer = load_cli_model(args)
        try:
            cache = load_cache(args.cache, model)
        except (ValueError, OSError) as err:  # saved for another model, or settings this version refuses
            raise ValueError(f"--cache {str(args.cache)!r}: {err}") from err
        results = generate(model, tokenizer, cache=cache, max_new_tokens=args.max_new_tokens, **_asked(args))
        return _print_results(results, args)
    options = options_of(args)  # every flag checked before the model loads
    if args.compress_question and len(args.question or []) > 1:
        raise ValueError("--compress-question compresses one question with its context, and several --question flags share one "
                         "compressed context: ask them without it, or one per run")
    context = read_context(args.context_file)
    set_threads(args.threads)
    model, tokenizer = load_cli_model(args)
    results = generate(model, tokenizer, context, options=options, max_new_tokens=args.max_new_tokens, **_asked(args))
    return _print_results(results, args)


def _questions(args) -> list[str | None]:
    """The questions asked, in order: [None] when --question is not given."""
    return args.question or [None]


def _asked(args) -> dict:
    """`kvc.generate`'s question (--question given once, or not at all) or questions (several, the context compressed once)."""
    asked = _questions(args)
    return {"question": asked[0]} if len(asked) == 1 else {"questions": asked}


def _print_results(results, args) -> int:
    """Per question: the answer, a blank line and the statistics (with a calibration, its choice), several questions'
    blocks each headed by its question as a JSON string (one line whatever it holds) and apart by a blank line; with
    --json, one JSON object a line, the question and `GenerationResult.to_dict()`."""
    asked = _questions(args)
    for i, (question, res) in enumerate(zip(asked, results if isinstance(results, list) else [results], strict=True)):
        if args.json:
            print(json.dumps({"question": question} | res.to_dict(), allow_nan=False))  # ASCII escapes: valid JSON in any encoding
            continue
        if len(asked) > 1:
            print(("\n" if i else "") + f"question          {json.dumps(question, ensure_ascii=False)}")
        print(res.text)
        print()
        print(res.report())
        if "calibration" in res.extra:
            chosen = res.extra["calibration"]
            print(f"calibration       NLL(context) {chosen['nll_context']:.3f} -> keep {chosen['retention']:.1%} "
                  f"(compression ratio {chosen['compression_ratio']:.3f}) for quality {args.quality:g}"
                  + (" (extrapolated: outside the NLL range the calibration was fitted on)" if chosen.get("extrapolated") else ""))
    return 0


def _check_no_compression_flags(args) -> None:
    """--cache answers with the saved cache's own settings: any compression flag given is an error naming it."""
    given = given_flags(args, args.compression_flags)
    if given:
        raise ValueError(f"--cache answers with the settings the cache was compressed with: it takes no {', '.join(given)}")


def options_of(args, full: bool = True):
    """The `CompressionOptions` of the flags (which checks them), after the checks that concern the flags themselves.
    full: whether the command takes --method full (compress does not: there is nothing to compress)."""
    from ..integration.model import DEFAULT_NAME
    from ..options import CompressionOptions

    if args.mode == "prefill" and "chunk_size" in args.given:
        raise ValueError(f"--chunk-size {args.chunk_size} is the prompt's block size in --mode chunked or decode; --mode prefill prefills "
                         "the context in one forward, so leave it out")
    params = parse_params(args.param)
    if args.method == FULL:
        given = [flag for flag, value in (("--budget", args.budget), ("--compression-ratio", args.compression_ratio), ("--slack", args.slack),
                                          ("--sink", args.sink), ("--window", args.window), ("--param", args.param),
                                          ("--calibration", args.calibration), ("--quality", args.quality)) if value not in (None, [])]
        given += [flag for flag, value in (("--seed", "seed" in args.given), ("--compress-question", args.compress_question)) if value]
        if given:
            raise ValueError(f"--method {FULL} keeps every token: it takes no {', '.join(given)}")
        if args.kv_bits is not None or args.kv_group_size is not None or args.budget_unit is not None:
            raise ValueError(f"--method {FULL} keeps every token at full precision: it takes no --kv-bits, --kv-group-size or --budget-unit")
        return CompressionOptions(method=None, mode=args.mode, seed=args.seed, chunk_size=args.chunk_size, compress_question=args.compress_question)
    if args.calibration is not None and args.quality is None:
        raise ValueError(f"--calibration {str(args.calibration)!r} needs --quality Q: the predicted NLL ratio of the answer to keep, in (0, 1]")
    if args.calibration is None and args.quality is not None:
        raise ValueError(f"--quality {args.quality:g} goes with --calibration FILE (a file written by `kvcompress calibrate`)")
    if args.calibration is None and args.budget is None and args.compression_ratio is None:
        raise ValueError("pass --compression-ratio, --budget or --calibration with --quality" + (f" (or --method {FULL})" if full else ""))
    # with --calibration and no --method, the options run the method the file was fitted for (and refuse another)
    options = CompressionOptions(method=args.method or DEFAULT_METHOD, method_params=params, budget=args.budget,
                                 compression_ratio=args.compression_ratio, mode=args.mode, sink=args.sink, window=args.window,
                                 seed=args.seed, slack=args.slack, chunk_size=args.chunk_size, compress_question=args.compress_question,
                                 quality=args.quality, calibration=args.calibration, kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                                 budget_unit=args.budget_unit)
    fitted_on, model = options.calibration and options.calibration.model, Path(args.model or DEFAULT_NAME).name
    if fitted_on and Path(fitted_on).name != model:  # a curve predicts the quality of the model it was fitted on
        raise ValueError(f"--calibration {str(args.calibration)!r} was fitted on model {Path(fitted_on).name!r}, this run's is {model!r}: "
                         f"fit one for it with `kvcompress calibrate{f' --model {args.model}' if args.model else ''} ...`")
    return options


# The byte-order marks of the encodings a text file that is not UTF-8 most often starts with, longest first.
_BYTE_ORDER_MARKS = ((b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"), (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16"))


def read_context(path: Path) -> str:
    """--context-file's text: a UTF-8 file (a leading byte-order mark dropped), or standard input for `-`."""
    stdin = str(path) == "-"
    name = "'-' (standard input)" if stdin else repr(str(path))
    if stdin:
        if sys.stdin is None or sys.stdin.closed:
            raise ValueError("--context-file '-' reads standard input, which is closed: pipe the context in, or name a file")
        if sys.stdin.isatty():
            print("kvcompress: reading the context from standard input; end it with Ctrl-D", file=sys.stderr)
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8")
    elif path.is_dir():
        raise ValueError(f"--context-file {name} is a directory: pass a text file")
    elif not path.exists():
        raise ValueError(f"--context-file {name} does not exist")
    else:
        data = path.read_bytes()
    try:
        # a byte-order mark, if the text starts with one, is not context; line ends read as a text file's (universal newlines)
        text = data.decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as err:
        # a UTF-32 mark starts like a UTF-16 one: test it first
        source = next((encoding for mark, encoding in _BYTE_ORDER_MARKS if data.startswith(mark)), "latin1")
        found = "" if source == "latin1" else f"; it starts with a {source.upper()} byte-order mark"
        raise ValueError(f"--context-file {name} is not UTF-8 text (byte {err.start}: {err.reason}{found}); "
                         f"convert it first, e.g. iconv -f {source} -t utf-8") from None
    if not text.strip():
        raise ValueError(f"--context-file {name} is empty{' but for white space' if text else ''}: pass "
                         f"{'text' if stdin else 'a file'} holding the context")
    return text
