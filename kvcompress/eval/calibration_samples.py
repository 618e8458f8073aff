"""Calibration samples for `kvc.calibrate` drawn from the offline task set."""

from __future__ import annotations

from .tasks import generate_sample


def offline_samples(tokenizer, task_names, per_task: int, tokens: int, first_seed: int = 0) -> list[dict]:
    """{"task", "seed", "context", "question", "answer"} per task and seed (answers joined by ", ")."""
    out = []
    for task in task_names:
        for seed in range(first_seed, first_seed + per_task):
            s = generate_sample(task, target_tokens=tokens, seed=seed, tokenizer=tokenizer)
            out.append({"task": task, "seed": seed, "context": s.context, "question": s.question, "answer": ", ".join(s.answers)})
    return out
