"""`kvcompress calibrate`: measure triples for a method on a model, fit the curve (`kvc.calibrate`), save the JSON file."""

from __future__ import annotations

import json

from ..eval.tasks import TASKS
from .common import (add_device_args, add_model_arg, add_threads_arg, check_out_folder, count, float_list, list_of, method_name,
                     load_cli_model, seed, set_threads, user_path)
from ..names import CALIBRATION_RETENTIONS

DEFAULT_TASKS = ("niah_single", "niah_multikey", "variable_tracking", "frequent_words")  # each honours a short --tokens


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="fit the context-calibration curve of a method (Compactor seed Sec. 3.5)",
        description="Measure (retention, NLL(context), NLL ratio of the known answer) triples on offline tasks, "
        "fit k = alpha*NLL(c) + beta of f(r) = (e^{kr}-1)/(e^k-1) with an asymmetric loss, and save the fit as JSON.",
    )
    p.add_argument("--method", type=method_name, default="compactor", help="registered method name (default compactor)")
    p.add_argument("--tasks", type=list_of(TASKS, "task"), default=list(DEFAULT_TASKS),
                   help=f"comma-separated offline task names, among {','.join(TASKS)} (default {','.join(DEFAULT_TASKS)})")
    p.add_argument("--samples", type=count(1), default=2, help="samples per task (default 2)")
    p.add_argument("--tokens", type=count(64), default=512, help="context length target in tokens, >= 64 (default 512)")
    p.add_argument("--retentions", type=float_list, default=list(CALIBRATION_RETENTIONS),
                   help=f"fractions of the context kept, in (0, 1] (default {','.join(map(str, CALIBRATION_RETENTIONS))})")
    p.add_argument("--asymmetry", type=float, default=4.0, help="weight of residuals where the curve over-promises, from 1 to 1e6 (default 4)")
    p.add_argument("--seed", type=seed, default=0, help="first task seed and the method's seed")
    p.add_argument("--triples", type=user_path, default=None, help="also write the measured triples to this JSON file")
    p.add_argument("--out", type=user_path, required=True, help="where to write the calibration JSON")
    add_model_arg(p)
    add_device_args(p)
    add_threads_arg(p)
    p.set_defaults(func=_run)


def _run(args) -> int:
    from ..eval.calibration_samples import offline_samples
    from ..integration import calibrate
    from ..calibration import as_asymmetry
    from ..integration.calibrate_model import as_retentions, check_calibratable

    as_retentions(args.retentions)
    if len(args.tasks) * args.samples * len(args.retentions) < 2:
        raise ValueError(f"the fit needs at least 2 measurements: --tasks ({len(args.tasks)}) x --samples ({args.samples}) x "
                         f"--retentions ({len(args.retentions)}) give {len(args.tasks) * args.samples * len(args.retentions)}")
    if args.triples is not None and args.triples.resolve() == args.out.resolve():
        raise ValueError(f"--triples and --out name the same file {str(args.out)!r}; the triples would overwrite the calibration")
    check_calibratable(args.method)
    as_asymmetry(args.asymmetry)
    check_out_folder("--out", args.out)
    if args.triples is not None:
        check_out_folder("--triples", args.triples)
    set_threads(args.threads)
    model, tokenizer = load_cli_model(args)
    samples = offline_samples(tokenizer, args.tasks, args.samples, args.tokens, args.seed)
    triples: list[dict] = []

    def progress(t: dict) -> None:
        triples.append(t)
        print(f"sample {t['sample']} r={t['retention']:.2f}: NLL(c)={t['nll_context']:.3f} ratio={t['nll_ratio']:.3f}", flush=True)

    calibration = calibrate(model, tokenizer, samples, args.method, args.retentions, args.asymmetry, seed=args.seed,
                            model_name=args.model or "SmolLM2-135M-Instruct", progress=progress)
    if args.triples is not None:
        from ..saved_state import write_whole

        write_whole(args.triples, json.dumps(triples, indent=1) + "\n")
    calibration.save(args.out)
    print(f"alpha={calibration.alpha:.4f} beta={calibration.beta:.4f} (loss {calibration.loss:.4g}, {calibration.n_triples} triples) -> {args.out}")
    return 0
