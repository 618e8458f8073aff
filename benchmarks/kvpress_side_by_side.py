"""Side by side with kvpress: the same prompt tokens, greedy decoding, stop rules and scorer in both libraries.

kvpress pins transformers < 5.3 and kvcompress >= 5.23, so the two never share a virtual environment.
The harness is four steps with one file format between them (JSONL under one output folder):

1. `dump` (kvcompress's venv): the samples, built exactly as `kvcompress eval` builds them
   (`eval.runner.SampleSpec` -> `eval.tasks` generator -> `integration.build_prompt`), written as token
   ids: context ids (chat-template head + context: what gets compressed) and question ids ("\\n\\n" +
   question, end of the user turn, assistant header, answer prefix: appended exactly after), the
   expected answers, the answer limit and the stop token ids. `manifest.json` records the checkpoint
   (the dequantised default model under ~/.cache/kvcompress) with the SHA-256 of its weights and
   tokenizer, the end-of-sequence ids and the sample settings.
2. `kvcompress` (kvcompress's venv): `integration.generate_ids` in prefill mode at each compression
   ratio, question kept out of compression, greedy, up to the sample's `max_new_tokens`, stopping
   after EOS or a stop token that follows another token (the eval's own rules, `kvcompress/decoding.py`). The full cache is a plain `DynamicCache`
   (`method=None`); each method compresses one recorded full prefill of the context (`capture_qkv`,
   as the eval does: the prefill is exact before compression, so this equals a fresh prefill per
   method); KVzip-scored cells share one recorded reconstruction of the context
   (`reconstruction.shared_reconstruction`), whose forwards count in each one's prefill time.
3. `kvpress` (kvpress's venv, kvpress 0.5.5 + transformers 5.2): the same checkpoint loaded with
   transformers, and per press and ratio kvpress's own pipeline protocol (`KVPressTextGenerationPipeline
   ._forward` / `generate_answer`): a `DynamicCache`, `with press(model): model.model(input_ids=context_ids,
   past_key_values=cache)`, then the question ids at their original positions, then greedy decoding one
   token at a time. The only departures: our token ids are fed (nothing is re-tokenised), and decoding
   also stops where the eval's does (`kvcompress/decoding.py`, loaded by path: EOS, or a stop token after
   another token; kvpress's pipeline stops only at EOS and never checks its first token). By default (`--protocol shared`) one prefill
   serves the full cache and every press that compresses through `BasePress.forward_hook`
   (`shared_prefill_answers`: the same `compress` calls on the same inputs); `--protocol pipeline`
   prefills once per press, and the `protocol-check` step compares the two runs token for token
   (`device-check` does the same for kvcompress's answers rerun on another device, `--device cuda`).
4. `compare` (kvcompress's venv): every prediction re-decoded from its token ids with the checkpoint's
   tokenizer and re-scored with `kvcompress.eval.tasks.score`; per cell the score with its 95% Wilson
   interval; paired comparisons on the same samples (kvcompress method vs its kvpress counterpart, and
   every cell vs its own library's full cache): the difference of the two proportions with Newcombe's
   95% square-and-add interval for paired data, wins/losses, the exact sign test
   (`eval.stats.paired_comparisons`), and how many answers are token-for-token identical.
5. `table` (kvcompress's venv): one overview over several output folders (one per context length):
   every cell's score at every length and ratio, and kvcompress's default against kvpress's best press
   at each length and ratio (paired, with the share of the full cache's hits the default keeps). It
   reads the recorded scores, which `compare` checks.

Both halves write one JSON record per (cell, sample) as it finishes, and skip what their output files
already hold (committed folders keep them merged and gzip-compressed, `<library>.jsonl.gz`, and the dump's
`samples.jsonl.gz`: every step reads those too), so an interrupted run continues. `--sample-indices` answers only the samples of the indices named,
`--full-cache-hits` only those kvcompress's full cache answered right (recorded there already: what a held-out set's
share of hits kept needs), and `--shard I/N` splits the samples among processes (each writes its own file; `compare` reads them all). Commands (docs/kvpress.md):

    .venv/bin/python benchmarks/kvpress_side_by_side.py dump --out results/kvpress_side_by_side
    .venv/bin/python benchmarks/kvpress_side_by_side.py kvcompress --out results/kvpress_side_by_side
    /work/kvpress-venv/bin/python benchmarks/kvpress_side_by_side.py kvpress --out results/kvpress_side_by_side
    .venv/bin/python benchmarks/kvpress_side_by_side.py compare --out results/kvpress_side_by_side
    .venv/bin/python benchmarks/kvpress_side_by_side.py table --folders results/kvpress_side_by_side results/kvpress_side_by_side_4k \
        --table OUT.md                      # docs/results.md holds these overviews, written by benchmarks/report.py
    .venv/bin/python benchmarks/kvpress_side_by_side.py protocol-check --out results/kvpress_side_by_side \
        --pipeline results/kvpress_side_by_side/protocol_check      # after a `kvpress --protocol pipeline` rerun there
    .venv/bin/python benchmarks/kvpress_side_by_side.py device-check --out results/kvpress_side_by_side_prose_8k \
        --rerun results/cuda_h200/refit_prose_8k                    # after a `kvcompress --device cuda` rerun there

This file imports nothing of kvcompress at module level and nothing of kvpress anywhere but the
`kvpress` step, so each half runs in its own venv. The `kvpress` step scores with kvcompress's own
`eval/tasks.py`, loaded by path (it needs only the standard library).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import importlib.util
import json
import math
import os
import platform
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "results" / "kvpress_side_by_side"
SAMPLES_FILE = "samples.jsonl"
MANIFEST_FILE = "manifest.json"
FULL = "full"

# kvcompress cells: label -> (method, method parameters). The defaults are each method's paper
# defaults as kvcompress ships them; the "[...]" variants set kvpress's parameters where the two
# libraries implement the same scoring, to tell an implementation difference from a default.
KVCOMPRESS_CELLS: dict[str, tuple[str | None, dict]] = {
    FULL: (None, {}),
    "keydiff": ("keydiff", {}),
    "knorm": ("knorm", {}),
    "knorm[sink=0,window=0]": ("knorm", {"sink": 0, "window": 0}),
    "snapkv": ("snapkv", {}),
    "snapkv[window=64,pool=5,sink=0]": ("snapkv", {"sink": 0, "window": 64, "observation_window": 64, "kernel_size": 5}),
    "expected_attention": ("expected_attention", {}),
    "compactor": ("compactor", {}),
    "kvzip": ("kvzip", {}),
    "adakv": ("adakv", {}),
    "adakv[scorer=expected_attention]": ("adakv", {"scorer": "expected_attention"}),
    "hybrid": ("hybrid", {}),
    "adakv[scorer=kvzip]": ("adakv", {"scorer": "kvzip"}),
    "adakv[scorer=kvzip,scope=model]": ("adakv", {"scorer": "kvzip", "scope": "model"}),
    "adakv[scorer=kvzip,scope=model,alpha=0]": ("adakv", {"scorer": "kvzip", "scope": "model", "alpha_safeguard": 0.0}),
    "adakv[scorer=kvzip,scope=model,window=0]": ("adakv", {"scorer": "kvzip", "scope": "model", "window": 0}),
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0]": ("adakv", {"scorer": "kvzip", "scope": "model", "window": 0,
                                                                   "alpha_safeguard": 0.0}),
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05]": ("adakv", {"scorer": "kvzip", "scope": "model", "window": 0,
                                                                      "alpha_safeguard": 0.05}),
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.1]": ("adakv", {"scorer": "kvzip", "scope": "model", "window": 0,
                                                                     "alpha_safeguard": 0.1}),
    # AdaKV over KVzip's scores (scope model, window 0) with its scores max-pooled over 3 or 5 neighbouring tokens (AdaKV's `span`): kept phrases stay whole
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,span=3]": ("adakv", {"scorer": "kvzip", "scope": "model", "window": 0,
                                                                             "alpha_safeguard": 0.05, "span": 3}),
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,span=5]": ("adakv", {"scorer": "kvzip", "scope": "model", "window": 0,
                                                                             "alpha_safeguard": 0.05, "span": 5}),
    # AdaKV over KVzip's scores (scope model, window 0) with each token's score weighed by its value's l1 norm (KVzip's `value_norm`): absolute, or over its head's mean
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,value_norm=absolute]": (
        "adakv", {"scorer": "kvzip", "scope": "model", "window": 0, "alpha_safeguard": 0.05,
                  "scorer_params": {"value_norm": "absolute"}}),
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,value_norm=relative]": (
        "adakv", {"scorer": "kvzip", "scope": "model", "window": 0, "alpha_safeguard": 0.05,
                  "scorer_params": {"value_norm": "relative"}}),
    # AdaKV over KVzip's scores (scope model, window 0) with each head's evicted tokens summarised in 1 or 8 weighted slots (AdaKV's `evicted_slots`)
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,evicted_slots=1]": (
        "adakv", {"scorer": "kvzip", "scope": "model", "window": 0, "alpha_safeguard": 0.05, "evicted_slots": 1}),
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,evicted_slots=8]": (
        "adakv", {"scorer": "kvzip", "scope": "model", "window": 0, "alpha_safeguard": 0.05, "evicted_slots": 8}),
    # AdaKV over KVzip's scores with its kept slots refitted to the reconstruction's attention (AdaKV's `refit`; kvzip_refit)
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,refit=log_weights]": (
        "adakv", {"scorer": "kvzip", "scope": "model", "window": 0, "alpha_safeguard": 0.05, "refit": "log_weights"}),
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,refit=log_weights_values]": (
        "adakv", {"scorer": "kvzip", "scope": "model", "window": 0, "alpha_safeguard": 0.05, "refit": "log_weights_values"}),
    # KVzap's learned KVzip scores shared by AdaKV over every layer's heads, at full precision
    "adakv[scorer=kvzap,scope=model,alpha=0.05]": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05}),
    # the same quantized, the ratio read as memory: bits picked from the bytes it leaves (the library's default in prefill
    # mode: 8 bits where they hold half the context, else 4), and 4 bits throughout
    "adakv[scorer=kvzap,scope=model,alpha=0.05,kv_bits=auto,budget_unit=memory]": (
        "adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05, "kv_bits": "auto", "budget_unit": "memory"}),
    "adakv[scorer=kvzap,scope=model,alpha=0.05,kv_bits=4,budget_unit=memory]": (
        "adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05, "kv_bits": 4, "budget_unit": "memory"}),
    # the streams at full precision: the same, each layer's stream taking its learned share of the model's budget,
    # re-compressed at slack 0.1
    "adakv[scorer=kvzap,scope=model,alpha=0.05,slack=0.1,mode=chunked]": (
        "adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05, "slack": 0.1, "mode": "chunked"}),
    "adakv[scorer=kvzap,scope=model,alpha=0.05,slack=0.1,mode=decode]": (
        "adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05, "slack": 0.1, "mode": "decode"}),
    # the same streams with each slot stored in 8 bits as it enters, the ratio read as memory (the library's default in
    # chunked and decode modes)
    "adakv[scorer=kvzap,scope=model,alpha=0.05,slack=0.1,kv_bits=8,budget_unit=memory,mode=chunked]": (
        "adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05, "slack": 0.1, "kv_bits": 8, "budget_unit": "memory",
                  "mode": "chunked"}),
    "adakv[scorer=kvzap,scope=model,alpha=0.05,slack=0.1,kv_bits=8,budget_unit=memory,mode=decode]": (
        "adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05, "slack": 0.1, "kv_bits": 8, "budget_unit": "memory",
                  "mode": "decode"}),
    # KVzip's chunked scoring as its paper (and kvpress) does it: each reconstruction chunk scores only the tokens it repeats
    "kvzip[scoring=chunk]": ("kvzip", {"scoring": "chunk"}),
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0,scoring=chunk]": (
        "adakv", {"scorer": "kvzip", "scope": "model", "window": 0, "alpha_safeguard": 0.0, "scorer_params": {"scoring": "chunk"}}),
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,scoring=chunk]": (
        "adakv", {"scorer": "kvzip", "scope": "model", "window": 0, "alpha_safeguard": 0.05, "scorer_params": {"scoring": "chunk"}}),
    # the context streamed through the method in blocks (chunked mode): candidates for the streaming modes' default
    "snapkv[mode=chunked]": ("snapkv", {"mode": "chunked"}),
    "keydiff[mode=chunked]": ("keydiff", {"mode": "chunked"}),
    "compactor[mode=chunked]": ("compactor", {"mode": "chunked"}),
    "hybrid[mode=chunked]": ("hybrid", {"mode": "chunked"}),
    "adakv[scorer=keydiff,mode=chunked]": ("adakv", {"scorer": "keydiff", "mode": "chunked"}),
}
DEFAULT_KVCOMPRESS = [FULL, "keydiff", "knorm", "knorm[sink=0,window=0]", "snapkv", "snapkv[window=64,pool=5,sink=0]",
                      "expected_attention", "compactor", "kvzip", "adakv", "adakv[scorer=expected_attention]", "hybrid",
                      "adakv[scorer=kvzip]"]
# kvcompress's default method in prefill mode (`options.DEFAULT_METHODS["prefill"]`), as a cell
DEFAULT_CELL = "adakv[scorer=kvzap,scope=model,alpha=0.05,kv_bits=auto,budget_unit=memory]"
# the prefill default before KVzap, by name `kvzip_refit` (`options.NAMED_SETTINGS`), as a cell
KVZIP_REFIT_CELL = "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,refit=log_weights_values]"

# kvpress cells: label -> (press class, its keyword arguments, an inner press for wrappers); all at
# kvpress 0.5.5's defaults.
KVPRESS_CELLS: dict[str, tuple[str | None, dict, str | None]] = {
    FULL: (None, {}, None),
    "KVzip": ("KVzipPress", {}, None),
    "AdaKV(ExpectedAttention)": ("AdaKVPress", {}, "ExpectedAttentionPress"),
    "ExpectedAttention": ("ExpectedAttentionPress", {}, None),
    "Compactor": ("CompactorPress", {}, None),
    "KeyDiff": ("KeyDiffPress", {}, None),
    "Knorm": ("KnormPress", {}, None),
    "SnapKV": ("SnapKVPress", {}, None),
}
DEFAULT_KVPRESS = [FULL, "KeyDiff", "Knorm", "SnapKV", "AdaKV(ExpectedAttention)", "ExpectedAttention", "Compactor", "KVzip"]

# kvcompress cell -> its kvpress counterpart: the same method, or the nearest (Ada-SnapKV: SnapKV's scores under one
# budget per head; the hybrid has none, so kvpress's best press here, KVzip).
COUNTERPARTS: dict[str, str] = {
    FULL: FULL,
    "keydiff": "KeyDiff",
    "knorm": "Knorm",
    "knorm[sink=0,window=0]": "Knorm",
    "snapkv": "SnapKV",
    "snapkv[window=64,pool=5,sink=0]": "SnapKV",
    "expected_attention": "ExpectedAttention",
    "compactor": "Compactor",
    "kvzip": "KVzip",
    "adakv": "SnapKV",
    "adakv[scorer=expected_attention]": "AdaKV(ExpectedAttention)",
    "hybrid": "KVzip",
    "adakv[scorer=kvzip]": "KVzip",
    "adakv[scorer=kvzip,scope=model]": "KVzip",
    "adakv[scorer=kvzip,scope=model,alpha=0]": "KVzip",
    "adakv[scorer=kvzip,scope=model,window=0]": "KVzip",
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0]": "KVzip",
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05]": "KVzip",
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.1]": "KVzip",
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,span=3]": "KVzip",
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,span=5]": "KVzip",
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,value_norm=absolute]": "KVzip",
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,value_norm=relative]": "KVzip",
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,evicted_slots=1]": "KVzip",
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,evicted_slots=8]": "KVzip",
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,refit=log_weights]": "KVzip",
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,refit=log_weights_values]": "KVzip",
    "adakv[scorer=kvzap,scope=model,alpha=0.05]": "KVzip",
    "adakv[scorer=kvzap,scope=model,alpha=0.05,kv_bits=auto,budget_unit=memory]": "KVzip",
    "adakv[scorer=kvzap,scope=model,alpha=0.05,kv_bits=4,budget_unit=memory]": "KVzip",
    "adakv[scorer=kvzap,scope=model,alpha=0.05,slack=0.1,mode=chunked]": "KVzip",
    "adakv[scorer=kvzap,scope=model,alpha=0.05,slack=0.1,mode=decode]": "KVzip",
    "adakv[scorer=kvzap,scope=model,alpha=0.05,slack=0.1,kv_bits=8,budget_unit=memory,mode=chunked]": "KVzip",
    "adakv[scorer=kvzap,scope=model,alpha=0.05,slack=0.1,kv_bits=8,budget_unit=memory,mode=decode]": "KVzip",
    "kvzip[scoring=chunk]": "KVzip",
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0,scoring=chunk]": "KVzip",
    "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05,scoring=chunk]": "KVzip",
    "snapkv[mode=chunked]": "SnapKV",
    "keydiff[mode=chunked]": "KeyDiff",
    "compactor[mode=chunked]": "Compactor",
    "hybrid[mode=chunked]": "KVzip",
    "adakv[scorer=keydiff,mode=chunked]": "KeyDiff",
}
# kvcompress cell -> more kvpress cells worth pairing with: AdaKV's head-wise budget of the same score, and
# kvpress's KVzip (its best press here) against kvcompress's query-agnostic and composed methods.
EXTRA_COUNTERPARTS: dict[str, list[str]] = {"expected_attention": ["AdaKV(ExpectedAttention)"], "compactor": ["KVzip"],
                                            "adakv": ["AdaKV(ExpectedAttention)", "KVzip"]}


# ---------------------------------------------------------------- file format, shared by both venvs


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSONL file, or of its gzip-compressed copy (`.jsonl.gz`: committed records are kept compressed);
    a last line torn by an interruption (no newline after it) is ignored."""
    if not path.is_file():
        return []
    text = (gzip.decompress(path.read_bytes()).decode("utf-8") if path.suffix == ".gz" else path.read_text(encoding="utf-8"))
    lines = text.split("\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def append_jsonl(path: Path, record: dict) -> None:
    """Append one record as one line, flushed (a torn last line is cut off first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+b") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size:
            f.seek(max(0, size - 1))
            if f.read(1) != b"\n":  # a torn line from an interrupted writer: cut it off
                f.seek(0)
                whole = f.read().rfind(b"\n") + 1
                f.truncate(whole)
        f.write((json.dumps(record) + "\n").encode("utf-8"))
        f.flush()


def prompt_digest(context_ids: list[int], question_ids: list[int]) -> str:
    """A short hash of the exact prompt tokens (context | question): both halves record the one they fed."""
    h = hashlib.sha256()
    h.update(json.dumps([list(map(int, context_ids)), list(map(int, question_ids))]).encode())
    return h.hexdigest()[:16]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_digest(checkpoint: Path) -> dict[str, str]:
    """SHA-256 of the checkpoint's weights and tokenizer: both halves must load the same files."""
    return {name: file_sha256(checkpoint / name) for name in ("model.safetensors", "tokenizer.json")}


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """'I/N' -> (I, N) with 0 <= I < N; None -> None."""
    if text is None:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise SystemExit(f"--shard must be I/N, e.g. 0/2, got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise SystemExit(f"--shard must be I/N with 0 <= I < N, got {text!r}")
    return i, n


def parse_ratios(text: str) -> list[float]:
    """argparse type of --ratios: '0.5,0.75' -> [0.5, 0.75], each a compression ratio (the fraction of tokens removed) in
    [0, 1)."""
    try:
        ratios = [float(r) for r in text.split(",")]
    except ValueError:
        ratios = []
    bad = [r for r in ratios if not 0 <= r < 1]
    if not ratios or bad:
        raise argparse.ArgumentTypeError(f"expected comma-separated compression ratios (the fraction of tokens removed), each in "
                                         f"[0, 1), got {text!r}")
    return ratios


def parse_list(text: str, known: dict) -> list[str]:
    """Comma-separated cell labels, each checked against `known` (labels hold commas only inside [...])."""
    labels, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            labels.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        labels.append(cur.strip())
    bad = [x for x in labels if x not in known]
    if bad:
        raise SystemExit(f"unknown cells {bad}; known: {sorted(known)}")
    return labels


def trim_at_stop(tokens: list[int], stop: tuple[set[int], set[int]]) -> list[int]:
    """The answer as the eval keeps it (`answer_end`: up to and including its first EOS, or its first stop token after
    another token; the stop token is kept, then decoded away or scored). stop: (EOS ids, stop ids), `stop_ids_of`."""
    return tokens[: answer_end(tokens, *stop) or len(tokens)]


def load_standalone(relative: str):
    """A kvcompress module that needs the standard library only, loaded by path without importing kvcompress."""
    spec = importlib.util.spec_from_file_location(f"_kvcompress_standalone_{Path(relative).stem}", REPO / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def load_task_scorer():
    """kvcompress's `eval/tasks.py` (`load_standalone`)."""
    return load_standalone("kvcompress/eval/tasks.py")


def answer_end(tokens: list[int], eos_ids, stop_ids) -> int | None:
    """kvcompress's `decoding.answer_end` (`load_standalone`): how many tokens the answer keeps, None while it goes on."""
    if "_kvcompress_standalone_decoding" not in sys.modules:
        load_standalone("kvcompress/decoding.py")
    return sys.modules["_kvcompress_standalone_decoding"].answer_end(tokens, eos_ids, stop_ids)


def score_prediction(tasks_module, sample: dict, prediction: str) -> float:
    """The task's own score (`eval.tasks.score`) of a prediction for a dumped sample."""
    return float(tasks_module.score(SimpleNamespace(task=sample["task"], answers=sample["answers"]), prediction))


def parse_sample_indices(text: str | None) -> set[int] | None:
    """'3,7,12' -> {3, 7, 12} (sample indices); None -> None (every sample)."""
    if text is None:
        return None
    try:
        return {int(x) for x in text.split(",")}
    except ValueError:
        raise SystemExit(f"--sample-indices must be comma-separated sample indices, e.g. 2,4,7, got {text!r}") from None


def select_samples(samples: list[dict], indices: set[int] | None, shard: tuple[int, int] | None) -> list[dict]:
    """The samples whose index is among `indices` (all when None), then this shard's share of them."""
    if indices is not None:
        known = {sample["index"] for sample in samples}
        if not indices <= known:
            raise SystemExit(f"--sample-indices names indices {sorted(indices - known)} that no dumped sample has; known: {sorted(known)}")
        samples = [sample for sample in samples if sample["index"] in indices]
    return samples if shard is None else samples[shard[0]::shard[1]]


def full_cache_hits(out: Path, samples: list[dict]) -> set[int]:
    """The indices of the samples kvcompress's full cache answered right (its recorded score > 0) in `out`; SystemExit
    naming the samples it has not answered yet (a hit set read before it is complete would skip needles unseen)."""
    scores = {r["sample"]: r["score"] for r in read_records(out)
              if r["library"] == "kvcompress" and r["cell"] == FULL and r.get("error") is None}
    missing = [sample["id"] for sample in samples if sample["id"] not in scores]
    if missing:
        raise SystemExit(f"--full-cache-hits needs kvcompress's full cache's answer to every sample in {out}; it has none for "
                         f"{len(missing)} of {len(samples)} ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}): "
                         "run `kvcompress --cells full` there first")
    return {sample["index"] for sample in samples if scores[sample["id"]] > 0}


def cell_key(library: str, label: str, ratio: float | None, sample_id: str) -> str:
    return f"{library}|{label}|{ratio}|{sample_id}"


def open_run(args, library: str, known_cells: dict) -> SimpleNamespace:
    """A model step's common start: threads set, the dumped samples, the checked checkpoint's model and tokenizer,
    the cells and ratios asked for (args.ratios: a list, `parse_ratios`, or None for the manifest's), this shard's results
    file and the cells already recorded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    manifest, samples = load_samples(out)
    checkpoint = Path(manifest["checkpoint"])
    check_checkpoint(manifest, checkpoint, args.skip_checkpoint_hash)
    shard = parse_shard(args.shard)
    if args.full_cache_hits and args.sample_indices is not None:
        raise SystemExit("--full-cache-hits and --sample-indices both choose the samples: give one of them")
    indices = full_cache_hits(out, samples) if args.full_cache_hits else parse_sample_indices(args.sample_indices)
    cells = parse_list(args.cells, known_cells)  # before the model loads
    return SimpleNamespace(
        manifest=manifest, samples=select_samples(samples, indices, shard), device=torch.device(args.device),
        model=AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, local_files_only=True).to(args.device).eval(),
        tokenizer=AutoTokenizer.from_pretrained(checkpoint, local_files_only=True),
        cells=cells, ratios=args.ratios or manifest["ratios"],
        path=results_path(out, library, shard), done=done_keys(out, library),
    )


def results_path(out: Path, library: str, shard: tuple[int, int] | None) -> Path:
    return out / (f"{library}.jsonl" if shard is None else f"{library}.shard{shard[0]}of{shard[1]}.jsonl")


def record_files(out: Path, library: str) -> list[Path]:
    """The library's record files in `out`, by name: the committed, compressed `<library>.jsonl.gz` (every earlier
    shard's records, in this same order) first, then any `<library>*.jsonl` a later run wrote."""
    return sorted(out.glob(f"{library}*.jsonl.gz")) + sorted(out.glob(f"{library}*.jsonl"))


def done_keys(out: Path, library: str) -> set[str]:
    """Cells already answered in any of the library's files (whatever shards wrote them): a rerun skips them,
    and runs again the cells whose record is an error."""
    return {r["key"] for path in record_files(out, library) for r in read_jsonl(path) if r.get("error") is None}


def one_record_per_cell(records: list[dict]) -> list[dict]:
    """One record per key, in first-seen order: the first answered one, else the first error (a cell run twice,
    by two shards or by a rerun after an error, counts once)."""
    seen: dict[str, dict] = {}
    for r in records:
        if r["key"] not in seen or (seen[r["key"]].get("error") is not None and r.get("error") is None):
            seen[r["key"]] = r
    return list(seen.values())


def read_records(out: Path) -> list[dict]:
    """Both libraries' records in `out` (every shard's file), one per cell (`one_record_per_cell`)."""
    return one_record_per_cell([r for library in ("kvcompress", "kvpress") for path in record_files(out, library)
                                for r in read_jsonl(path)])


def load_samples(out: Path) -> tuple[dict, list[dict]]:
    manifest_path, samples_path = out / MANIFEST_FILE, out / SAMPLES_FILE
    if not samples_path.is_file():  # committed dumps are kept compressed
        samples_path = out / (SAMPLES_FILE + ".gz")
    if not manifest_path.is_file() or not samples_path.is_file():
        raise SystemExit(f"{out} holds no dumped samples: run the `dump` step first (in kvcompress's venv)")
    return json.loads(manifest_path.read_text(encoding="utf-8")), read_jsonl(samples_path)


def environment(threads: int, device: str = "cpu") -> dict:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    gpu = torch.cuda.get_device_name(torch.device(device)) if torch.device(device).type == "cuda" else None
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": threads, "device": device, "gpu": gpu,
            "load_average": round(os.getloadavg()[0], 2),
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


# ---------------------------------------------------------------- step 1: dump (kvcompress's venv)


class SettingRefused(ValueError):
    """A step's setting refused before it runs: the script prints its message as one line (other errors keep their
    traceback)."""


def dump(args) -> None:

    from transformers import AutoTokenizer

    from kvcompress.commands.common import parse_params
    from kvcompress.eval.runner import SampleSpec, SweepConfig, check_task_settings, sample_depth
    from kvcompress.eval.stopping import stop_token_ids
    from kvcompress.eval.tasks import task_parameters
    from kvcompress.integration import build_prompt
    from kvcompress.integration.model import DEFAULT_PROMPT_LAYOUT, cache_dir

    args.prompt_layout = args.prompt_layout or DEFAULT_PROMPT_LAYOUT
    try:  # the settings before the model loads
        check_task_settings([args.task], haystack=args.haystack, kind=args.kind)
        takes = task_parameters(args.task)
        settings = {name: value or default for name, value, default in (("haystack", args.haystack, "prose"), ("kind", args.kind, "numbers"))
                    if name in takes}
        task_params = parse_params(args.task_param, flag="--task-param")
        config = SweepConfig(methods=[], tasks=[args.task], lengths=[args.length], samples=args.samples, seed=args.seed,
                             prompt_layout=args.prompt_layout, task_params={args.task: task_params} if task_params else {}, **settings)
    except ValueError as error:
        raise SettingRefused(str(error)) from None
    checkpoint = Path(args.checkpoint) if args.checkpoint else cache_dir()
    if not (checkpoint / "model.safetensors").is_file():
        import kvcompress as kvc

        kvc.load_model()  # builds the dequantised default checkpoint on first use
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    takes_depth = "depth" in takes
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stops: dict[str, list[int]] = {}
    lines = []
    for index in range(args.samples):
        spec = SampleSpec(args.task, args.length, index, sample_depth(index) if takes_depth else None, params=config.params_of(args.task))
        sample = spec.build(config, tokenizer)
        context_ids, question_ids = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix, config.prompt_layout)
        stop_key = json.dumps(list(sample.stop))
        if stop_key not in stops:
            stops[stop_key] = sorted(stop_token_ids(tokenizer, sample.stop))
        ctx, q = context_ids[0].tolist(), question_ids[0].tolist()
        lines.append({
            "id": f"{spec.task}|{spec.length}|{spec.index}|{spec.depth}", "task": spec.task, "length": spec.length,
            "index": spec.index, "seed": args.seed + index, "depth": spec.depth, "measured_depth": sample.depth,
            "answers": sample.answers, "needles": sample.needles, "question": sample.question,
            "answer_prefix": sample.answer_prefix, "max_new_tokens": args.max_new_tokens or sample.max_new_tokens,
            "stop": list(sample.stop), "context_tokens": len(ctx), "question_tokens": len(q),
            "prompt_digest": prompt_digest(ctx, q), "context_ids": ctx, "question_ids": q,
        })
    with (out / SAMPLES_FILE).open("w", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in lines))
    from transformers import AutoConfig, GenerationConfig

    try:  # what model.generation_config holds once loaded: the generation config, else the model config
        eos = GenerationConfig.from_pretrained(checkpoint, local_files_only=True).eos_token_id
    except OSError:
        eos = AutoConfig.from_pretrained(checkpoint, local_files_only=True).eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    manifest = {
        "checkpoint": str(checkpoint), "checkpoint_sha256": checkpoint_digest(checkpoint),
        "eos_token_ids": [e for e in eos if e is not None], "stop_token_ids": stops,
        "samples": {"task": args.task, "length": args.length, "count": args.samples, "seed": args.seed,
                    "seeds": f"{args.seed}..{args.seed + args.samples - 1}", "haystack": settings.get("haystack"), "kind": settings.get("kind"),
                    "task_params": task_params,
                    "prompt_layout": config.prompt_layout.name,
                    "depths": "eval.runner.sample_depth(index)" if takes_depth else None},
        "ratios": args.ratios, "dumped": environment(0) | {"threads": None},
    }
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    print(f"wrote {len(lines)} samples to {out / SAMPLES_FILE} "
          f"(context tokens {min(r['context_tokens'] for r in lines)}..{max(r['context_tokens'] for r in lines)})")


def stop_ids_of(manifest: dict, sample: dict) -> tuple[set[int], set[int]]:
    """(EOS ids, every token containing one of the sample's stop strings), the ids computed once by `dump`."""
    return set(manifest["eos_token_ids"]), set(manifest["stop_token_ids"][json.dumps(sample["stop"])])


# ---------------------------------------------------------------- step 2: kvcompress (kvcompress's venv)


def run_kvcompress(args) -> None:
    import torch

    from kvcompress.eval.capture import capture_qkv
    from kvcompress.eval.tasks import score as task_score
    from kvcompress.integration import generate_ids

    run = open_run(args, "kvcompress", KVCOMPRESS_CELLS)
    manifest, samples, model, tokenizer, cells, ratios, path, done = (
        run.manifest, run.samples, run.model, run.tokenizer, run.cells, run.ratios, run.path, run.done)
    env = environment(args.threads, args.device) | {"kvcompress_version": _kvcompress_version()}
    for sample in samples:
        todo = [(label, None if KVCOMPRESS_CELLS[label][0] is None else ratio) for label in cells
                for ratio in (ratios if KVCOMPRESS_CELLS[label][0] is not None else [None])]
        todo = list(dict.fromkeys(todo))
        todo = [(label, ratio) for label, ratio in todo if cell_key("kvcompress", label, ratio, sample["id"]) not in done]
        if not todo:
            continue
        context_ids = torch.tensor([sample["context_ids"]], device=run.device)
        question_ids = torch.tensor([sample["question_ids"]], device=run.device)
        stop = stop_ids_of(manifest, sample)
        captured, capture_s, reconstructions = None, 0.0, {}
        if any(compresses_the_recorded_prefill(label) for label, _ in todo):
            start = time.perf_counter()
            captured = capture_qkv(model, context_ids)
            capture_s = time.perf_counter() - start
        for label, ratio in todo:
            method = KVCOMPRESS_CELLS[label][0]
            record = {"key": cell_key("kvcompress", label, ratio, sample["id"]), "library": "kvcompress", "cell": label,
                      "ratio": ratio, "sample": sample["id"], "prompt_digest": prompt_digest(sample["context_ids"], sample["question_ids"]),
                      "error": None}
            start = time.perf_counter()
            try:
                if method is None:
                    res = generate_ids(model, context_ids, question_ids, method=None, max_new_tokens=sample["max_new_tokens"],
                                       stop_token_ids=stop[1])
                else:
                    options = kvcompress_options(label, ratio, manifest, tokenizer)
                    own = recorded_inputs(model, options, context_ids, captured, reconstructions)
                    res = generate_ids(model, context_ids, question_ids, options, max_new_tokens=sample["max_new_tokens"],
                                       stop_token_ids=stop[1], **own)
            except (ValueError, RuntimeError) as err:
                record["error"] = f"{type(err).__name__}: {err}"
                print(f"[{record['key']}] {record['error']}", flush=True)
            else:
                tokens = trim_at_stop(list(res.token_ids), stop)
                prediction = tokenizer.decode(tokens, skip_special_tokens=True).strip()
                slots = res.slots_per_layer
                record.update(
                    token_ids=tokens, prediction=prediction,
                    score=float(task_score(SimpleNamespace(task=sample["task"], answers=sample["answers"]), prediction)),
                    kept_tokens_mean=None if method is None else sum(slots) / len(slots) - max(len(tokens) - 1, 0) - sample["question_tokens"],
                    kv_over_full=res.kv_bytes / res.kv_bytes_full, kv_bits=res.kv_bits,
                    prefill_s=res.prefill_seconds + _shared_seconds(res, label, capture_s),
                    decode_s=res.decode_seconds,
                )
            record["wall_s"] = time.perf_counter() - start
            record["env"] = env
            append_jsonl(path, record)
            print(f"kvcompress {label:<34} {ratio!s:<5} {sample['id']:<28} score={record.get('score')} "
                  f"{record.get('prediction')!r} ({record['wall_s']:.1f}s)", flush=True)


def kvcompress_options(label: str, ratio: float, manifest: dict, tokenizer):
    """The `CompressionOptions` of kvcompress cell `label` (one with a method) at `ratio`, seeded as the dump says, with
    KVzip's repeat instruction through `tokenizer` for a cell scored by reconstruction (`with_repeat_prompt`)."""
    from kvcompress.integration.reconstruction import with_repeat_prompt
    from kvcompress.options import CompressionOptions

    method, params = KVCOMPRESS_CELLS[label]
    return with_repeat_prompt(CompressionOptions.build(method=method, compression_ratio=ratio, seed=manifest["samples"]["seed"], **params),
                              tokenizer)


def recorded_inputs(model, options, context_ids, captured: dict | None, reconstructions: dict) -> dict:
    """The recorded forwards a cell of `options` compresses, as keyword arguments of `generate_ids`: KVzip's context
    prefill and reconstruction forward, recorded once per sample in `reconstructions` (`shared_reconstruction`) with
    the options' repeat instruction; the sample's recorded prefill `captured` (`capture_qkv`) for any other
    prefill-mode cell but one whose method reads the layers' hidden states (KVzap), which a recording does not keep;
    nothing for those and for a chunked cell, which run the context's forward themselves."""
    from kvcompress.integration.reconstruction import shared_reconstruction

    needs = options.compressor.requirements
    if needs.needs("reconstruction"):
        return {"prefill": shared_reconstruction(model, options, context_ids, reconstructions)}
    return {"prefill": captured} if needs.compresses_a_recorded_prefill and not options.streams else {}


def _shared_seconds(res, label: str, capture_s: float) -> float:
    """The seconds a cell's forwards took outside its own call: the sample's recorded prefill (capture_s) for a cell that
    compresses it, the recorded context prefill and reconstruction forwards for KVzip's cells; 0 for the others."""
    if "reconstruction" in res.extra:
        return res.extra["reconstruction"]["context_seconds"] + res.extra["reconstruction"]["seconds"]
    return capture_s if compresses_the_recorded_prefill(label) else 0.0


def compresses_the_recorded_prefill(label: str) -> bool:
    """Whether a kvcompress cell compresses the sample's recorded prefill: a prefill-mode method that neither reconstructs
    the context (KVzip, or AdaKV over its scores) nor reads the layers' hidden states (KVzap), which run their own."""
    from kvcompress.options import CompressionOptions

    method, params = KVCOMPRESS_CELLS[label]
    if method is None or streams(label):
        return False
    return CompressionOptions.build(method=method, compression_ratio=0.5, **params).compressor.requirements.compresses_a_recorded_prefill


def streams(label: str) -> bool:
    """Whether a kvcompress cell streams the context through its method (mode "chunked"), with no recorded prefill."""
    return KVCOMPRESS_CELLS[label][1].get("mode", "prefill") != "prefill"


def _kvcompress_version() -> str:
    try:
        from importlib.metadata import version

        return version("kvcompress")
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"


def check_checkpoint(manifest: dict, checkpoint: Path, skip: bool) -> None:
    """Refuse to run on a checkpoint whose files differ from the one the samples were dumped with."""
    if not (checkpoint / "model.safetensors").is_file():
        raise SystemExit(f"checkpoint {checkpoint} not found: run the `dump` step (kvcompress's venv builds it) on this machine first")
    if skip:
        return
    found = checkpoint_digest(checkpoint)
    if found != manifest["checkpoint_sha256"]:
        raise SystemExit(f"checkpoint {checkpoint} differs from the dumped one: {found} != {manifest['checkpoint_sha256']}")


# ---------------------------------------------------------------- step 3: kvpress (kvpress's venv)


def build_press(label: str, ratio: float):
    """The kvpress press of a cell label at `ratio` (None for the full cache)."""
    import kvpress

    name, kwargs, inner = KVPRESS_CELLS[label]
    if name is None:
        return None
    if inner is not None:
        return getattr(kvpress, name)(press=getattr(kvpress, inner)(compression_ratio=ratio), **kwargs)
    return getattr(kvpress, name)(compression_ratio=ratio, **kwargs)


def _clear_masks(model) -> None:
    """A head-wise press (AdaKV, KVzip) leaves its pruned indices on the attention modules: start each answer clean."""
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None


def _kept_tokens(model, cache) -> tuple[float, float]:
    """(mean tokens kept per layer and KV head, mean tokens stored per layer): a head-wise press stores every
    token and masks the pruned ones (`masked_key_indices`)."""
    stored = [cache.layers[i].keys.shape[-2] for i in range(len(cache.layers))]
    kv_heads = model.config.num_key_value_heads
    masked = [0 if getattr(layer.self_attn, "masked_key_indices", None) is None else len(layer.self_attn.masked_key_indices[0])
              for layer in model.model.layers]
    kept = [n - m / kv_heads for n, m in zip(stored, masked)]
    return sum(kept) / len(kept), sum(stored) / len(stored)


def greedy_answer(model, cache, n_context: int, question_ids, max_new_tokens: int, stop_ids) -> list[int]:
    """kvpress's `generate_answer` on a prefilled cache: the question at its original positions
    (n_context onwards, whatever the cache holds), then one greedy token at a time; stops where kvcompress's
    `answer_end` does (stop_ids: (EOS ids, stop ids), `stop_ids_of`) or at max_new_tokens."""
    import torch

    device = question_ids.device
    position_ids = torch.arange(n_context, n_context + question_ids.shape[1], device=device).unsqueeze(0)
    out = model(input_ids=question_ids, past_key_values=cache, position_ids=position_ids, logits_to_keep=1)
    ids = [int(out.logits[0, -1].argmax())]
    position = n_context + question_ids.shape[1]
    while len(ids) < max_new_tokens and answer_end(ids, *stop_ids) is None:
        out = model(input_ids=torch.tensor([[ids[-1]]], device=device), past_key_values=cache,
                    position_ids=torch.tensor([[position]], device=device))
        position += 1
        ids.append(int(out.logits[0, -1].argmax()))
    return ids


def press_answer(model, press, context_ids, question_ids, max_new_tokens: int, stop_ids, seed: int = 0) -> tuple[list[int], dict]:
    """kvpress's pipeline protocol on given ids: a DynamicCache, `with press(model): model.model(context)`
    (None: no press), then `greedy_answer`. -> (answer ids, stats). Randomised presses (Compactor's
    sketch) draw from torch's global generator, seeded with `seed` before the prefill."""
    import torch
    from transformers import DynamicCache

    _clear_masks(model)
    with torch.inference_mode():
        torch.manual_seed(seed)
        cache = DynamicCache()
        start = time.perf_counter()
        with press(model) if press is not None else contextlib.nullcontext():
            model.model(input_ids=context_ids, past_key_values=cache)
        prefill_s = time.perf_counter() - start
        kept, stored = _kept_tokens(model, cache)
        start = time.perf_counter()
        ids = greedy_answer(model, cache, context_ids.shape[1], question_ids, max_new_tokens, stop_ids)
        decode_s = time.perf_counter() - start
    _clear_masks(model)
    return ids, {"kept_tokens_mean": kept, "stored_tokens_mean": stored, "prefill_s": prefill_s, "decode_s": decode_s,
                 "protocol": "pipeline"}


def shares_prefill(press) -> bool:
    """Whether a press compresses through BasePress's own hook (so one prefill can serve it beside others):
    every press here but KVzip, whose context manager re-runs the model to score."""
    from kvpress.presses.base_press import BasePress

    return press is None or (type(press).__call__ is BasePress.__call__ and type(press).forward_hook is BasePress.forward_hook)


def shared_prefill_answers(model, presses: dict, context_ids, question_ids, max_new_tokens: int, stop_ids, seed: int = 0) -> dict:
    """`press_answer` for many presses (None: no press) with one prefill of the context.

    Exactly what `with press(model)` computes, once per press: BasePress's hook runs after each
    attention layer's forward, calls `press.compress(module, hidden_states, keys, values, attentions,
    kwargs)` on that layer's full keys/values and writes the result into the cache. A prefill's
    activations never depend on that write (every layer attends over its full context before its
    hook), so one prefill can hand the same inputs to every press's `compress` in turn; each press's
    cache is then the full cache with its compressed keys/values (and its `masked_key_indices`, for
    head-wise presses) put in. The presses' `post_init_from_model` and rotary set-up run as in
    `BasePress.__call__`; torch's generator is seeded with `seed` before the prefill (the only random
    press, Compactor, then draws the same numbers as under `press_answer`).
    -> {label: (answer ids, stats)}.
    """
    import copy

    import torch
    from kvpress.utils import extract_keys_and_values
    from transformers import DynamicCache

    language_model = model.model
    for press in presses.values():
        if press is not None:
            press.post_init_from_model(model)
    for layer in language_model.layers:
        layer.self_attn.rotary_emb = language_model.rotary_emb
    compressed: dict = {label: {} for label, press in presses.items() if press is not None}
    seconds: dict = defaultdict(float)

    def hook(module, args, kwargs, output):
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        for label, press in presses.items():
            if press is None:
                continue
            start = time.perf_counter()
            module.masked_key_indices = None
            k, v = press.compress(module, kwargs["hidden_states"], keys, values, output[1], kwargs)
            compressed[label][module.layer_idx] = (k, v, getattr(module, "masked_key_indices", None))
            seconds[label] += time.perf_counter() - start
        module.masked_key_indices = None
        return output

    _clear_masks(model)
    results = {}
    with torch.inference_mode():
        torch.manual_seed(seed)
        cache = DynamicCache()
        hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in language_model.layers]
        start = time.perf_counter()
        try:
            language_model(input_ids=context_ids, past_key_values=cache)
        finally:
            for h in hooks:
                h.remove()
        prefill_s = time.perf_counter() - start - sum(seconds.values())
        for label, press in presses.items():
            own = copy.deepcopy(cache)
            _clear_masks(model)
            for layer_idx, (k, v, masked) in compressed.get(label, {}).items():
                own.layers[layer_idx].keys, own.layers[layer_idx].values = k, v
                language_model.layers[layer_idx].self_attn.masked_key_indices = masked
            kept, stored = _kept_tokens(model, own)
            start = time.perf_counter()
            ids = greedy_answer(model, own, context_ids.shape[1], question_ids, max_new_tokens, stop_ids)
            results[label] = (ids, {"kept_tokens_mean": kept, "stored_tokens_mean": stored, "prefill_s": prefill_s + seconds[label],
                                    "decode_s": time.perf_counter() - start, "protocol": "shared prefill"})
    _clear_masks(model)
    return results


