"""Choose the hybrid's defaults (score, coreset, exact_fraction, sink/window) on training cases only.

Training cases, disjoint from the reported ones:
- tasks: needle (niah_single, filler) and line retrieval (one line in prose) at 2048 tokens,
  samples built with seeds TRAIN_SEED + i (the reported sweep uses seeds 0, 1, ...), answered at
  ratios 0.75 and 0.9 from one recorded prefill per sample, by every candidate hybrid and by the
  reference single methods on the same samples;
- attention error: the approximation bench's protocol (`eval.approx.layer_errors`: sink 256,
  window = the last 256 queries, the middle compressed) on prose with text_seed 1 (the reported
  bench uses text_seed 0), layers 1, 2, 5, 15, every candidate and BalanceKV at equal memory.

The rule: among the candidates whose mean attention error is no higher than BalanceKV's on the
training text, the highest mean task score over both tasks and ratios; ties go to the lower error.

Writes benchmarks/results/hybrid_tuning.{csv,md}.

    PYTHONPATH=. python benchmarks/tuning/hybrid_tuning.py [--samples 8] [--candidates NAME ...] [--threads 1]

Rows are appended to the CSV as they are produced and a rerun skips those already there, so a run
can be stopped and resumed (or extended with more samples or candidates). CANDIDATES also holds the
variants of the exploration that led to the default (docs/results.md, hybrid section), so each can
be re-measured here; APPROX_CANDIDATES holds the variants measured on the attention error only:

    PYTHONPATH=. python benchmarks/tuning/hybrid_tuning.py --approx-only --approx-seeds 10 --candidates NAME ... \
        --csv benchmarks/results/hybrid_tuning_approx.csv
"""

from __future__ import annotations

import argparse
import csv
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.cache import CompressedCache
from kvcompress.model_support import attention_scales
from kvcompress.options import CompressionOptions
from kvcompress.eval.approx import ApproxConfig, layer_errors
from kvcompress.eval.capture import capture_qkv, prose_text
from kvcompress.eval.runner import sample_depth
from kvcompress.eval.stats import sign_test, wilson
from kvcompress.eval.stopping import stop_token_ids
from kvcompress.eval.tasks import generate_sample, score
from kvcompress.integration.generation import generate_ids
from kvcompress.integration.model import build_prompt
from kvcompress.methods.base import compress_tokens, make_generator
from kvcompress.methods.budget import resolve_budget
from kvcompress.methods.registry import build_method
from kvcompress.methods.tokens import query_positions_for, Tokens

RESULTS = Path(__file__).parents[1] / "results"
TRAIN_SEED = 1000
TRAIN_TEXT_SEED = 1
TASKS = {"niah_single": {}, "line_retrieval": {"n_lines": 1, "haystack": "prose"}}
RATIOS = (0.75, 0.9)
APPROX_RATIOS = (0.75, 0.875, 0.9375)
APPROX_LAYERS = (1, 2, 5, 15)
APPROX_SEEDS = 2
# name: (method, parameters, sink/window of the task runs; None = the method's default). The
# approximation part always uses the bench's sink 256 + window 256.
REFERENCES = {"compactor": ("compactor", {}, None), "streamingllm": ("streamingllm", {}, None), "balancekv": ("balancekv", {}, None),
              "express": ("express", {}, None)}
