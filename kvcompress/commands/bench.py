"""`kvcompress bench`: compression overhead, end-to-end prefill cost, streaming throughput, decode speed and peak memory against the uncompressed baseline (`kvcompress.eval.bench`)."""

from __future__ import annotations

from pathlib import Path

from .common import (add_device_args, add_model_arg, count_list, float_list, given_flags, int_list, list_of, method_list, method_name,
                     make_out_folder, one_of, resolve_device, results_folder, seed)
from ..names import BENCH_SECTIONS, BENCH_SHAPES, BENCH_SIZES, DEFAULT_CHUNK_SIZE, MODES


# the flags outside the sections' groups that only some sections read: a run of none of them refuses the flag
_SECTIONS_READING = {"methods": ("overhead", "prefill", "throughput", "decode"), "seed": ("overhead", "throughput", "decode", "attention"),
                     "model": ("prefill", "decode", "memory")}
_GLOBAL_FLAGS_READ = {section: {dest for dest, sections in _SECTIONS_READING.items() if section in sections}
                      for section in BENCH_SECTIONS}


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="cost benchmarks: compression overhead, prefill cost, streaming throughput, decode speed, peak memory (ratios to the uncompressed baseline)",
        description=__doc__ + " Writes <section>.csv, bench.md and PNG plots into --out.",
    )
    shape = one_of(BENCH_SHAPES, "shape")
    p.add_argument("--sections", type=list_of(BENCH_SECTIONS, "section"), default=list(BENCH_SECTIONS),
                   help=f"comma-separated sections to run, among {','.join(BENCH_SECTIONS)} (default: all)")
    p.add_argument("--methods", type=method_list, default=None, help="comma-separated methods (default: every registered method)")
    p.add_argument("--out", type=results_folder, default=Path("benchmarks/results/bench"), help="output directory (default benchmarks/results/bench)")
    p.add_argument("--threads", type=count_list, default=[],
                   help="torch CPU threads, or a comma-separated list to run everything once per count, into --out/threads-<count>/ "
                        "with one combined bench.md (default: torch's own choice)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the synthetic tensors and of randomised methods (default 0)")
    p.add_argument("--report-only", action="store_true", help="measure nothing: rewrite bench.md and the plots from the CSVs already in --out")
    groups = {}  # section -> its argument group, whose flags a run without the section refuses
    g = groups["overhead"] = p.add_argument_group("overhead: compress / stream time over one exact causal attention pass")
    g.add_argument("--shapes", type=list_of(BENCH_SHAPES, "shape"), default=list(BENCH_SHAPES),
                   help=f"layer shapes, among {','.join(BENCH_SHAPES)} (default {','.join(BENCH_SHAPES)})")
    g.add_argument("--sizes", type=int_list, default=list(BENCH_SIZES),
                   help=f"comma-separated token counts n (default {','.join(map(str, BENCH_SIZES))})")
    g.add_argument("--compression-ratio", type=float, default=0.5, help="fraction of the n tokens removed, in [0, 1) (default 0.5)")
    g.add_argument("--repeats", type=int, default=3, help="timed calls per measurement; min and median are reported (default 3)")
    block = g.add_argument("--block", type=int, default=128, help="tokens per stream update (default 128)")
    g.add_argument("--max-seconds", type=float, default=30.0,
                   help="per measurement: repeats stop after this many seconds, and a call slower than this is not run at larger n (default 30)")
    g.add_argument("--stream", choices=["native", "all", "none"], default="native",
                   help="time stream updates of natively streaming methods, of all methods (block-wise replay), or none (default native)")
    g = groups["prefill"] = p.add_argument_group("prefill: `generate` prefill with compression over a plain transformers prefill, on the model")
    g.add_argument("--prefill-tokens", type=int, default=4096, help="context tokens of real prose (default 4096)")
    g.add_argument("--prefill-ratio", type=float, default=0.75, help="fraction of the context removed, in [0, 1) (default 0.75)")
    g.add_argument("--prefill-repeats", type=int, default=2, help="prefills per method (default 2)")
    g.add_argument("--plain-every", type=int, default=4, help="a plain prefill before every this many methods (default 4)")
    g.add_argument("--kernel-repeats", type=int, default=3,
                   help="interleaved SDPA / fused attention-mass kernel calls per layer, for methods that need the mass (default 3)")
    g = groups["throughput"] = p.add_argument_group("throughput: tokens/s a stream absorbs, every method against KeyDiff (--block tokens per update)")
    g.add_argument("--throughput-shape", type=shape, default="llama8b", help=f"layer shape, among {','.join(BENCH_SHAPES)} (default llama8b)")
    g.add_argument("--throughput-tokens", type=int, default=8192, help="tokens streamed, half of them kept (default 8192)")
    g.add_argument("--throughput-repeats", type=int, default=3, help="runs per method, min reported (default 3)")
    g = groups["decode"] = p.add_argument_group("decode: greedy tokens/s on the model")
    g.add_argument("--decode-context", type=int, default=8000,
                   help="context tokens of the decode run (default 8000: with the chat template, question and answer, within the "
                        "default model's 8192 positions)")
    kept = g.add_argument("--kept", type=float_list, default=[0.25, 0.5], help="comma-separated fractions of the context kept (default 0.25,0.5)")
    g.add_argument("--decode-tokens", type=int, default=32, help="greedy tokens decoded per run (default 32)")
    g = groups["attention"] = p.add_argument_group("attention: the attention-only decode step")
    g.add_argument("--step-shape", type=shape, default="llama8b", help=f"shape of the attention-only step, among {','.join(BENCH_SHAPES)} (default llama8b)")
    g.add_argument("--step-contexts", type=int_list, default=[8192, 32768], help="context lengths of the attention-only step (default 8192,32768)")
    g.add_argument("--step-repeats", type=int, default=50, help="timed steps per case (default 50)")
    g = groups["memory"] = p.add_argument_group("memory: peak KV bytes and peak process memory, prefill vs chunked mode")
    g.add_argument("--memory-method", type=method_name, default="keydiff", help="method of the memory runs (default keydiff)")
    g.add_argument("--memory-sizes", type=int_list, default=[2048, 4096, 8192, 16384], help="prompt lengths (default 2048,4096,8192,16384)")
    g.add_argument("--memory-budget", type=int, default=1024, help="middle budget (slots per KV head) of the memory runs (default 1024)")
    g.add_argument("--memory-modes", type=list_of(MODES, "mode"), default=["chunked", "prefill"], help="generation modes compared (default chunked,prefill)")
    g.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help=f"prompt block size in chunked mode (default {DEFAULT_CHUNK_SIZE})")
    add_model_arg(p)
    add_device_args(p)
    shared = {"throughput": [block], "attention": [kept]}  # a flag of one section's group that another section reads too
    shared |= {section: [*shared.get(section, []), *(a for a in p._actions if a.dest in dests)]
               for section, dests in _GLOBAL_FLAGS_READ.items()}
    section_flags = {section: [*group._group_actions, *shared.get(section, [])] for section, group in groups.items()}
    p.set_defaults(func=_run, measurement_flags=[a for a in p._actions if a.dest not in ("help", "out", "report_only")],
                   section_flags=section_flags)