def run_kvpress(args) -> None:
    import logging
    from importlib.metadata import version

    import kvpress  # noqa: F401  (importing it patches the attention functions for head-wise presses)
    import torch

    logging.getLogger("kvpress").setLevel(logging.ERROR)  # KVzip's "2-3x prefill" warning, once per press built
    run = open_run(args, "kvpress", KVPRESS_CELLS)
    tasks_module = load_task_scorer()
    manifest, samples, model, tokenizer, cells, ratios, path, done = (
        run.manifest, run.samples, run.model, run.tokenizer, run.cells, run.ratios, run.path, run.done)
    env = environment(args.threads, args.device) | {"kvpress_version": version("kvpress"),
                                                    "attn_implementation": model.config._attn_implementation}
    for sample in samples:
        context_ids = torch.tensor([sample["context_ids"]], device=run.device)
        question_ids = torch.tensor([sample["question_ids"]], device=run.device)
        stop = stop_ids_of(manifest, sample)
        digest = prompt_digest(context_ids[0].tolist(), question_ids[0].tolist())
        todo = {}
        for label in cells:
            for ratio in ratios if KVPRESS_CELLS[label][0] is not None else [None]:
                key = cell_key("kvpress", label, ratio, sample["id"])
                if key not in done:
                    todo[key] = (label, ratio, build_press(label, ratio) if ratio is not None else None)
        shared = {key: cell for key, cell in todo.items() if args.protocol == "shared" and shares_prefill(cell[2])}
        answers: dict = {}
        errors: dict = {}
        start = time.perf_counter()
        if shared:
            try:
                for key, value in shared_prefill_answers(model, {k: c[2] for k, c in shared.items()}, context_ids, question_ids,
                                                         sample["max_new_tokens"], stop, sample["seed"]).items():
                    answers[key] = value
            except (ValueError, RuntimeError, AssertionError) as err:
                errors.update({k: f"{type(err).__name__}: {err}" for k in shared})
        shared_wall = (time.perf_counter() - start) / max(1, len(shared))
        for key, (label, ratio, press) in todo.items():
            record = {"key": key, "library": "kvpress", "cell": label, "ratio": ratio, "sample": sample["id"],
                      "prompt_digest": digest, "error": None}
            start = time.perf_counter()
            if key not in shared:
                try:
                    answers[key] = press_answer(model, press, context_ids, question_ids, sample["max_new_tokens"], stop, sample["seed"])
                except (ValueError, RuntimeError, AssertionError) as err:
                    errors[key] = f"{type(err).__name__}: {err}"
            if key in errors:
                record["error"] = errors[key]
                print(f"[{key}] {record['error']}", flush=True)
            else:
                tokens, stats = answers[key]
                prediction = tokenizer.decode(tokens, skip_special_tokens=True).strip()
                record.update(token_ids=tokens, prediction=prediction, score=score_prediction(tasks_module, sample, prediction), **stats)
            record["wall_s"] = shared_wall if key in shared else time.perf_counter() - start
            record["env"] = env
            append_jsonl(path, record)
            done.add(key)
            print(f"kvpress {label:<26} {ratio!s:<5} {sample['id']:<28} score={record.get('score')} "
                  f"{record.get('prediction')!r} ({record['wall_s']:.1f}s, {record.get('protocol')})", flush=True)