APPROX_REFERENCES = ("balancekv", "express")  # references of the attention error only
LEVERAGE = {"attention": False}  # Compactor's leverage score alone (the Compactor paper's "no a" ablation)
CANDIDATES = {
    "tova .1 + leverage .3, express": ("hybrid", {"score": ["tova", "compactor"], "score_params": [{}, LEVERAGE],
                                                   "exact_fraction": [0.1, 0.3], "coreset": "express"}, (0, 0)),
    "tova .1 + leverage .3 in spans of 7, express": ("hybrid", {"score": ["tova", "compactor"], "score_params": [{}, LEVERAGE],
                                                                "exact_fraction": [0.1, 0.3], "span": [1, 7], "coreset": "express"}, (0, 0)),
    "tova .1 + leverage .3 in spans of 15, express": ("hybrid", {"score": ["tova", "compactor"], "score_params": [{}, LEVERAGE],
                                                                 "exact_fraction": [0.1, 0.3], "span": [1, 15], "coreset": "express"}, (0, 0)),
    "tova .1 + leverage .3 + recent .2, express": ("hybrid", {"score": ["tova", "compactor", "streamingllm"],
                                                               "score_params": [{}, LEVERAGE, {}],
                                                               "exact_fraction": [0.1, 0.3, 0.2], "coreset": "express"}, (0, 0)),
    "tova .1 + leverage .3 + recent .4, express": ("hybrid", {"score": ["tova", "compactor", "streamingllm"],
                                                               "score_params": [{}, LEVERAGE, {}],
                                                               "exact_fraction": [0.1, 0.3, 0.4], "coreset": "express"}, (0, 0)),
    "tova .1 + leverage .5, express": ("hybrid", {"score": ["tova", "compactor"], "score_params": [{}, LEVERAGE],
                                                   "exact_fraction": [0.1, 0.5], "coreset": "express"}, (0, 0)),
    "tova .1 + compactor .3, express": ("hybrid", {"score": ["tova", "compactor"], "exact_fraction": [0.1, 0.3],
                                                    "coreset": "express"}, (0, 0)),
    "tova .1 + keydiff .3, express": ("hybrid", {"score": ["tova", "keydiff"], "exact_fraction": [0.1, 0.3],
                                                  "coreset": "express"}, (0, 0)),
    "tova .1 + compactor .25, express": ("hybrid", {"score": ["tova", "compactor"], "exact_fraction": [0.1, 0.25],
                                                     "coreset": "express"}, None),
    "tova .25, express": ("hybrid", {"score": "tova", "score_params": None, "exact_fraction": 0.25, "coreset": "express"}, (0, 0)),
    "compactor .25, balancekv": ("hybrid", {"score": "compactor", "score_params": None, "exact_fraction": 0.25,
                                            "coreset": "balancekv"}, None),
    "keydiff .75, balancekv (last round)": ("hybrid", {"score": "keydiff", "score_params": None, "exact_fraction": 0.75,
                                                       "coreset": "balancekv"}, (4, 64)),
}


def _spans_candidate(first: str, fractions: tuple[float, float], span: int = 7, coreset: str = "express") -> tuple[str, tuple]:
    """(name, entry) of a hybrid: `first`'s top tokens, then the leverage score in spans, then a coreset."""
    name = f"{first} {fractions[0]:g} + leverage {fractions[1]:g} in spans of {span}, {coreset}".replace("0.", ".")
    return name, ("hybrid", {"score": [first, "compactor"], "score_params": [{}, LEVERAGE], "exact_fraction": list(fractions),
                             "span": [1, span], "coreset": coreset}, (0, 0))


# Variants of the default explored on the attention error alone (--approx-only; docs/results.md, hybrid section);
# named with --candidates, never run by default
APPROX_CANDIDATES = dict(_spans_candidate(*args) for args in [
    ("tova", (0.1, 0.3), 7, "balancekv"), ("tova", (0.1, 0.3), 3), ("tova", (0.1, 0.2)), ("tova", (0.05, 0.3)),
    ("tova", (0.15, 0.25)), ("tova", (0.2, 0.2)), ("tova", (0.2, 0.3)), ("snapkv", (0.1, 0.3)), ("h2o", (0.1, 0.3))])


