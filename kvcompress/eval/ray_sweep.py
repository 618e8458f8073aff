"""Run a sweep's samples as Ray tasks; the driver alone writes the resumable results JSONL.

One Ray task is one sample with every cell of it still to do (`runner.run_sample`): its context
is prefilled once and every method and ratio answers from that prefill. A task holds 1 GPU when
the cluster has GPUs (the model moves there), else `cpus_per_task` CPUs (and as many torch
threads). Each worker process loads the model once per sweep (`load()`, any picklable callable
returning (model, tokenizer)) and keeps it for the sweep's later tasks.

Records reach the driver when their task finishes and are appended to `out_dir/results.jsonl`
as they arrive (`runner.ResultsFile`: a cell already in the file is never written twice). A
task whose worker crashes or is pre-empted is retried up to `max_retries` times by Ray; a task
that still fails leaves its cells unrecorded, so running the sweep again does exactly those.
Install with `pip install kvcompress[ray]`.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..checks import require_package
from .runner import SweepConfig, pending_samples, read_results, run_sample

# This worker process's model: {"sweep": id, "model": ..., "tokenizer": ...}.
_WORKER_MODEL: dict = {}


def _sample_task(load: Callable, sweep_id: str, config: SweepConfig, spec, cells, threads: int) -> list[dict]:
    """Body of one Ray task: every cell of one sample, on this worker's (cached) model."""
    import ray

    if _WORKER_MODEL.get("sweep") != sweep_id:
        _WORKER_MODEL.clear()
        model, tokenizer = load()
        if ray.get_gpu_ids():
            model = model.to("cuda")
        _WORKER_MODEL.update(sweep=sweep_id, model=model, tokenizer=tokenizer)
    if not ray.get_gpu_ids():
        torch.set_num_threads(threads)
    return list(run_sample(_WORKER_MODEL["model"], _WORKER_MODEL["tokenizer"], config, spec, cells))


def failure_reason(err: Exception) -> str:
    """One line saying why a task failed: the exception the task raised (a `RayTaskError`'s cause; Ray retries crashed
    workers, not a task's own errors), else Ray's error and its first line, without Ray's terminal colours."""
    cause = getattr(err, "cause", None)
    shown = cause if isinstance(cause, BaseException) else err
    lines = [line for line in re.sub(r"\x1b\[[0-9;]*m", "", str(shown)).splitlines() if line.strip()]
    return f"{type(shown).__name__}: {lines[0]}" if lines else type(shown).__name__


def run_sweep_ray(load: Callable, config: SweepConfig, out_dir: str | Path, address: str | None = None,
                  cpus_per_task: int = 1, max_retries: int = 3, progress: bool = True,
                  model_name: str = "", dtype: str | None = None) -> tuple[list[dict], list[str]]:
    """Run every cell not yet in `out_dir/results.jsonl` as Ray tasks, one per sample.

    address: a running cluster ("auto", "ray://host:10001", ...); None starts a local one (or
    joins the cluster Ray is already initialised with). Returns (every record of the file, one
    message per sample whose task failed: a crashed worker after its retries, an error the task raised at once).
    """
    ray = require_package("ray", "ray", "running a sweep as Ray tasks")
    from ray.exceptions import RayError

    if cpus_per_task < 1:
        raise ValueError(f"cpus_per_task must be >= 1, got {cpus_per_task}")
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries}")
    results, todo = pending_samples(config, out_dir, model_name=model_name, dtype=dtype)
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=progress)
    gpus = ray.cluster_resources().get("GPU", 0)
    resources = {"num_gpus": 1} if gpus else {"num_cpus": cpus_per_task}
    task = ray.remote(_sample_task).options(max_retries=max_retries, **resources)
    sweep_id = uuid.uuid4().hex
    load_ref, config_ref = ray.put(load), ray.put(config)
    running = {task.remote(load_ref, sweep_id, config_ref, spec, cells, cpus_per_task): (spec, cells) for spec, cells in todo}
    bar = tqdm(total=sum(len(cells) for _, cells in todo), desc="eval (ray)", unit="cell", disable=not progress)
    failures = []
    while running:
        finished, _ = ray.wait(list(running), num_returns=1)
        spec, cells = running.pop(finished[0])
        try:
            records = ray.get(finished[0])
        except RayError as err:
            failures.append(f"{spec.kind}|{spec.task}|{spec.length}|{spec.index}: {failure_reason(err)}")
            bar.write(f"failed, its {len(cells)} cells stay to do: {failures[-1]}")
            continue
        for record in records:
            if record["error"]:
                bar.write(f"[{record['key']}] {record['error']}")
        results.write(records)
        bar.update(len(cells))
    bar.close()
    return read_results(results.path), failures