# ---------------------------------------------------------------- step 4: compare (kvcompress's venv)


def cell_name(library: str, label: str, ratio) -> str:
    return f"{library}: {label}" + ("" if ratio is None else f" @ {ratio:g}")


def rescore(records: list[dict], samples: dict[str, dict], tokenizer, score_fn) -> list[str]:
    """Re-decode each record's token ids with `tokenizer` and re-score with `score_fn(sample, text)`;
    the records take these (so both libraries are scored identically); returns the disagreements found."""
    problems = []
    for r in records:
        if r.get("error") is not None:
            continue
        sample = samples[r["sample"]]
        if r["prompt_digest"] != sample["prompt_digest"]:
            problems.append(f"{r['key']}: fed prompt {r['prompt_digest']} != dumped {sample['prompt_digest']}")
        text = tokenizer.decode(r["token_ids"], skip_special_tokens=True).strip() if tokenizer is not None else r["prediction"]
        if text != r["prediction"]:
            problems.append(f"{r['key']}: decoded text differs ({r['prediction']!r} recorded, {text!r} here)")
        s = float(score_fn(sample, text))
        if s != r["score"]:
            problems.append(f"{r['key']}: score {r['score']} recorded, {s} here")
        r["prediction"], r["score"] = text, s
    return problems


