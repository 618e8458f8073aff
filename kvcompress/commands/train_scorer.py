"""`kvcompress train-scorer`: fit KVzap's surrogates (`methods.kvzap`) to the project's own KVzip scores on text the
standard library ships, and save them as a scorer file for `--method kvzap --param scorer=FILE`."""

from __future__ import annotations

import platform
import time
from pathlib import Path

from .common import add_device_args, add_model_arg, add_threads_arg, check_out_folder, count, load_cli_model, seed, set_threads, user_path


MLP_WIDTH, MLP_STEPS = 16, 300  # --kind mlp's defaults


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "train-scorer", help="fit KVzap's learned KVzip scores for a model (arXiv 2601.07891)",
        description="Compute KVzip's scores (a prefill and the reconstruction forwards) of training contexts made of "
        "standard-library docstrings (eval.capture.SCORER_TRAINING_MODULES, disjoint from every evaluation text), fit one "
        "surrogate per layer and KV head from each token's hidden state to its score, report the fit's Spearman "
        "correlation per layer on tuning contexts (the tuning prose, eval.capture.DOCSTRING_MODULES) and save it.",
    )
    p.add_argument("--kind", choices=("linear", "mlp"), default="linear", help="surrogate: ridge-regressed linear map or a "
                   "2-layer MLP (default linear)")
    p.add_argument("--tokens", type=count(16), default=2048, help="tokens per training context, >= 16: whole paragraphs up to at least that many, with the chat template around them (default 2048)")
    p.add_argument("--contexts", type=count(1), default=6, help="training contexts, >= 1 (default 6: the shipped scorer's; the "
                   "text holds 9 of the default 2048 tokens)")
    p.add_argument("--tuning-contexts", type=count(1), default=1, help="tuning contexts the fit is reported on (default 1)")
    p.add_argument("--mlp-width", type=count(1), default=None, help=f"hidden units per head of --kind mlp (default {MLP_WIDTH})")
    p.add_argument("--steps", type=count(1), default=None, help=f"Adam steps of --kind mlp (default {MLP_STEPS})")
    p.add_argument("--seed", type=seed, default=0, help="order of the training paragraphs and the MLP's initialisation")
    p.add_argument("--out", type=user_path, required=True, help="where to write the scorer (safetensors)")
    add_model_arg(p)
    add_device_args(p)
    add_threads_arg(p)
    p.set_defaults(func=_run)


def _run(args) -> int:
    from dataclasses import replace

    import torch

    from ..eval.capture import DOCSTRING_MODULES, SCORER_TRAINING_MODULES, docstring_paragraphs
    from ..integration.model import token_ids_sha256
    from ..integration.scorer_training import fidelity, scoring_pairs, text_contexts
    from ..methods.kvzap import fit_surrogate

    check_out_folder("--out", args.out)
    if args.kind == "linear" and (args.mlp_width is not None or args.steps is not None):
        given = " and ".join(flag for flag, value in (("--mlp-width", args.mlp_width), ("--steps", args.steps)) if value is not None)
        raise ValueError(f"{given} set{'s' if ' and ' not in given else ''} the MLP of --kind mlp; --kind linear (ridge regression) "
                         "takes neither --mlp-width nor --steps")
    mlp_width, steps = args.mlp_width or MLP_WIDTH, args.steps or MLP_STEPS
    set_threads(args.threads)
    start = time.perf_counter()
    model, tokenizer = load_cli_model(args)
    tuning_text = docstring_paragraphs(DOCSTRING_MODULES)
    held_apart = set(tuning_text)
    training_text = [p for p in docstring_paragraphs(SCORER_TRAINING_MODULES) if p not in held_apart]
    # every context is cut before any is scored: a count the text cannot fill is refused before the scoring's minutes
    training_contexts = text_contexts(tokenizer, training_text, args.tokens, args.contexts, args.seed)
    tuning_contexts = text_contexts(tokenizer, tuning_text, args.tokens, args.tuning_contexts, args.seed, "--tuning-contexts")
    train = scoring_pairs(model, tokenizer, training_contexts, progress=print)
    tuning = scoring_pairs(model, tokenizer, tuning_contexts)
    name = getattr(model.config, "_name_or_path", "") or ""
    surrogate = fit_surrogate(train.hidden, train.targets, args.kind, mlp_width=mlp_width, steps=steps, seed=args.seed,
                              model=Path(name).name if name else "")
    per_layer = {layer: sum(heads) / len(heads) for layer, heads in fidelity(surrogate, tuning).items()}
    seconds = time.perf_counter() - start
    meta = {"kind": args.kind, "seed": args.seed, "tokens_per_context": args.tokens, "contexts": args.contexts, "training_tokens": int(train.hidden[surrogate.layers[0]].shape[0]),
            "training_text": "eval.capture.SCORER_TRAINING_MODULES", "tuning_text": "eval.capture.DOCSTRING_MODULES",
            # the text is the running Python's docstrings: another Python trains on other tokens
            "python": platform.python_version(), "training_tokens_sha256": token_ids_sha256(*training_contexts),
            "tuning_tokens": int(tuning.hidden[surrogate.layers[0]].shape[0]),
            "tuning_spearman": {str(k): round(v, 4) for k, v in per_layer.items()}, "seconds": round(seconds, 1),
            "threads": torch.get_num_threads(), "mlp_width": mlp_width if args.kind == "mlp" else None,
            "steps": steps if args.kind == "mlp" else None}
    surrogate = replace(surrogate, meta=meta)
    surrogate.save(args.out)
    values = list(per_layer.values())
    print(f"{args.kind} surrogate of {len(values)} layers, Spearman on tuning text: mean {sum(values) / len(values):.3f}, "
          f"min {min(values):.3f}; {meta['training_tokens']} training tokens, {seconds:.0f} s on {meta['threads']} thread{'s' if meta['threads'] != 1 else ''} -> {args.out}")
    return 0
