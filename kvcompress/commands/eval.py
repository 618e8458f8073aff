"""`kvcompress eval [tasks|approx]`: the task sweep (default) or the attention-approximation bench."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from ..eval.benchmarks import BENCHMARKS
from ..eval.tasks import HAYSTACKS, NEEDLE_KINDS, TASKS
from .common import (
    add_device_args, add_model_arg, add_threads_arg, count, float_list, given_flags, given_options, int_list, list_of, load_cli_model, make_out_folder, name_list, parse_params,
    resolve_device, results_folder, seed, set_threads, user_path,
)
from ..names import (
    APPROX_LAYERS, APPROX_RATIOS, DEFAULT_CHUNK_SIZE, DEFAULT_METHOD, FULL, DEFAULT_PROMPT_LAYOUT, KVZIP_REFIT, METHODS, MODES, PROMPT_LAYOUTS, PERPLEXITY, PERPLEXITY_BLOCK, PERPLEXITY_CONTEXT_FRACTION, PERPLEXITY_DOCUMENTS, SWEEP_LENGTHS, SWEEP_RATIOS, SWEEP_SAMPLES,
)

DESCRIPTION = """\
Offline evaluation on a real model (default SmolLM2-135M-Instruct, or --model PATH).

  kvcompress eval [tasks]  the task sweep: every method x ratio x mode x task x length x sample,
                           answered greedily and scored; prefill mode prefills each context once and
                           compresses a copy of it per method and ratio. Results are appended to
                           OUT/results.jsonl; rerunning with the same --out resumes an interrupted
                           sweep (recorded cells are skipped). Writes OUT/summary.csv, OUT/summary.md
                           and PNG plots (accuracy vs ratio per task, needle heat-maps).
  kvcompress eval --benchmark ruler|longbench|longbench-e|infinitebench|kvpress --data PATH
                           the same sweep on a standard benchmark's local files, scored by its own
                           metric; writes OUT/leaderboard_<benchmark>.md/.html/.png (method x ratio,
                           average and per task, with 95% intervals).
  --shard I/N              run the I-th of N disjoint slices of the samples (0 <= I < N); N processes
                           share one --out.
  --ray [ADDRESS]          run each sample (its prefill and all its methods) as a Ray task, on the
                           cluster at ADDRESS or a local one; crashed workers' samples are retried
                           and the driver alone writes OUT/results.jsonl (pip install kvcompress[ray]).
  kvcompress eval --tasks perplexity
                           language modelling under compression (the StreamingLLM / H2O protocol):
                           documents of real prose (--lengths tokens, default 2048; --samples per
                           length), the first --context-fraction (3/4) as context, the rest scored
                           teacher-forced in blocks of --block; prefill mode compresses the context
                           once, decode mode streams every token in blocks of --chunk-size (default
                           modes: prefill,decode). Perplexity and its ratio to the full cache, with
                           95% t-intervals over documents; LOWER IS BETTER. Writes OUT/results.jsonl
                           (resumable), OUT/summary.csv, OUT/summary.md and
                           OUT/leaderboard_perplexity.md/.html/.png. It runs alone (not with other tasks).
  kvcompress eval approx   relative error of attention over each method's summary of real q/k/v
                           (the BalanceKV paper's App. B.1): sinks and the last --queries tokens exact, the middle
                           compressed; writes OUT/approx.csv, OUT/approx.md and OUT/approx.png.
"""


def _shard(text: str) -> tuple[int, int]:
    """argparse type: "I/N", two decimal integers with 0 <= I < N."""
    match = re.fullmatch(r"([0-9]+)/([0-9]+)", text)
    shard = (int(match[1]), int(match[2])) if match else None
    if shard is None or not 0 <= shard[0] < shard[1]:
        raise argparse.ArgumentTypeError(f"--shard takes I/N with 0 <= I < N, got {text!r}")
    return shard


def add_cli(subparsers) -> None:
    """Add the `eval` subcommand to the kvcompress command line."""
    p = subparsers.add_parser("eval", help="offline task sweep or attention-approximation bench on a real model",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench", nargs="?", default="tasks", choices=["tasks", "approx"], help="which evaluation (default: tasks)")
    add_model_arg(p)
    add_device_args(p)
    p.add_argument("--out", type=results_folder, default=Path("results/eval"), help="output directory (default: results/eval)")
    p.add_argument("--methods", type=list_of((FULL, DEFAULT_METHOD, KVZIP_REFIT, *METHODS), "method"), default=None,
                   help=f"comma-separated method names; '{DEFAULT_METHOD}' (task sweep and perplexity) and '{KVZIP_REFIT}' (task "
                        "sweep only) are the library's default for each mode and the slow prefill default before KVzap; "
                        f"'{FULL}' alone runs the task sweep's full-cache cells only, which every sweep has unless --no-full "
                        f"(default: the task sweep runs '{DEFAULT_METHOD}' and every registered method, approx and perplexity "
                        "every registered method)")
    p.add_argument("--ratios", type=float_list, default=None,
                   help=f"comma-separated compression ratios, fraction removed, in [0, 1) (default tasks: {','.join(map(str, SWEEP_RATIOS))}; "
                        f"approx: {','.join(map(str, APPROX_RATIOS))}, the middle's rate)")
    add_threads_arg(p)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    t = p.add_argument_group("tasks (kvcompress eval [tasks])")
    t.add_argument("--tasks", type=name_list, default=None,
                   help=f"comma-separated tasks (default: {','.join(TASKS)}; with --benchmark: every task in --data); "
                        f"or {PERPLEXITY} alone: language modelling under compression (see above)")
    t.add_argument("--lengths", type=int_list, default=None, help=f"comma-separated context lengths in tokens (default: {','.join(map(str, SWEEP_LENGTHS))}; not with --benchmark); "
                   f"with --tasks {PERPLEXITY}: document lengths (default 2048)")
    t.add_argument("--samples", type=count(1), default=None, help=f"samples per task and length (default {SWEEP_SAMPLES}); depth tasks put sample i at depth 0.5, 0.118, 0.736, 0.354, ... (golden-ratio steps), so raising --samples on a finished run adds samples. "
                   "With --benchmark: the first N samples of each task (default: all). "
                   f"With --tasks {PERPLEXITY}: documents per length (default {PERPLEXITY_DOCUMENTS}); document i is the same in every run of a --seed")
    t.add_argument("--modes", type=list_of(MODES, "mode"), default=None, help=f"comma-separated modes among {','.join(MODES)} (default: prefill; "
                   f"with --tasks {PERPLEXITY}: prefill,decode); chunked/decode get the middle budget the ratio gives in prefill mode "
                   f"({PERPLEXITY}, decode mode: the ratio of the whole document)")
    t.add_argument("--seed", type=seed, default=0, help="base seed of the task generators and of randomised methods (default 0)")
    t.add_argument("--haystack", default=None, choices=HAYSTACKS, help="needle haystack: repeated filler or real prose (default filler)")
    t.add_argument("--kind", default=None, choices=NEEDLE_KINDS, help="needle values (default numbers)")
    t.add_argument("--task-param", action="append", default=[], metavar="TASK.NAME=VALUE",
                   help="a task generator argument, e.g. --task-param niah_multikey.n_keys=4 or "
                        "--task-param line_retrieval.n_lines=1 (repeatable; see kvcompress.eval.tasks)")
    t.add_argument("--grid-lengths", type=int_list, default=[], help="needle heat-map context lengths (comma-separated; default: no heat-map)")
    t.add_argument("--grid-depths", type=float_list, default=[], help="needle heat-map depths in [0, 1] (comma-separated)")
    t.add_argument("--grid-ratios", type=float_list, default=[0.75], help="compression ratios of the heat-map (default 0.75)")
    t.add_argument("--grid-task", default="niah_single", help="needle task of the heat-map (default niah_single)")
    t.add_argument("--no-full", action="store_true", help="skip the full-cache reference cells")
    t.add_argument("--no-reuse-prefill", action="store_true", help="re-prefill the context for every method (to measure what prefill reuse saves)")
    t.add_argument("--max-new-tokens", type=count(1), default=None, help="answer tokens (default: per task, enough for its answers)")
    t.add_argument("--chunk-size", type=count(1), default=DEFAULT_CHUNK_SIZE, help=f"prompt block size in chunked/decode modes (default {DEFAULT_CHUNK_SIZE})")
    t.add_argument("--prompt-layout", default=DEFAULT_PROMPT_LAYOUT, choices=PROMPT_LAYOUTS,
                   help=f"how each prompt joins context and question (docs/prompt_layout.md): blank_line / newline separator, "
                        f"_primed: the task's answer prefix starts the answer (default {DEFAULT_PROMPT_LAYOUT}); recorded in every "
                        "record; a results folder keeps one layout")
    lm = p.add_argument_group(f"language modelling under compression (kvcompress eval --tasks {PERPLEXITY})")
    lm.add_argument("--context-fraction", type=float, default=None,
                    help=f"share of each document given as context; the rest is scored (default {PERPLEXITY_CONTEXT_FRACTION})")
    lm.add_argument("--block", type=count(1), default=None,
                    help=f"continuation tokens fed (teacher-forced) per forward in prefill/chunked modes and for the full cache (default {PERPLEXITY_BLOCK})")
    b = p.add_argument_group("standard benchmarks and scale-out (kvcompress eval [tasks])")
    b.add_argument("--benchmark", default=None, choices=BENCHMARKS, help="evaluate on a standard benchmark's local files instead of the generated tasks")
    b.add_argument("--data", type=user_path, default=None, help="the benchmark's data: a .jsonl/.parquet file, a directory of them, or a datasets save_to_disk directory")
    b.add_argument("--shard", type=_shard, default=None, metavar="I/N", help="run only the I-th of N disjoint slices of the samples (0 <= I < N)")
    b.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run samples as Ray tasks on the cluster at ADDRESS (e.g. auto) or, without ADDRESS, on a local one")
    b.add_argument("--ray-cpus", type=count(1), default=1, help="CPUs (and torch threads) per Ray task when the cluster has no GPU (default 1); with GPUs a task holds 1 GPU")
    b.add_argument("--ray-retries", type=count(0), default=3, help="retries of a Ray task whose worker crashed or was pre-empted (default 3)")
    a = p.add_argument_group("approx (kvcompress eval approx)")
    a.add_argument("--layers", type=int_list, default=list(APPROX_LAYERS), help=f"comma-separated layers (default {','.join(map(str, APPROX_LAYERS))})")
    a.add_argument("--tokens", type=count(1), default=2048, help="tokens of real prose captured (default 2048)")
    a.add_argument("--queries", type=count(1), default=256, help="last queries whose attention is approximated; they are the exact window (default 256)")
    a.add_argument("--sink", type=count(0), default=256, help="first tokens kept exactly (default 256, the BalanceKV paper's)")
    a.add_argument("--seeds", type=count(1), default=10, help="seeds per method, ratio and layer for the error bars (default 10)")
    a.add_argument("--text-seed", type=count(0), default=0, help="shuffle of the prose paragraphs (default 0)")
    # each evaluation's own flags, so that another one's given to it is refused rather than ignored
    p.set_defaults(func=run_cli, sweep_flags=[*t._group_actions, *lm._group_actions, *b._group_actions], approx_flags=a._group_actions,
                   on_interrupt="run the same command again to go on: the cells already recorded in --out are kept")


def run_cli(args) -> int:
    set_threads(args.threads)
    if args.ray is None and {"ray_cpus", "ray_retries"} & args.given:
        raise ValueError("--ray-cpus and --ray-retries go with --ray")
    if args.methods and FULL in args.methods:
        compressing = sorted({"--ratios", "--modes", "--grid-ratios"} & {f"--{d.replace('_', '-')}" for d in args.given})
        if args.methods != [FULL] or args.bench == "approx" or (args.tasks and PERPLEXITY in args.tasks) or args.no_full or compressing:
            raise ValueError(f"--methods {FULL} runs the task sweep's full-cache cells alone (every sweep has them unless --no-full, and "
                             f"perplexity's are each ratio's reference): give it alone, without --no-full, --tasks {PERPLEXITY}, approx "
                             f"or the compressed cells' --ratios, --modes, --grid-ratios; got --methods {','.join(args.methods)}"
                             + (f" with {', '.join(compressing + ['--no-full'] * args.no_full)}" if compressing or args.no_full else ""))
        args.methods = []
    if args.tasks and not args.benchmark:
        unknown = [t for t in args.tasks if t not in TASKS and t != PERPLEXITY]
        if unknown:
            raise ValueError(f"--tasks: unknown task(s) {unknown}; known tasks: {', '.join(TASKS)}, or {PERPLEXITY} alone "
                             "(a benchmark's own task names go with --benchmark)")
    if args.bench == "approx":
        given = given_flags(args, args.sweep_flags)
        if given:
            raise ValueError(f"`eval approx` takes none of the task sweep's and perplexity's flags; got {', '.join(given)}")
        return _run_approx(args)
    given = given_flags(args, args.approx_flags)
    if given:
        raise ValueError(f"the task sweep and perplexity take none of `eval approx`'s flags; got {', '.join(given)}")
    if args.tasks and PERPLEXITY in args.tasks:
        return _run_perplexity(args)
    if args.context_fraction is not None or args.block is not None:
        raise ValueError(f"--context-fraction and --block apply to --tasks {PERPLEXITY}")
    return _run_sweep(args)


def _run_perplexity(args) -> int:
    """Language modelling under compression (`eval.perplexity`), then its summary and leaderboard."""
    from ..integration.model import DEFAULT_NAME
    from ..eval.perplexity import check_perplexity_folder, perplexity_documents, run_perplexity, write_report
    from ..eval.runner import dtype_name, shard_specs

    config = _perplexity_config(args)
    device, dtype = resolve_device(args.device, args.dtype)
    check_perplexity_folder(config, args.out, args.model or DEFAULT_NAME, dtype_name(dtype))  # before the model loads
    shard_specs(perplexity_documents(config), args.shard)
    make_out_folder(args.out, "eval")
    model, tokenizer = load_cli_model(args, device, dtype)
    start = time.perf_counter()
    records = run_perplexity(model, tokenizer, config, args.out, progress=not args.no_progress, model_name=args.model or DEFAULT_NAME,
                             shard=args.shard)
    outputs = write_report(records, args.out)
    print(outputs[0].read_text(encoding="utf-8"))
    _done(start, outputs)
    return 0


def _perplexity_config(args):
    """The perplexity run's config from the eval flags; flags of the question-answering sweep are refused."""
    from ..eval.perplexity import PerplexityConfig

    others = [t for t in args.tasks if t != PERPLEXITY]
    if others:
        raise ValueError(f"--tasks {PERPLEXITY} runs alone (its records and summary differ from the question-answering tasks'), "
                         f"got it with {others}; run those with another --out")
    given = given_options(args, "benchmark", "data", "haystack", "kind", "task_param", "grid_lengths", "grid_depths", "grid_ratios",
                   "grid_task", "max_new_tokens", "no_reuse_prefill", "ray", "prompt_layout")
    if given:
        raise ValueError(f"{', '.join(given)} do not apply to --tasks {PERPLEXITY} (it scores a document's own continuation, no questions)")
    if args.samples is not None and args.samples < 1:
        raise ValueError(f"--samples (documents per length with --tasks {PERPLEXITY}) must be >= 1, got {args.samples}")
    options = {k: v for k, v in (("modes", args.modes), ("lengths", args.lengths), ("documents", args.samples),
                                 ("context_fraction", args.context_fraction), ("block", args.block)) if v is not None}
    config = PerplexityConfig(methods=args.methods, ratios=args.ratios or list(SWEEP_RATIOS), seed=args.seed, chunk_size=args.chunk_size,
                              include_full=not args.no_full, **options)
    _check_chunk_size(args, config.modes)
    return config


def _check_chunk_size(args, modes: list[str]) -> None:
    """--chunk-size given to a run with no streaming mode is refused, as `generate` refuses it in --mode prefill."""
    from ..eval.runner import any_streams

    if "chunk_size" in args.given and not any_streams(modes):
        raise ValueError(f"--chunk-size {args.chunk_size} is the prompt's block size in --modes chunked or decode; this run has "
                         "--modes prefill only, which prefills each context in one forward: leave it out")


def _run_approx(args) -> int:
    from ..eval.approx import run_approx, write_approx
    from ..eval.plots import plot_approx

    config = _approx_config(args)
    make_out_folder(args.out, "eval approx")
    model, tokenizer = load_cli_model(args)
    start = time.perf_counter()
    rows = run_approx(model, tokenizer, config, progress=not args.no_progress)
    outputs = [*write_approx(rows, args.out, config), plot_approx(rows, args.out / "approx.png")]
    _done(start, outputs)
    return 0


def _done(start: float, outputs) -> None:
    print(f"done in {time.perf_counter() - start:.0f} s; wrote " + ", ".join(str(o) for o in outputs if o is not None))


def _run_sweep(args) -> int:
    """The task sweep or a benchmark sweep (locally, as one shard, or on Ray), then its report."""
    import functools

    from ..integration import load_model
    from ..integration.model import DEFAULT_NAME
    from ..eval.runner import check_results_folder, dtype_name, run_sweep, sample_specs, shard_specs

    if args.ray is not None and args.shard is not None:
        raise ValueError("--shard and --ray exclude each other: Ray distributes the samples itself")
    config = _sweep_config(args)
    model_name = args.model or DEFAULT_NAME
    device, dtype = resolve_device(args.device, args.dtype)
    check_results_folder(config, args.out, model_name, dtype_name(dtype))  # before the model loads
    # a missing or malformed data file, or a shard with no sample, fails here, before the model loads
    shard_specs(sample_specs(config), args.shard)
    make_out_folder(args.out, "eval")
    start = time.perf_counter()
    failures: list[str] = []
    if args.ray is not None:
        from ..eval.ray_sweep import run_sweep_ray

        records, failures = run_sweep_ray(functools.partial(load_model, args.model, device, dtype), config, args.out, address=args.ray or None,
                                          cpus_per_task=args.ray_cpus, max_retries=args.ray_retries,
                                          progress=not args.no_progress, model_name=model_name, dtype=dtype_name(dtype))
    else:
        model, tokenizer = load_cli_model(args, device, dtype)
        records = run_sweep(model, tokenizer, config, args.out, progress=not args.no_progress, model_name=model_name, shard=args.shard)
    if args.benchmark:
        from ..eval.leaderboard import write_leaderboard

        outputs = write_leaderboard(records, args.out)
        print(outputs[0].read_text(encoding="utf-8"))
    else:
        from ..eval.plots import plot_sweep
        from ..eval.runner import write_summary

        outputs = [*write_summary(records, args.out), *plot_sweep(records, args.out)]
        print((args.out / "summary.md").read_text(encoding="utf-8"))
    _done(start, outputs)
    if failures:
        print(f"{len(failures)} samples failed; rerun the same command to do their cells:\n" + "\n".join(failures))
        return 1
    if records and all(r["error"] is not None for r in records):
        print(f"kvcompress eval: no cell of {args.out} answered: all {len(records)} hold an error, the first: {records[0]['error']}",
              file=sys.stderr)
        return 1
    return 0


def _sweep_config(args):
    from ..eval.runner import SweepConfig, check_task_settings

    if args.benchmark:
        given = given_options(args, "lengths", "haystack", "kind", "task_param", "grid_lengths", "grid_depths", "grid_ratios", "grid_task")
        if given:
            raise ValueError(f"{', '.join(given)} belong to the generated tasks and do not apply with --benchmark {args.benchmark}")
        if args.data is None:
            raise ValueError(f"--benchmark {args.benchmark} needs --data PATH (the benchmark's local files)")
    elif args.data is not None:
        raise ValueError("--data goes with --benchmark")
    elif args.grid_lengths and not args.grid_depths:
        raise ValueError("--grid-lengths and --grid-depths set the needle heat map together: give both")
    elif not args.grid_lengths and given_options(args, "grid_depths", "grid_ratios", "grid_task"):
        raise ValueError(f"{', '.join(given_options(args, 'grid_depths', 'grid_ratios', 'grid_task'))} set the needle heat map, which "
                         "--grid-lengths asks for: give --grid-lengths too")
    config = SweepConfig(
        methods=args.methods, ratios=args.ratios or list(SWEEP_RATIOS), modes=args.modes or ["prefill"], tasks=args.tasks,
        lengths=args.lengths or list(SWEEP_LENGTHS), samples=args.samples if args.samples is not None else (None if args.benchmark else SWEEP_SAMPLES), seed=args.seed,
        haystack=args.haystack or "filler", kind=args.kind or "numbers", benchmark=args.benchmark,
        data=None if args.data is None else str(args.data.resolve()),  # the place, however it was written
        grid_task=args.grid_task, grid_lengths=args.grid_lengths, grid_depths=args.grid_depths, grid_ratios=args.grid_ratios,
        include_full=not args.no_full, reuse_prefill=not args.no_reuse_prefill, max_new_tokens=args.max_new_tokens,
        chunk_size=args.chunk_size, task_params=_task_params(args.task_param), prompt_layout=args.prompt_layout,
    )
    _check_chunk_size(args, config.modes)
    if not args.benchmark:
        tasks = config.tasks + ([config.grid_task] if config.grid_lengths else [])
        check_task_settings(tasks, haystack=args.haystack, kind=args.kind)
        unused = sorted(set(config.task_params) - set(tasks))
        if unused:
            raise ValueError(f"--task-param names task(s) {unused} this run does not run (its tasks: {', '.join(tasks)})")
        for name in ("kind", "haystack"):  # one value each: the run's records and its config.json would disagree
            both = [f"{task}.{name}={params[name]}" for task, params in config.task_params.items() if name in params]
            if both and given_options(args, name):
                raise ValueError(f"--{name} {getattr(args, name)} and --task-param {', '.join(both)} set the same thing: give one")
    return config


def _task_params(items: list[str]) -> dict[str, dict]:
    """["task.name=value", ...] -> {task: {name: value}} (values converted as `--param` does; `SweepConfig` checks them,
    its names of them shown as --task-param TASK.NAME, `cli.as_flag`)."""
    out: dict[str, dict] = {}
    for item in items:
        task, dot, rest = item.partition(".")
        if not dot or not task:
            raise ValueError(f"--task-param takes TASK.NAME=VALUE, got {item!r}")
        out.setdefault(task, {}).update(parse_params([rest], flag="--task-param"))
    return out


def _approx_config(args):
    from ..eval.approx import ApproxConfig

    return ApproxConfig(
        methods=args.methods, ratios=args.ratios or list(APPROX_RATIOS), layers=args.layers, tokens=args.tokens,
        n_queries=args.queries, sink=args.sink, seeds=args.seeds, text_seed=args.text_seed,
    )
