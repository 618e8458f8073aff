"""`kvcompress compress`: compress a context file once and save the compressed cache (`kvc.compress_context`, `save`)."""

from __future__ import annotations

from .common import check_out_folder, load_cli_model, set_threads, user_path
from .generate import add_run_args, options_of, read_context


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("compress", help="compress a context file once and save the cache, for `generate --cache`")
    p.add_argument("--context-file", required=True, type=user_path, help="text file holding the context (- reads standard input)")
    p.add_argument("--out", required=True, type=user_path, metavar="FILE", help="where the compressed cache is written (one safetensors file)")
    add_run_args(p, _run, later_questions=True)


def _run(args) -> int:
    from ..integration import compress_context

    options = options_of(args, full=False)  # every flag checked before the model loads
    check_out_folder("--out", args.out)
    context = read_context(args.context_file)
    set_threads(args.threads)
    model, tokenizer = load_cli_model(args)
    cache = compress_context(model, tokenizer, context, options)
    cache.save(args.out)
    slots = cache.slots_per_layer()
    chosen = "" if args.calibration is None else (f", compression ratio {cache.options.compression_ratio:.3f} chosen by the calibration "
                                                   f"for quality {args.quality:g}")
    print(f"saved {args.out}: {cache.nbytes() / 2**20:.2f} MiB of KV, {sum(slots) / len(slots):.0f} slots per layer and KV head "
          f"(method {options.method}{'' if cache.kv_bits is None else f', {cache.kv_bits}-bit'}{chosen})")
    return 0