def per_cell_rows(records: list[dict]) -> list[dict]:
    from kvcompress.eval.stats import wilson

    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["library"], r["cell"], r["ratio"])].append(r)
    rows = []
    for (library, label, ratio), rs in groups.items():
        ok = [r for r in rs if r.get("error") is None]
        scores = [r["score"] for r in ok]
        low, high = wilson(sum(scores), len(scores))
        rows.append({"library": library, "cell": label, "ratio": ratio, "n": len(scores), "errors": len(rs) - len(ok),
                     "hits": sum(scores), "score": sum(scores) / len(scores) if scores else float("nan"), "ci_low": low, "ci_high": high,
                     "kept_tokens_mean": _mean([r.get("kept_tokens_mean") for r in ok if r.get("kept_tokens_mean") is not None]),
                     "prefill_s": _mean([r["prefill_s"] for r in ok]), "decode_s": _mean([r["decode_s"] for r in ok]),
                     "new_tokens": _mean([len(r["token_ids"]) for r in ok])})
    order = {name: i for i, name in enumerate(DEFAULT_KVCOMPRESS + DEFAULT_KVPRESS)}
    return sorted(rows, key=lambda r: (r["library"] != "kvcompress", r["cell"] != FULL, order.get(r["cell"], 99), r["ratio"] or 0))


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def pair_rows(records: list[dict], pairs: list[tuple[tuple, tuple]]) -> list[dict]:
    """For each ((library, cell, ratio), (library, cell, ratio)) pair: the paired comparison on the samples both answered."""
    from kvcompress.eval.stats import paired_comparisons, paired_difference_interval

    by_cell: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in records:
        if r.get("error") is None:
            by_cell[(r["library"], r["cell"], r["ratio"])][r["sample"]] = r
    rows = []
    for first, second in pairs:
        mine, theirs = by_cell.get(first, {}), by_cell.get(second, {})
        common = sorted(set(mine) & set(theirs))
        if not common:
            continue
        x = [mine[s]["score"] for s in common]
        y = [theirs[s]["score"] for s in common]
        name_a, name_b = cell_name(*first), cell_name(*second)
        # eval.stats.paired_comparisons: wins / losses and the exact sign test, the second cell as the baseline
        recs = [{"pair": 0, "method": name, "score": rec[s]["score"], "task": s, "length": 0, "index": 0, "depth": 0}
                for name, rec in ((name_a, mine), (name_b, theirs)) for s in common]
        (sign,) = paired_comparisons(recs, [name_b], by=("pair",))
        binary = all(v in (0.0, 1.0) for v in (*x, *y))
        diff, low, high = paired_difference_interval(x, y) if binary else (sum(x) / len(x) - sum(y) / len(y), float("nan"), float("nan"))
        same = sum(mine[s]["token_ids"] == theirs[s]["token_ids"] for s in common)
        rows.append({"first": name_a, "second": name_b, "n_pairs": len(common), "first_score": sum(x) / len(x),
                     "second_score": sum(y) / len(y), "difference": diff, "diff_low": low, "diff_high": high,
                     "wins": sign["wins"], "losses": sign["losses"], "p_sign": sign["p"], "identical_answers": same})
    return rows


