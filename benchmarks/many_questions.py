"""Many questions about one context: the context is prefilled and compressed once, not per question.

On the default model (SmolLM2-135M-Instruct, float32), one context of real prose (about 4k tokens
of chat prompt) and 8 questions, greedy answers of exactly --max-new-tokens tokens (no stop at
end-of-sequence, so every decode does the same work):
- single: the first and the last question alone (run first and last), each through
  `answer_questions_ids(context, [q])`, which times the context prefill + compression (prefill_s)
  apart from the question forward + decode (decode_s);
  reference = one prefill (mean prefill_s) + 8 decodes (8 x mean decode_s); independent = 8 x
  (prefill_s + decode_s), what re-prefilling and re-compressing per question would cost;
- questions: `kvc.generate(model, tokenizer, context, questions=[8 questions])`, wall clock;
- pipeline: the `kvcompress-text-generation` pipeline with the same 8 questions, wall clock.
The answers must agree where both exist (same cache, same greedy decoding). Target: questions and
pipeline take at most 1.3x the reference. Writes --out, by default benchmarks/results/many_questions.csv, and the
table beside it (.md).

    python benchmarks/many_questions.py [--tokens 4096] [--method snapkv] [--ratio 0.5] [--threads 1]
        [--out benchmarks/results/many_questions.csv]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from pathlib import Path

import torch
from transformers import pipeline

import kvcompress as kvc
from kvcompress.commands.common import csv_path
from kvcompress.eval.capture import prose_text
from kvcompress.eval.tables import write_csv
from kvcompress.integration import PIPELINE_TASK, answer_questions_ids, build_prompt

RESULTS = Path(__file__).parent / "results"
QUESTIONS = [
    "What is the main subject of this text?",
    "Summarise the first paragraph in one sentence.",
    "Which people are mentioned?",
    "What happens at the end?",
    "Name one place mentioned in the text.",
    "What is the tone of the text?",
    "Give a title for this text.",
    "Which year or date is mentioned, if any?",
]


def context_of(tokenizer, n_tokens: int) -> str:
    """Real prose cut at a paragraph boundary so the chat prompt's context part has at most n_tokens tokens."""
    paragraphs = prose_text(8 * n_tokens, seed=0).split("\n\n")
    text = ""
    for p in paragraphs:
        candidate = text + ("\n\n" if text else "") + p
        if build_prompt(tokenizer, candidate)[0].shape[1] > n_tokens:
            break
        text = candidate
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--method", default="snapkv")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=csv_path, default=RESULTS / "many_questions.csv",
                        help="the CSV of the runs; the page is written beside it as .md (default benchmarks/results/many_questions.csv)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvc.load_model()
    context = context_of(tokenizer, args.tokens)
    options = dict(method=args.method, compression_ratio=args.ratio, max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    context_ids, _ = build_prompt(tokenizer, context, QUESTIONS[0])
    questions_ids = [build_prompt(tokenizer, context, q)[1] for q in QUESTIONS]

    answer_questions_ids(model, context_ids[:, :256], questions_ids[:1], **options)  # warm-up
    pipe = pipeline(PIPELINE_TASK, model=model, tokenizer=tokenizer)

    def timed(run):
        """(result, wall seconds, this process's CPU seconds): CPU time is less sensitive to the other jobs."""
        wall, cpu = time.perf_counter(), time.process_time()
        out = run()
        return out, time.perf_counter() - wall, time.process_time() - cpu

    # Runs alone at both ends, so the reference sees the machine's load before and after the others.
    first, _, first_cpu = timed(lambda: answer_questions_ids(model, context_ids, questions_ids[:1], **options)[0])
    many, questions_s, questions_cpu = timed(lambda: kvc.generate(model, tokenizer, context, questions=QUESTIONS, progress=False, **options))
    piped, pipeline_s, pipeline_cpu = timed(lambda: pipe(context, questions=QUESTIONS, **options))
    last, _, last_cpu = timed(lambda: answer_questions_ids(model, context_ids, questions_ids[-1:], **options)[0])
    single = [first, last]
    single_cpu = (first_cpu + last_cpu) / 2
    prefill = sum(r.prefill_seconds for r in single) / len(single)
    decode = sum(r.decode_seconds for r in single) / len(single)
    reference = prefill + len(QUESTIONS) * decode
    independent = len(QUESTIONS) * (prefill + decode)

    single_answers = [r.token_ids for r in single]
    many_answers = [r.token_ids for r in many]
    agree = many_answers == [r.token_ids for r in piped["results"]] and single_answers == [many_answers[0], many_answers[-1]]
    rows = [
        {"run": f"reference: one prefill + {len(QUESTIONS)} decodes", "seconds": reference, "ratio_to_reference": 1.0, "cpu_seconds": ""},
        {"run": "one question alone (mean of 2)", "seconds": prefill + decode, "ratio_to_reference": (prefill + decode) / reference, "cpu_seconds": single_cpu},
        {"run": f"{len(QUESTIONS)} x (prefill + decode), re-compressing per question", "seconds": independent, "ratio_to_reference": independent / reference, "cpu_seconds": len(QUESTIONS) * single_cpu},
        {"run": f"kvc.generate(questions=[{len(QUESTIONS)}])", "seconds": questions_s, "ratio_to_reference": questions_s / reference, "cpu_seconds": questions_cpu},
        {"run": f"pipeline {PIPELINE_TASK!r}", "seconds": pipeline_s, "ratio_to_reference": pipeline_s / reference, "cpu_seconds": pipeline_cpu},
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(args.out, rows)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Many questions about one context",
        "",
        f"Default model (SmolLM2-135M-Instruct, float32), {context_ids.shape[1]}-token context, {len(QUESTIONS)} questions, "
        f"method {args.method} at compression_ratio {args.ratio}, {args.max_new_tokens} new tokens per answer "
        f"(mean {sum(len(a) for a in many_answers) / len(many_answers):.1f}).",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other jobs (noisy), torch threads {args.threads}, {when}. "
        f"One run, all timings in the same process; the two questions run alone come first and last. "
        f"CPU seconds (this process, {torch.get_num_threads()} torch thread(s)) are less sensitive to the other jobs than wall seconds.",
        f"From {len(single)} questions run alone: context prefill + compression {prefill:.2f} s "
        f"(compression {single[0].compress_seconds:.2f} s), question forward + decode {decode:.2f} s.",
        f"Answers identical across the three ways: {agree}.",
        "",
        "| run | wall seconds | wall / reference | CPU seconds |",
        "|---|---:|---:|---:|",
        *[f"| {r['run']} | {r['seconds']:.2f} | {r['ratio_to_reference']:.2f} | {r['cpu_seconds'] if r['cpu_seconds'] == '' else format(r['cpu_seconds'], '.1f')} |" for r in rows],
        "",
    ]
    args.out.with_suffix(".md").write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