def _run(args) -> int:
    from ..eval import bench
    from ..methods.registry import build_method

    if args.report_only:
        given = given_flags(args, args.measurement_flags)
        if given:
            raise ValueError(f"--report-only measures nothing and takes only --out; got measurement options {given}")
        try:
            bench.report(args.out)
        except ValueError as err:
            raise ValueError(f"--out: {err}") from err
        return 0
    used = {action.dest for section in args.sections for action in args.section_flags[section]}
    unused = given_flags(args, dict.fromkeys(a for actions in args.section_flags.values() for a in actions if a.dest not in used))
    if unused:
        raise ValueError(f"{', '.join(unused)} set sections not run (--sections {','.join(args.sections)}); add their sections or leave them out")
    if "block" in args.given and "throughput" not in args.sections and args.stream == "none":
        raise ValueError("--block sets the stream updates' size; --stream none times no stream in the overhead section, and the "
                         "throughput section is not run: leave it out")
    if "chunk_size" in args.given and "memory" in args.sections and args.memory_modes == ["prefill"]:
        raise ValueError("--chunk-size sets the blocks of a streaming mode; --memory-modes prefill streams nothing: leave it out")
    # every measurement flag is the BenchConfig field of its name; shape names become Shapes, --device/--dtype torch objects
    options = {action.dest: getattr(args, action.dest) for action in args.measurement_flags}
    device, dtype = resolve_device(args.device, args.dtype)
    options |= {"shapes": [bench.SHAPES[s] for s in args.shapes], "throughput_shape": bench.SHAPES[args.throughput_shape],
                "step_shape": bench.SHAPES[args.step_shape], "device": device, "dtype": dtype}
    config = bench.BenchConfig(**options)
    if "prefill" in args.sections:
        _check_prefill_ratio(config)
        if "kernel_repeats" in args.given and not any(build_method(m).requirements.needs("attention_mass") for m in config.methods):
            raise ValueError(f"--kernel-repeats times the attention-mass kernel of a method that needs it (H2O); --methods "
                             f"{','.join(config.methods)} has none: leave it out")
    _check_thread_layout(args.out, len(config.threads) > 1)
    make_out_folder(args.out, "bench")
    bench.run(args.out, config)
    return 0


def _check_prefill_ratio(config) -> None:
    """Before anything is measured: the prefill section's ratio removes tokens every method can remove from a context of
    --prefill-tokens (its sink and window stay exact); refused naming the section's flags (the library names the
    --compression-ratio of the overhead section)."""
    from ..options import CompressionOptions

    for method in config.methods:
        try:
            CompressionOptions(method=method, compression_ratio=config.prefill_ratio).budget_for(config.prefill_tokens)
        except ValueError as err:
            if "cannot be honoured" not in str(err):
                raise
            raise ValueError(f"--prefill-ratio {config.prefill_ratio} cannot be honoured by {method!r} in a context of --prefill-tokens "
                             f"{config.prefill_tokens}: its exact sink and window leave too few tokens to remove that share; raise "
                             "--prefill-tokens or lower --prefill-ratio") from None


def _check_thread_layout(out: Path, several: bool) -> None:
    """A run of one thread count writes its CSVs into --out, a run of several into --out/threads-<count>/; the report of a
    folder reads one layout, so a run of the other kind into it would hide what is there (refused)."""
    counts = sorted(p.name for p in out.glob("threads-*") if p.is_dir()) if out.is_dir() else []
    csvs = sorted(p.name for p in out.glob("*.csv")) if out.is_dir() else []
    if not several and counts:
        raise ValueError(f"--out {str(out)!r} holds a run of several thread counts ({', '.join(counts)}), which a run of one count would "
                         "hide from its report: give --threads as that list again, or write to another --out")
    if several and csvs:
        raise ValueError(f"--out {str(out)!r} holds a run of one thread count ({', '.join(csvs)}), which would hide the run of "
                         "several counts from the report: write to another --out")