def comparison_pairs(records: list[dict]) -> tuple[list, list]:
    """(cross-library pairs, within-library pairs vs the full cache) for the cells present."""
    cells = {(r["library"], r["cell"], r["ratio"]) for r in records}
    cross, within = [], []
    for library, label, ratio in sorted(cells, key=str):
        if library != "kvcompress":
            continue
        for other in [COUNTERPARTS.get(label), *EXTRA_COUNTERPARTS.get(label, [])]:
            if other is not None and ("kvpress", other, ratio) in cells:
                cross.append(((library, label, ratio), ("kvpress", other, ratio)))
    for library, label, ratio in sorted(cells, key=str):
        if label != FULL and (library, FULL, None) in cells:
            within.append(((library, label, ratio), (library, FULL, None)))
    order = {name: i for i, name in enumerate(DEFAULT_KVCOMPRESS + DEFAULT_KVPRESS)}

    def key(pair):
        (lib, label, ratio), (_, other, _) = pair
        return (lib != "kvcompress", label != FULL, ratio or 0, order.get(label, 99), order.get(other, 99))

    return sorted(cross, key=key), sorted(within, key=key)


def _pct(x: float) -> str:
    return "–" if math.isnan(x) else f"{100 * x:.0f}"


def _signed(x: float) -> str:
    return "–" if math.isnan(x) else f"{100 * x:+.0f}"