class RowLog:
    """The tuning CSV, appended one row at a time, so an interrupted run resumes where it stopped."""

    FIELDS = ["part", "entry", "case", "sample", "ratio", "score", "error"]

    def __init__(self, path: Path):
        self.path = path
        self.rows = []
        if path.is_file():
            with path.open(newline="", encoding="utf-8") as f:
                for row in csv.DictReader(f):
                    row["ratio"] = float(row["ratio"])
                    row["sample"] = int(row["sample"]) if row["sample"] else ""
                    row["score"] = float(row["score"]) if row["score"] else ""
                    row["error"] = float(row["error"]) if row["error"] else ""
                    self.rows.append(row)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w", newline="", encoding="utf-8") as f:
                csv.DictWriter(f, fieldnames=self.FIELDS).writeheader()
        self.done = {(r["part"], r["entry"], r["case"], r["sample"], r["ratio"]) for r in self.rows}

    def has(self, part: str, entry: str, case: str, sample, ratio: float) -> bool:
        return (part, entry, case, sample, ratio) in self.done

    def add(self, row: dict) -> None:
        with self.path.open("a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, fieldnames=self.FIELDS).writerow(row)
        self.rows.append(row)
        self.done.add((row["part"], row["entry"], row["case"], row["sample"], row["ratio"]))


def run_tasks(model, tokenizer, entries: dict[str, tuple], samples: int, log: RowLog, tasks: list[str]) -> None:
    """Log one row per (entry, task, sample, ratio) not yet logged: the entry's task score on a training sample."""
    for i in range(samples):
        for task in tasks:
            params = TASKS[task]
            todo = [(ratio, name) for ratio in RATIOS for name in entries if not log.has("task", name, task, i, ratio)]
            if not todo:
                continue
            sample = generate_sample(task, target_tokens=2048, depth=sample_depth(i), seed=TRAIN_SEED + i, tokenizer=tokenizer, **params)
            context_ids, question_ids = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
            captured = capture_qkv(model, context_ids)
            stops = stop_token_ids(tokenizer, sample.stop)
            for ratio, name in todo:
                method, method_params, sink_window = entries[name]
                sink, window = sink_window or (None, None)
                res = generate_ids(model, context_ids, question_ids, method=method, compression_ratio=ratio, prefill=captured,
                                   max_new_tokens=sample.max_new_tokens, stop_token_ids=stops, sink=sink, window=window, **method_params)
                prediction = tokenizer.decode(res.token_ids, skip_special_tokens=True)
                log.add({"part": "task", "entry": name, "case": task, "sample": i, "ratio": ratio,
                         "score": score(sample, prediction), "error": ""})
                print(f"{task} sample {i} ratio {ratio} {name}: {log.rows[-1]['score']:g} ({prediction.strip()!r})", flush=True)


def run_approx(model, tokenizer, entries: dict[str, tuple], log: RowLog, seeds: int = APPROX_SEEDS) -> None:
    """Log one row per (entry, layer, ratio) not yet logged: mean attention error over `seeds` seeds on the training text."""
    todo = {n: e for n, e in entries.items() if not log.has("approx", n, f"layer {APPROX_LAYERS[-1]}", "", APPROX_RATIOS[-1])}
    if not todo:
        return
    config = ApproxConfig(methods=sorted({m for m, _, _ in todo.values()}), ratios=list(APPROX_RATIOS), layers=list(APPROX_LAYERS),
                          seeds=seeds, text_seed=TRAIN_TEXT_SEED)
    captured = capture_qkv(model, tokenizer, prose_text(n_chars=8 * config.tokens, seed=config.text_seed),
                           layers=config.layers, max_tokens=config.tokens)
    scales = attention_scales(model)
    for name, (method, params, _) in todo.items():
        unrotate = CompressedCache(model, CompressionOptions(method=method, method_params=params, mode="prefill", budget=1))
        for layer, (q, k, v) in captured.items():
            pre = unrotate.pre_rope_keys(k, torch.arange(k.shape[2]))
            errors = layer_errors(method, q, k, v, scales[layer], config, pre_rope_keys=pre, layer_idx=layer,
                                  num_layers=model.config.num_hidden_layers, **params)
            for ratio, errs in errors.items():
                log.add({"part": "approx", "entry": name, "case": f"layer {layer}", "sample": "", "ratio": ratio,
                         "score": "", "error": sum(errs) / len(errs)})
                print(f"layer {layer} ratio {ratio} {name}: {log.rows[-1]['error']:.4f}", flush=True)


def line_token_spans(tokenizer, context_ids: torch.Tensor, line: str) -> dict[str, list[int]]:
    """Token positions of the line in context_ids [1, n], by part: "name" ("line adj-noun:"),
    "register" (" REGISTER_CONTENT is <"), "number" (its digits), "close" (">.")."""
    pieces = [tokenizer.decode([t]) for t in context_ids[0].tolist()]
    ends = torch.tensor([len(p) for p in pieces]).cumsum(0).tolist()
    text = "".join(pieces)
    start = text.index(line)
    parts = {"name": line.index(":") + 1, "register": line.index("<") + 1, "number": line.index(">"), "close": len(line) + 1}
    spans, lo = {}, start
    for part, stop in parts.items():
        hi = start + stop
        spans[part] = [i for i, end in enumerate(ends) if end > lo and end - len(pieces[i]) < hi]
        lo = hi
    return spans


def kept_positions(model, captured: dict, entry: tuple, ratio: float) -> dict[str, torch.Tensor]:
    """{role: bool [layers, H_kv, n]}: the context tokens each layer/head holds, by role. A hybrid with
    sink = window = 0 (entry as in CANDIDATES): "first score" (its first score method's exact picks),
    "later scores" (the other exact picks), "coreset" (a weighted coreset slot stands at the token).
    A single method: "exact" (every slot it keeps, its default sink and window included)."""
    method_name, params, sink_window = entry
    method = build_method(method_name, **params)
    if method_name == "hybrid" and sink_window != (0, 0):
        raise ValueError(f"the diagnosis reads hybrids with sink = window = 0, got sink/window {sink_window}")
    sink, window = sink_window or (method.default_sink, method.default_window)
    unrotate = CompressedCache(model, CompressionOptions(method=method.name, mode="prefill", budget=1))
    scales = attention_scales(model)
    roles: dict[str, list[torch.Tensor]] = {}
    for layer, (q, k, v, *_) in sorted(captured.items()):
        n = k.shape[2]
        pos = torch.arange(n).expand(*k.shape[:2], n)
        tokens = Tokens(k, v, pos, q, unrotate.pre_rope_keys(k, pos[0, 0]), scales[layer], layer, len(captured),
                        query_positions_for(q, pos))
        budget = resolve_budget(n, None, ratio, sink, window)
        if method_name == "hybrid":
            counts, n_coreset = method.split_budget(budget)
            generator = make_generator(layer)
            exact, rest = method.top(tokens, counts, generator)
            first = method.top(tokens, [counts[0]] + [0] * (len(counts) - 1), make_generator(layer))[0].positions
            held = {"first score": first, "exact": exact.positions,
                    "coreset": method.coreset_method.compress(rest, n_coreset, generator).positions}
        else:
            held = {"exact": compress_tokens(method, tokens, budget, sink, window, make_generator(layer)).positions}
        for role, where in held.items():
            roles.setdefault(role, []).append(torch.zeros(n, dtype=torch.bool).expand(k.shape[1], n).clone().scatter_(1, where[0], True))
    out = {role: torch.stack(masks) for role, masks in roles.items()}
    if "first score" in out:
        out["later scores"] = out["exact"] & ~out["first score"]
    return out


DEFAULT = "tova .1 + leverage .3, express"  # Hybrid()'s composition before spans (the paired tables compare with it)
DIAGNOSED = ((DEFAULT, 0.75), ("tova .1 + leverage .3 in spans of 7, express", 0.75), ("compactor", 0.75),
             ("compactor", 0.5))


def diagnose_lines(model, tokenizer, samples: int, log: RowLog) -> list[str]:
    """Markdown: on the first `samples` training line samples, for each (entry, ratio) of DIAGNOSED,
    the share of (layer, KV head) pairs that hold each part of the asked line, by role, over all
    samples; then per sample its depth and whether each entry answered (from the logged task rows)."""
    entries = REFERENCES | CANDIDATES
    roles = ("first score", "later scores", "coreset", "exact")
    shares: dict[tuple, list[list[float]]] = {}
    answered = []
    for i in range(samples):
        sample = generate_sample("line_retrieval", target_tokens=2048, depth=sample_depth(i), seed=TRAIN_SEED + i, tokenizer=tokenizer,
                                 **TASKS["line_retrieval"])
        context_ids, _ = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
        spans = line_token_spans(tokenizer, context_ids, sample.needles[0])
        captured = capture_qkv(model, context_ids)
        cells = []
        for name, ratio in DIAGNOSED:
            held = kept_positions(model, captured, entries[name], ratio)
            for part, index in spans.items():
                whole = held["exact"][..., index]
                shares.setdefault((name, ratio, part), []).append(
                    [held[r][..., index].float().mean().item() if r in held else float("nan") for r in roles]
                    + [whole.all(-1).float().mean().item()])
            rows = [r["score"] for r in log.rows if (r["part"], r["entry"], r["case"], r["sample"], r["ratio"]) == ("task", name, "line_retrieval", i, ratio)]
            cells.append("yes" if rows == [1.0] else "no" if rows else "not run")
        answered.append(f"| {i} | {sample.depths[0]:.2f} | " + " | ".join(cells) + " |")
        print(answered[-1], flush=True)
    lines = ["| entry @ ratio | line part | " + " | ".join(roles) + " | whole part exact |", "|---|---|" + "---|" * (len(roles) + 1)]
    for (name, ratio, part), values in shares.items():
        means = [sum(col) / len(col) for col in zip(*values)]
        lines.append(f"| {name} @ {ratio:g} | {part} | " + " | ".join("" if m != m else f"{100 * m:.0f}" for m in means) + " |")
    head = ["| sample | depth | " + " | ".join(f"{name} @ {ratio:g}" for name, ratio in DIAGNOSED) + " |", "|---|---|" + "---|" * len(DIAGNOSED)]
    return lines + ["", "Answered (from the logged task rows):", ""] + head + answered


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarise(rows: list[dict], entries: list[str], candidates: list[str]) -> tuple[str | None, list[str]]:
    """(chosen candidate or None, Markdown lines): per entry the task score with its Wilson interval and the mean error."""
    task = {e: [r["score"] for r in rows if r["part"] == "task" and r["entry"] == e] for e in entries}
    error = {e: _mean([r["error"] for r in rows if r["part"] == "approx" and r["entry"] == e]) for e in entries}
    reference_error = error.get("balancekv", float("nan"))
    lines = ["| entry | task score % (95% Wilson) | n | mean attention error | error <= BalanceKV's |", "|---|---|---|---|---|"]
    for e in entries:
        eligible = "yes" if error[e] <= reference_error else "no"
        if task[e]:
            low, high = wilson(sum(task[e]), len(task[e]))
            score_cell = f"{100 * _mean(task[e]):.0f} ({100 * low:.0f}–{100 * high:.0f})"
        else:
            score_cell = "not run"
        lines.append(f"| {e} | {score_cell} | {len(task[e])} | {error[e]:.4f} | {eligible} |")
    ranked = [(-_mean(task[c]), error[c], c) for c in candidates if error[c] <= reference_error and task[c]]
    return (min(ranked)[2] if ranked else None), lines


def cell_table(rows: list[dict], entries: list[str]) -> list[str]:
    """Markdown: per entry, the task score per (task, ratio) and the error per (layer, ratio)."""
    task_cols = [(t, r) for t in TASKS for r in RATIOS]
    layer_cols = [(f"layer {layer}", r) for r in APPROX_RATIOS for layer in APPROX_LAYERS]
    head = [f"{t} {r:g}" for t, r in task_cols] + [f"L{c.split()[1]} {r:g}" for c, r in layer_cols]
    lines = ["| entry | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for e in entries:
        cells = []
        for t, r in task_cols:
            s = [row["score"] for row in rows if (row["part"], row["entry"], row["case"], row["ratio"]) == ("task", e, t, r)]
            cells.append(f"{100 * _mean(s):.0f} ({'–'.join(f'{100 * x:.0f}' for x in wilson(sum(s), len(s)))}), {len(s)}" if s else "")
        for c, r in layer_cols:
            s = [row["error"] for row in rows if (row["part"], row["entry"], row["case"], row["ratio"]) == ("approx", e, c, r)]
            cells.append(f"{_mean(s):.3f}" if s else "")
        lines.append(f"| {e} | " + " | ".join(cells) + " |")
    return lines


def paired_table(rows: list[dict], entries: list[str], base: str) -> list[str]:
    """Markdown: per (task, ratio), each entry against `base` on the samples both ran: wins / losses, sign-test p."""
    lines = ["| task @ ratio | entry | vs " + base + ": wins / losses (pairs) | sign test p |", "|---|---|---|---|"]
    for task in TASKS:
        for ratio in RATIOS:
            scores = {e: {r["sample"]: r["score"] for r in rows if (r["part"], r["entry"], r["case"], r["ratio"]) == ("task", e, task, ratio)}
                      for e in entries}
            for e in entries:
                common = sorted(set(scores[e]) & set(scores[base])) if e != base else []
                if common:
                    wins = sum(scores[e][i] > scores[base][i] for i in common)
                    losses = sum(scores[e][i] < scores[base][i] for i in common)
                    lines.append(f"| {task} @ {ratio:g} | {e} | {wins} / {losses} ({len(common)}) | {sign_test(wins, losses):.3g} |")
    return lines


def approx_table(rows: list[dict], entries: list[str], seeds: int) -> list[str]:
    """Markdown: each entry's training-text attention error per (layer, ratio) cell and its mean over the cells."""
    errors = {(r["entry"], r["case"], r["ratio"]): r["error"] for r in rows if r["part"] == "approx"}
    cells = [(f"layer {layer}", ratio) for layer in APPROX_LAYERS for ratio in APPROX_RATIOS]
    lines = [f"# Hybrid variants: attention error on the training text (text_seed {TRAIN_TEXT_SEED}, {seeds} seeds)", "",
             "| entry | mean | " + " | ".join(f"L{case.split()[1]} @ {ratio:g}" for case, ratio in cells) + " |",
             "|---|---|" + "---|" * len(cells)]
    for e in entries:
        values = [errors.get((e, case, ratio)) for case, ratio in cells]
        if all(v is not None for v in values):
            lines.append(f"| {e} | {sum(values) / len(values):.4f} | " + " | ".join(f"{v:.3f}" for v in values) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES | APPROX_CANDIDATES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS), help="task cases to run (the table reads every row)")
    parser.add_argument("--diagnose-lines", type=int, default=0, metavar="N",
                        help="only the line diagnosis on the first N training line samples (hybrid_tuning_lines.md)")
    parser.add_argument("--approx-only", action="store_true",
                        help="only the attention error, with --approx-seeds seeds, per cell into hybrid_tuning_approx.md (use its own --csv)")
    parser.add_argument("--approx-seeds", type=int, default=APPROX_SEEDS)
    parser.add_argument("--csv", type=Path, default=RESULTS / "hybrid_tuning.csv", help="rows so far (the run resumes from them)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvc.load_model()
    entries = REFERENCES | {name: (CANDIDATES | APPROX_CANDIDATES)[name] for name in args.candidates}
    start = time.perf_counter()
    log = RowLog(args.csv)
    if args.diagnose_lines:
        table = diagnose_lines(model, tokenizer, args.diagnose_lines, log)
        (RESULTS / "hybrid_tuning_lines.md").write_text("\n".join(table) + "\n", encoding="utf-8")
        return
    if args.approx_only:
        run_approx(model, tokenizer, entries, log, args.approx_seeds)
        table = approx_table(log.rows, list(entries), args.approx_seeds)
        (RESULTS / "hybrid_tuning_approx.md").write_text("\n".join(table) + "\n", encoding="utf-8")
        print("\n".join(table))
        return
    run_tasks(model, tokenizer, {n: e for n, e in entries.items() if n not in APPROX_REFERENCES}, args.samples, log, args.tasks)
    run_approx(model, tokenizer, entries, log)
    rows = [r for r in log.rows if r["entry"] in entries and (r["part"] == "approx" or r["sample"] < args.samples)]
    chosen, table = summarise(rows, list(entries), args.candidates)
    verdict = f"**Best by the rule: {chosen}** ({CANDIDATES[chosen][1]}, sink/window {CANDIDATES[chosen][2] or 'default'})" if chosen else "**No candidate has a mean error no higher than BalanceKV's.**"
    header = [
        "# Hybrid defaults, chosen on training cases",
        "",
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {args.threads} thread(s), shared 2-core CPU (other jobs running), "
        f"{time.perf_counter() - start:.0f} s in the last (resumed) run. Tasks: seeds {TRAIN_SEED}..{TRAIN_SEED + args.samples - 1} of "
        f"{', '.join(TASKS)} at 2048 tokens, ratios {', '.join(map(str, RATIOS))}, every entry on the same samples. Attention "
        f"error: text_seed {TRAIN_TEXT_SEED}, layers {', '.join(map(str, APPROX_LAYERS))}, middle ratios "
        f"{', '.join(map(str, APPROX_RATIOS))}, {APPROX_SEEDS} seeds, mean over layers, ratios and seeds.",
        "",
        "Rule: among the hybrids whose mean attention error is no higher than BalanceKV's, the highest task score; ties to the lower error.",
        "",
        verdict,
        "",
    ]
    text = header + table + ["", "Per cell (task score % (95% Wilson), n; attention error):", ""] + cell_table(rows, list(entries))
    if DEFAULT in entries:
        text += ["", "Paired with the hybrid without spans on the same samples:", ""] + paired_table(rows, list(entries), DEFAULT)
    (RESULTS / "hybrid_tuning.md").write_text("\n".join(text) + "\n", encoding="utf-8")
    print("\n".join(text))


if __name__ == "__main__":
    main()