def markdown_report(manifest: dict, samples: list[dict], records: list[dict], problems: list[str], answers_shown: int = 6) -> str:
    cells = per_cell_rows(records)
    cross, within = comparison_pairs(records)
    cross_rows, within_rows = pair_rows(records, cross), pair_rows(records, within)
    envs: dict[str, dict] = {}
    for r in records:  # per library: one line of versions, with the spread of threads, load and dates over its runs
        env = r.get("env", {})
        seen = envs.setdefault(r["library"], env | {"loads": set(), "dates": set(), "thread_set": set(), "devices": set()})
        seen["devices"].add(env.get("gpu") or env.get("device", "cpu"))  # runs before --device recorded none: CPU
        seen["loads"].add(env.get("load_average"))
        seen["dates"].add(str(env.get("date", ""))[:10])
        seen["thread_set"].add(env.get("threads"))
    s = manifest["samples"]
    lines = [
        "# kvcompress and kvpress side by side",
        "",
        (f"Samples: {len(samples)} × `{s['task']}` ("
         + "".join(f"{name} {s[name]}, " for name in ("haystack", "kind") if s.get(name) is not None)
         + "".join(f"{name}={value!r}, " for name, value in sorted(s.get("task_params", {}).items()))
         + f"prompt layout `{s.get('prompt_layout', 'not recorded')}`), target {s['length']} tokens "
        f"(context {min(x['context_tokens'] for x in samples)}–{max(x['context_tokens'] for x in samples)} prompt tokens "
        f"before the question), seeds {s['seeds']}, depths `{s['depths']}`. Checkpoint `{Path(manifest['checkpoint']).name}` "
        f"(model.safetensors sha256 {manifest['checkpoint_sha256']['model.safetensors'][:12]}…), float32."),
        "",
    ]
    for library, env in sorted(envs.items()):
        extra = f", kvpress {env.get('kvpress_version')}, attention {env.get('attn_implementation')}" if library == "kvpress" else ""
        loads = sorted(x for x in env["loads"] if x is not None)
        load = f"{loads[0]}–{loads[-1]}" if loads and loads[0] != loads[-1] else (f"{loads[0]}" if loads else "?")
        lines.append(f"- {library}: on {', '.join(sorted(env['devices']))}; {env.get('cpu')}, {env.get('cores')} cores, torch threads "
                     f"{', '.join(str(t) for t in sorted(x for x in env['thread_set'] if x is not None))}, load average {load} "
                     f"when its processes started, {', '.join(sorted(env['dates']))}, torch {env.get('torch')}, "
                     f"transformers {env.get('transformers')}, Python {env.get('python')}{extra}")
    lines += ["", "## Scores (%, 95% Wilson interval)", "",
              "| cell | n | hits | score | 95% interval | kept tokens (mean per layer and KV head) | prefill + compression s | decode s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in cells:
        errors = f" ({r['errors']} errors)" if r["errors"] else ""
        kept = "all" if r["cell"] == FULL else f"{r['kept_tokens_mean']:.0f}"
        lines.append(f"| {cell_name(r['library'], r['cell'], r['ratio'])} | {r['n']}{errors} | {r['hits']:g} | {_pct(r['score'])} | "
                     f"{_pct(r['ci_low'])}–{_pct(r['ci_high'])} | {kept} | {r['prefill_s']:.1f} | {r['decode_s']:.2f} |")
    lines += ["", ("Times are per cell on a shared, loaded machine and are no speed comparison: in each library one prefill "
              "of a sample serves all its cells but KVzip (kvcompress: `capture_qkv`, plus a plain prefill for the full cache, and "
              "one recorded reconstruction for its KVzip-scored cells; kvpress: `--protocol shared`), and that prefill (and "
              "reconstruction) is counted in every cell that used it.")]
    header = ("| first | second | pairs | first % | second % | difference (points) | 95% interval | wins | losses | p (sign test) | identical answers |",
              "|---|---|---|---|---|---|---|---|---|---|---|")

    def table(rows):
        out = list(header)
        for r in rows:
            out.append(f"| {r['first']} | {r['second']} | {r['n_pairs']} | {_pct(r['first_score'])} | {_pct(r['second_score'])} | "
                       f"{_signed(r['difference'])} | {_signed(r['diff_low'])} to {_signed(r['diff_high'])} | {r['wins']} | {r['losses']} | "
                       f"{r['p_sign']:.3g} | {r['identical_answers']}/{r['n_pairs']} |")
        return out

    lines += ["", "## kvcompress against kvpress, paired on the same samples", "",
              ("difference: first minus second, in points; 95% interval: Newcombe's square-and-add interval for paired "
              "proportions; wins / losses: samples only the first / only the second answers; p: exact two-sided sign test "
              "(McNemar's exact test); identical answers: the same answer tokens."), ""] + table(cross_rows)
    lines += ["", "## Each cell against its own library's full cache", ""] + table(within_rows)
    lines += ["", "## Answers", "", f"The first {answers_shown} samples, every cell (answer text after the answer prefix):", ""]
    by_sample: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in records:
        by_sample[r["sample"]][cell_name(r["library"], r["cell"], r["ratio"])] = r
    names = [cell_name(r["library"], r["cell"], r["ratio"]) for r in cells]
    for sample in samples[:answers_shown]:
        got = by_sample.get(sample["id"], {})
        lines.append(f"- `{sample['id']}` expects **{', '.join(sample['answers'])}** (prefix: \"{sample['answer_prefix']}\")")
        for name in names:
            r = got.get(name)
            if r is None:
                continue
            text = r["error"] if r.get("error") else json.dumps(r["prediction"], ensure_ascii=False)
            lines.append(f"  - {name}: {text}{'' if r.get('error') else ' ✓' if r['score'] == 1 else ' ✗'}")
    if problems:
        lines += ["", "## Consistency problems", ""] + [f"- {p}" for p in problems]
    else:
        lines += ["", ("Consistency: every record fed the dumped prompt tokens, and re-decoding its answer tokens and "
                  "re-scoring with `kvcompress.eval.tasks.score` reproduced the recorded text and score.")]
    return "\n".join(lines) + "\n"


def _score_text(row: dict | None, samples: int) -> str:
    if row is None:
        return "–"
    n = "" if row["n"] == samples else f", n = {row['n']}"
    return f"{_pct(row['score'])} ({_pct(row['ci_low'])}–{_pct(row['ci_high'])}){n}"


def overview_markdown(runs: list[tuple[int, int, list[dict]]], default_cell: str) -> str:
    """The `table` step's report. runs: (context length, number of samples, answered records) per folder.

    Two tables: every (library, cell) at every length and ratio (score %, 95% Wilson interval, n when
    short of the folder's samples), and per length and ratio kvcompress's `default_cell` against the
    kvpress press that scores highest on the samples that cell answered (ties: the first in
    DEFAULT_KVPRESS order), paired, with how many of kvcompress's full cache's hits that cell keeps. The
    second table calls the cell "default" only when it is DEFAULT_CELL, and otherwise names the default."""
    columns, by_cell = [], defaultdict(dict)
    for length, n_samples, records in runs:
        rows = per_cell_rows(records)
        ratios = sorted({r["ratio"] for r in rows if r["ratio"] is not None})
        columns += [(length, ratio, n_samples) for ratio in ratios]
        for r in rows:
            for ratio in ratios if r["ratio"] is None else [r["ratio"]]:
                by_cell[(r["library"], r["cell"])][(length, ratio)] = r
    order = {name: i for i, name in enumerate(DEFAULT_KVCOMPRESS + DEFAULT_KVPRESS)}
    names = sorted(by_cell, key=lambda c: (c[0] != "kvcompress", c[1] != FULL, order.get(c[1], 99), c[1]))
    lines = ["## Every cell (score %, 95% Wilson interval)", "",
             "| cell | " + " | ".join(f"{length} tokens @ {ratio:g}" for length, ratio, _ in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for library, label in names:
        cells = [_score_text(by_cell[(library, label)].get((length, ratio)), n) for length, ratio, n in columns]
        lines.append(f"| {library}: {label} | " + " | ".join(cells) + " |")
    what = "default" if default_cell == DEFAULT_CELL else "cell"
    heading = f"## kvcompress's {what} (`{default_cell}`) against kvpress's best press"
    if what == "cell":
        heading += f" (kvcompress's default is `{DEFAULT_CELL}`)"
    lines += ["", heading, "",
              (f"difference: the {what} minus the press, in points, with Newcombe's 95% interval for paired proportions; "
               f"won / lost: samples only the {what} / only the press answers; p: exact two-sided sign test; "
               f"hits kept: the full cache's hits the {what} also finds."), "",
              f"| length | ratio | {what} % (95%) | kvpress's best press | its % | difference (95% interval) | won / lost | p | "
              "full cache's hits kept |", "|---|---|---|---|---|---|---|---|---|"]
    for length, n_samples, records in runs:
        by = defaultdict(dict)
        for r in records:
            by[(r["library"], r["cell"], r["ratio"])][r["sample"]] = r["score"]
        full = by.get(("kvcompress", FULL, None), {})
        for ratio in sorted({r["ratio"] for r in records if r["cell"] == default_cell}):
            mine = by[("kvcompress", default_cell, ratio)]
            presses = [c for c in DEFAULT_KVPRESS if c != FULL and set(mine) <= set(by.get(("kvpress", c, ratio), {}))]
            hits = [s for s in mine if full.get(s) == 1.0]
            kept = sum(mine[s] == 1.0 for s in hits)
            share = f"{kept} of {len(hits)}" + (f" ({100 * kept / len(hits):.0f} %)" if hits else "")
            row = by_cell[("kvcompress", default_cell)][(length, ratio)]
            score = f"{_pct(row['score'])} ({_pct(row['ci_low'])}–{_pct(row['ci_high'])}), n = {row['n']}"
            if not presses:
                lines.append(f"| {length} | {ratio:g} | {score} | no press ran on all these samples | – | – | – | – | {share} |")
                continue
            best = max(presses, key=lambda c: (sum(by[("kvpress", c, ratio)][s] for s in mine), -presses.index(c)))
            (pair,) = pair_rows(records, [(("kvcompress", default_cell, ratio), ("kvpress", best, ratio))])
            lines.append(f"| {length} | {ratio:g} | {score} | {best} | {_pct(pair['second_score'])} | {_signed(pair['difference'])} "
                         f"({_signed(pair['diff_low'])} to {_signed(pair['diff_high'])}) | {pair['wins']} / {pair['losses']} | "
                         f"{pair['p_sign']:.2g} | {share} |")
    if not any(r["cell"] == default_cell for _, _, records in runs for r in records):
        lines.append(f"| – | – | no folder holds the cell `{default_cell}` (--default-cell names another) | – | – | – | – | – | – |")
    return "\n".join(lines) + "\n"


def table(args) -> None:
    runs = []
    for folder in args.folders:
        manifest, samples = load_samples(Path(folder))
        runs.append((manifest["samples"]["length"], len(samples), [r for r in read_records(Path(folder)) if r.get("error") is None]))
    text = overview_markdown(runs, args.default_cell)
    Path(args.table).write_text(text, encoding="utf-8")
    print(text)


def compare(args) -> None:
    from transformers import AutoTokenizer

    from kvcompress.eval.tables import write_csv
    from kvcompress.eval.tasks import score as task_score

    out = Path(args.out)
    manifest, samples = load_samples(out)
    records = read_records(out)
    if not records:
        raise SystemExit(f"{out} holds no predictions: run the `kvcompress` and `kvpress` steps first")
    by_id = {s["id"]: s for s in samples}
    tokenizer = AutoTokenizer.from_pretrained(manifest["checkpoint"], local_files_only=True)
    problems = rescore(records, by_id, tokenizer, lambda sample, text: task_score(SimpleNamespace(task=sample["task"], answers=sample["answers"]), text))
    report = markdown_report(manifest, samples, records, problems, args.answers)
    (out / "summary.md").write_text(report, encoding="utf-8")
    write_csv(out / "scores.csv", per_cell_rows(records))
    cross, within = comparison_pairs(records)
    write_csv(out / "paired.csv", pair_rows(records, cross) + pair_rows(records, within))
    rows = []
    for r in sorted(records, key=lambda r: (r["sample"], r["library"], r["cell"], str(r["ratio"]))):
        rows.append({"sample": r["sample"], "expected": "; ".join(by_id[r["sample"]]["answers"]), "library": r["library"], "cell": r["cell"],
                     "ratio": r["ratio"], "score": r.get("score"), "prediction": r.get("prediction"), "error": r.get("error")})
    write_csv(out / "predictions.csv", rows)
    print(report)
    if problems:
        print(f"{len(problems)} consistency problems (listed at the end of {out / 'summary.md'})", file=sys.stderr)


def agreement_markdown(out: Path, rerun: Path, library: str, label: Callable[[dict], str], title: str) -> str:
    """Token-for-token agreement of `library`'s records in `out` with those of the same cells in `rerun` (the same
    samples answered again under another protocol or on another device), as Markdown; `label(record)` names how
    the rerun differs (its protocol, its device). A record found in both folders as it is (a rerun's record copied
    into `out`) is no rerun and is not counted."""
    mine = {r["key"]: r for path in record_files(out, library) for r in read_jsonl(path) if r.get("error") is None}
    theirs = {r["key"]: r for path in record_files(rerun, library) for r in read_jsonl(path) if r.get("error") is None}
    rows = defaultdict(lambda: [0, 0])
    for key in sorted(set(mine) & set(theirs)):
        if mine[key] == theirs[key]:
            continue
        name = cell_name(library, theirs[key]["cell"], theirs[key]["ratio"])
        rows[name][0] += mine[key]["token_ids"] == theirs[key]["token_ids"]
        rows[name][1] += 1
    labels = ", ".join(sorted({label(r) for r in theirs.values()}))
    lines = [f"# {library}: `{out}` against the same cells rerun in `{rerun}` ({title} {labels})", "",
             "| cell | identical answer tokens |", "|---|---|"] + [f"| {k} | {v[0]}/{v[1]} |" for k, v in sorted(rows.items())]
    return "\n".join(lines) + "\n"


def rerun_agreement(out: Path, rerun: Path, library: str, label: Callable[[dict], str], title: str, filename: str) -> None:
    """`agreement_markdown`, written as `filename` into `rerun` and printed."""
    text = agreement_markdown(out, rerun, library, label, title)
    (rerun / filename).write_text(text, encoding="utf-8")
    print(text)


def protocol_check(args) -> None:
    """kvpress's records of `--out` (shared prefill) against `--pipeline` (the same samples rerun with `--protocol
    pipeline`); writes `protocol_check.md` into `--pipeline`."""
    rerun_agreement(Path(args.out), Path(args.pipeline), "kvpress", lambda r: f"{r.get('protocol')}", "protocol", "protocol_check.md")


def device_check(args) -> None:
    """kvcompress's records of `--out` against `--rerun` (the same samples and cells answered on another device,
    e.g. a GPU); writes `device_check.md` into `--rerun`."""
    rerun_agreement(Path(args.out), Path(args.rerun), "kvcompress", lambda r: r["env"].get("gpu") or r["env"]["device"], "device",
                    "device_check.md")


# ---------------------------------------------------------------- command line


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    d = sub.add_parser("dump", help="(kvcompress's venv) write the samples as prompt token ids")
    d.add_argument("--task", default="niah_single")
    d.add_argument("--length", type=int, default=2048, help="target context tokens (default 2048)")
    d.add_argument("--samples", type=int, default=30)
    d.add_argument("--seed", type=int, default=0, help="sample i uses seed + i (default 0)")
    d.add_argument("--haystack", default=None, help="the haystack of a task that takes one (niah_single: default prose here; "
                   "refused for a task that takes none)")
    d.add_argument("--kind", default=None, help="the needle values of a task that takes them (niah_single: default numbers; "
                   "refused for a task that takes none)")
    d.add_argument("--task-param", action="append", default=[], metavar="NAME=VALUE",
                   help="a parameter of the task's generator, e.g. split=tuning (niah_prose's tuning pools); repeatable")
    d.add_argument("--prompt-layout", default=None,
                   help="how context and question are joined (kvcompress.integration.model.PROMPT_LAYOUTS; default: the eval's default)")
    d.add_argument("--max-new-tokens", type=int, default=None, help="default: each sample's own answer limit")
    d.add_argument("--ratios", type=parse_ratios, default=[0.75], help="comma-separated compression ratios, each in [0, 1) (default 0.75)")
    d.add_argument("--checkpoint", default=None, help="checkpoint folder (default: the dequantised default model under ~/.cache/kvcompress)")
    for name, cells, default in (("kvcompress", KVCOMPRESS_CELLS, DEFAULT_KVCOMPRESS), ("kvpress", KVPRESS_CELLS, DEFAULT_KVPRESS)):
        s = sub.add_parser(name, help=f"({name}'s venv) answer every sample with {name}")
        s.add_argument("--cells", default=",".join(default), help=f"comma-separated cells among {list(cells)}")
        s.add_argument("--ratios", type=parse_ratios, default=None, help="comma-separated compression ratios, each in [0, 1) (default: the manifest's)")
        s.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
        s.add_argument("--device", default="cpu", help="torch device of the model and the prompts (default cpu; e.g. cuda)")
        s.add_argument("--shard", default=None, help="I/N: only samples I, I+N, ... (each shard writes its own file)")
        s.add_argument("--sample-indices", default=None,
                       help="comma-separated sample indices to answer (default: every sample); "
                            "--shard then splits these")
        s.add_argument("--full-cache-hits", action="store_true",
                       help="answer only the samples kvcompress's full cache (cell full, recorded in --out for every sample) "
                            "answered right; --shard then splits these")
        s.add_argument("--skip-checkpoint-hash", action="store_true", help="do not re-hash the checkpoint against the manifest")
        if name == "kvpress":
            s.add_argument("--protocol", choices=("shared", "pipeline"), default="shared",
                           help="shared (default): one prefill serves the full cache and every press that compresses through "
                                "BasePress's hook (KVzip keeps its own); pipeline: `with press(model)` and a prefill per press")
    pc = sub.add_parser("protocol-check", help="(either venv) kvpress answers of --out against a --protocol pipeline rerun")
    pc.add_argument("--pipeline", required=True, help="folder of the rerun (its own manifest.json and samples.jsonl)")
    dc = sub.add_parser("device-check", help="(kvcompress's venv) kvcompress answers of --out against a rerun on another device")
    dc.add_argument("--rerun", required=True, help="folder of the rerun (its own manifest.json and samples.jsonl)")
    c = sub.add_parser("compare", help="(kvcompress's venv) re-score both libraries' answers and write the paired tables")
    c.add_argument("--answers", type=int, default=6, help="samples whose answers the summary quotes (default 6)")
    for s in sub.choices.values():
        s.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default results/kvpress_side_by_side)")
    t = sub.add_parser("table", help="(kvcompress's venv) one overview of several output folders (one per context length)")
    t.add_argument("--folders", required=True, nargs="+", help="output folders, in the order of their columns")
    t.add_argument("--table", required=True, help="markdown file to write")
    t.add_argument("--default-cell", default=DEFAULT_CELL, help=f"the kvcompress cell to pair with kvpress's best press (default {DEFAULT_CELL})")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    {"dump": dump, "kvcompress": run_kvcompress, "kvpress": run_kvpress, "compare": compare, "protocol-check": protocol_check,
     "device-check": device_check, "table": table}[args.step](args)


if __name__ == "__main__":
    try:
        main()
    except SettingRefused as error:  # its one line, not a traceback (tests call main() and see the error)
        raise SystemExit(f"{Path(sys.argv[0]).name} {sys.argv[1]}: error: {error}") from None
