"""The task sweep: methods × compression ratios × modes × tasks × lengths × samples on one model.

Each sample (task, length, index, depth) is generated offline (`eval.tasks`), chat-formatted
(`integration.build_prompt`, in the sweep's prompt layout, recorded in every record and in
`config.json`) and answered greedily by `integration.generate_ids` for the full
cache and for every (method, ratio, mode) cell. A method is a registered name or `default`, the library's default
for the cell's mode (`options.DEFAULT_METHODS`); every record names the method and parameters its name resolved to
(`resolved_method`, `method_params`). In prefill mode the context is prefilled once
(`eval.capture.capture_qkv`) and that recorded prefill is compressed by every method and ratio,
each on its own copy (`generate_ids(prefill=...)`), so M methods cost one context prefill per
sample instead of M; the full cache answers from the same record with every token kept.
`reuse_prefill=False` re-prefills per cell (for the speed-up measurement). Decoding stops at the
sample's answer limit, its stop strings or EOS (`Sample.max_new_tokens`, `Sample.stop`).

Results are appended to `results.jsonl` in the output directory, one line per cell, flushed as
they are produced; a rerun with the same directory skips every cell already recorded, so an
interrupted sweep continues where it stopped. `summarize` turns the records into
`summary.csv` / `summary.md`, and `eval.plots` into PNGs.

The unit of work is one sample with all its cells (`pending_samples`, `run_sample`): its context
is prefilled once and every method answers from that prefill. `run_sweep(shard=(i, n))` runs the
i-th of n disjoint slices of the samples (n plain processes can share one output directory);
`eval.ray_sweep` runs the samples as Ray tasks. Records are appended under an exclusive file lock
and a cell already in the file is never written again. With `benchmark`/`data` the samples come
from a standard benchmark's files (`eval.benchmarks`) instead of the generated tasks.

A cell whose method cannot run at that size (e.g. its paper's default sink + window exceed the
tokens a ratio keeps) is recorded with its error message and no score, and shown as such in the summary.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import math
import platform
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..checks import as_seed, check_distinct, describe
from ..integration.model import DEFAULT_PROMPT_LAYOUT, PromptLayout, check_context_length, prompt_layout, token_ids_sha256
from ..methods.base import Method
from ..methods.registry import build_method, method_names
from ..names import DEFAULT_CHUNK_SIZE, FULL, PERPLEXITY
from ..names import SWEEP_LENGTHS as DEFAULT_LENGTHS
from ..names import SWEEP_RATIOS as DEFAULT_RATIOS
from ..names import SWEEP_SAMPLES as DEFAULT_SAMPLES
from ..options import DEFAULT, KVZIP_REFIT, MODES, NAMED_SETTINGS, CompressionOptions, block_settings, resolve_method
from ..saved_state import write_whole
from . import tables
from .benchmarks import BENCHMARKS, BenchmarkItem, load_benchmark
from .capture import capture_qkv
from .prefill_replay import full_as_ratio_zero
from .stats import PROMPT_DIGEST, paired_comparisons, wilson
from .stopping import stop_token_ids
from .tasks import GENERATORS, HAYSTACKS, NEEDLE_KINDS, TASKS, Sample, check_task_params, generate_sample, score, task_parameters

# Methods built from other methods (the library's default is AdaKV over another method's scores): compared with the best
# single method, never chosen as it.
COMPOSED = ("hybrid", DEFAULT, KVZIP_REFIT)
# A task counts as a compression result only where the full cache scores at least this.
FULL_CACHE_BAR = 0.9
# Generator arguments the sweep sets itself (not settable through task_params).
_SWEEP_ARGUMENTS = ("target_tokens", "seed", "tokenizer", "depth")
RESULTS_FILE = "results.jsonl"
DEFAULT_TASKS = TASKS
# What changes every cell's answer but not its key: a results folder holds one value of each (`check_same_run`).
_RUN_SETTINGS = ("seed", "haystack", "kind", "max_new_tokens", "chunk_size", "task_params", "benchmark", "data")
# The layout of every run made before layouts were recorded: a blank line, and the task's answer prefix.
UNRECORDED_PROMPT_LAYOUT = "blank_line_primed"


@dataclass
class SweepConfig:
    """What a sweep runs. methods: registered names, DEFAULT (the library's default for each mode) and KVZIP_REFIT (the
    prefill default before KVzap); None means DEFAULT and every registered method. ratios: the compression ratios
    each method runs at; modes: "prefill", "chunked", "decode", each method in each. lengths are context tokens.
    seed: sample i of a generated task is generated with seed `seed + i`, and randomised methods take `seed`.
    haystack and kind: the generated needles' text ("filler" or "prose") and answers ("numbers", "words", "uuids").
    include_full: also answer with the full cache (the reference every comparison pairs with). reuse_prefill: compress
    one recorded prefill per sample in every prefill-mode cell (False: every cell runs its own forwards, to measure
    the saving). chunk_size: the block size of the streaming modes.

    samples: samples per (task, length); tasks that take a depth place sample i at
    `sample_depth(i)`. grid_lengths × grid_depths: the needle heat-map (task `grid_task`, one
    sample per cell, compressed at `grid_ratios`). max_new_tokens None uses each sample's own limit
    (`Sample.max_new_tokens`); decoding also stops at the sample's stop strings and at EOS.
    prompt_layout: how each prompt joins context and question (`integration.model.PromptLayout`,
    or its name in `PROMPT_LAYOUTS`); held as a PromptLayout.

    benchmark + data: samples from a standard benchmark's files (`eval.benchmarks.BENCHMARKS`);
    tasks None takes every task in the data, samples None every row (else the first `samples`
    per task); each task's answer length is the benchmark's. lengths, haystack, kind,
    task_params and the needle grid belong to the generated tasks and must stay unset.
    """

    methods: list[str] | None = None
    ratios: list[float] = field(default_factory=lambda: list(DEFAULT_RATIOS))
    modes: list[str] = field(default_factory=lambda: ["prefill"])
    tasks: list[str] | None = None
    lengths: list[int] = field(default_factory=lambda: list(DEFAULT_LENGTHS))
    samples: int | None = DEFAULT_SAMPLES
    seed: int = 0
    haystack: str = "filler"
    kind: str = "numbers"
    grid_task: str = "niah_single"
    grid_lengths: list[int] = field(default_factory=list)
    grid_depths: list[float] = field(default_factory=list)
    grid_ratios: list[float] = field(default_factory=list)
    include_full: bool = True
    reuse_prefill: bool = True
    max_new_tokens: int | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    task_params: dict[str, dict] = field(default_factory=dict)
    benchmark: str | None = None
    data: str | None = None
    prompt_layout: PromptLayout | str = DEFAULT_PROMPT_LAYOUT

    def __post_init__(self):
        self.prompt_layout = prompt_layout(self.prompt_layout, parameter="prompt_layout")
        self.seed = as_seed(self.seed)
        if self.methods is None:
            self.methods = [DEFAULT, *method_names()]
        if self.benchmark is not None:
            self._check_benchmark()
        elif self.tasks is None:
            self.tasks = list(DEFAULT_TASKS)
        for name, values, allowed in (
            ("methods", self.methods, {DEFAULT, KVZIP_REFIT, *method_names()}),
            ("modes", self.modes, set(MODES)),
            ("tasks", [] if self.benchmark else self.tasks, set(TASKS)),
        ):
            bad = [v for v in values if v not in allowed]
            if bad:
                raise ValueError(f"{name} must be among {sorted(allowed)}, got {bad}")
        for name in ("methods", "ratios", "modes", "tasks", "lengths", "grid_lengths", "grid_depths", "grid_ratios"):
            check_distinct(name, getattr(self, name) or ())
        if self.grid_task not in GENERATORS or "depth" not in task_parameters(self.grid_task):
            raise ValueError(f"grid_task must be a task with a depth, got {self.grid_task!r}")
        for r in list(self.ratios) + list(self.grid_ratios):
            if not 0.0 <= r < 1.0:
                raise ValueError(f"ratios must lie in [0, 1), got {r}")
        for n in list(self.lengths) + list(self.grid_lengths):
            if n < 64:
                raise ValueError(f"lengths must be >= 64 tokens, got {n}")
        for d in self.grid_depths:
            if not 0.0 <= d <= 1.0:
                raise ValueError(f"grid_depths must lie in [0, 1], got {d}")
        if bool(self.grid_lengths) != bool(self.grid_depths):
            raise ValueError("grid_lengths and grid_depths go together: pass both or neither")
        if (self.samples is None and self.benchmark is None) or (self.samples is not None and self.samples < 1):
            raise ValueError(f"samples must be >= 1 (None only with a benchmark), got {self.samples}")
        if self.haystack not in HAYSTACKS:
            raise ValueError(f"haystack must be one of {HAYSTACKS}, got {self.haystack!r}")
        if self.kind not in NEEDLE_KINDS:
            raise ValueError(f"kind must be one of {NEEDLE_KINDS}, got {self.kind!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for task, params in self.task_params.items():
            if task not in GENERATORS:
                raise ValueError(f"task_params: task must be one of {TASKS}, got {task!r}")
            allowed = task_parameters(task) - set(_SWEEP_ARGUMENTS)
            bad = sorted(set(params) - allowed)
            if bad:
                raise ValueError(f"task_params[{task!r}]: parameters must be among {sorted(allowed)}, got {bad}")
            # each value's type and range, with the sweep's haystack and kind where the task takes them (as `SampleSpec.build`)
            settings = {name: getattr(self, name) for name in ("haystack", "kind") if name in allowed}
            check_task_params(task, settings | params, named=lambda name, task=task: f"task_params[{task!r}][{name!r}]")

    def _check_benchmark(self):
        if self.benchmark not in BENCHMARKS:
            raise ValueError(f"benchmark must be one of {BENCHMARKS}, got {self.benchmark!r}")
        if not self.data:
            raise ValueError(f"benchmark {self.benchmark!r} needs data: the path of its files, got {self.data!r}")
        changed = [name for name, value, default in (
            ("lengths", self.lengths, list(DEFAULT_LENGTHS)), ("haystack", self.haystack, "filler"), ("kind", self.kind, "numbers"),
            ("task_params", self.task_params, {}), ("grid_lengths", self.grid_lengths, []), ("grid_depths", self.grid_depths, []),
        ) if value != default]
        if changed:
            raise ValueError(f"{changed} belong to the generated tasks; leave them unset with benchmark {self.benchmark!r}")

    def params_of(self, task: str) -> tuple:
        """The task's `task_params` as sorted (name, value) pairs (hashable, part of the cell key)."""
        return tuple(sorted(self.task_params.get(task, {}).items()))


@dataclass(frozen=True)
class SampleSpec:
    """One generated sample: which task, length, index and (for depth tasks) depth."""

    task: str
    length: int
    index: int
    depth: float | None
    grid: bool = False
    params: tuple = ()

    @property
    def kind(self) -> str:
        """First part of the cell key: "grid" for the needle heat-map, else "task"."""
        return "grid" if self.grid else "task"

    def evaluate(self, sample: Sample, prediction: str) -> float:
        """Task score of a prediction for the built sample."""
        return score(sample, prediction)

    def record_fields(self) -> dict:
        """Fields a record of this sample has besides the common ones (none for generated tasks)."""
        return {}

    def build(self, config: SweepConfig, tokenizer) -> Sample:
        params = task_parameters(self.task)
        kwargs = {"target_tokens": self.length, "seed": config.seed + self.index, "tokenizer": tokenizer}
        if self.depth is not None:
            kwargs["depth"] = self.depth
        for name in ("haystack", "kind"):
            if name in params:
                kwargs[name] = getattr(config, name)
        kwargs.update(self.params)
        return generate_sample(self.task, **kwargs)


@dataclass(frozen=True)
class Cell:
    """One answer to produce: a sample under a method (FULL for the full cache), ratio and mode."""

    sample: SampleSpec
    method: str
    ratio: float | None
    mode: str

    @property
    def key(self) -> str:
        s = self.sample
        task = s.task + "".join(f";{k}={v}" for k, v in s.params)
        return f"{s.kind}|{task}|{s.length}|{s.index}|{s.depth}|{self.method}|{self.ratio}|{self.mode}"


def sample_of(record: dict) -> str:
    """The sample part of a record's cell key (kind, task with its parameters, length, index, depth): the key without
    its method, ratio and mode, which every cell of one sample shares."""
    return record["key"].removesuffix(f"|{record['method']}|{record['ratio']}|{record['mode']}")


def check_task_settings(tasks: list[str], **given) -> None:
    """Refuse a generated-task setting (`haystack`, `kind`: the name and the value given, None when not given) that
    no task of `tasks` takes: it would change nothing. ValueError naming the setting, the tasks run and those it
    applies to."""
    for name, value in given.items():
        if value is None or any(name in task_parameters(t) for t in tasks):
            continue
        takers = [t for t in TASKS if name in task_parameters(t)]
        raise ValueError(f"{name}={value!r} applies to the tasks {', '.join(takers)} and none of them is run "
                         f"(tasks {', '.join(tasks)}): leave {name} unset")


def sample_depth(index: int) -> float:
    """Depth of sample `index` for tasks that take one: 0.5, then a golden-ratio sequence that spreads
    over [0, 1] and does not depend on how many samples the sweep has (so a sweep can be extended)."""
    return round((0.5 + index * 0.6180339887498949) % 1.0, 3)


def sample_specs(config: SweepConfig) -> list[SampleSpec] | list[BenchmarkItem]:
    """Every sample of the sweep, sample-major (a partial run covers every task and length), then the needle grid.

    With a benchmark: its items, in file order.
    """
    if config.benchmark is not None:
        return load_benchmark(config.benchmark, config.data, config.tasks, config.samples)
    specs = []
    for i in range(config.samples):
        for length in config.lengths:
            for task in config.tasks:
                takes_depth = "depth" in task_parameters(task)
                specs.append(SampleSpec(task, length, i, sample_depth(i) if takes_depth else None, params=config.params_of(task)))
    for i, length in enumerate(config.grid_lengths):
        for j, depth in enumerate(config.grid_depths):
            specs.append(SampleSpec(config.grid_task, length, i * len(config.grid_depths) + j, depth, grid=True,
                                    params=config.params_of(config.grid_task)))
    return specs


def cells_for(spec: SampleSpec, config: SweepConfig) -> list[Cell]:
    """The full cache (once) and every method × ratio × mode for one sample."""
    ratios = config.grid_ratios if spec.grid else config.ratios
    cells = [Cell(spec, FULL, None, "-")] if config.include_full else []
    cells += [Cell(spec, m, r, mode) for mode in config.modes for m in config.methods for r in ratios]
    return cells


def read_results(path: Path) -> list[dict]:
    """Records of a results JSONL file, or of its gzip-compressed copy (a path ending in `.gz`: committed records
    are kept compressed). A last line cut short by an interruption (no newline after it) is ignored, so the run
    resumes; an undecodable line anywhere else is a ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        return []
    data = path.read_bytes()
    return _parse_lines(gzip.decompress(data) if path.suffix == ".gz" else data, path)


def _answer(model, cell: Cell, context_ids, question_ids, captured, config: SweepConfig, max_new: int, stop_ids, tokenizer,
            reconstructions: dict | None = None):
    """The cell's generation; the full cache is answered from the recorded prefill when there is one
    (every token kept exactly, `prefill_replay.full_as_ratio_zero`), so it costs no second prefill. A method
    scored by reconstruction (KVzip), with the repeat instruction `tokenizer` renders, is loaded from the sample's
    recorded reconstruction when `reconstructions` is given ({chunk size: `RecordedReconstruction`}, filled at first
    use), else reconstructs the context itself."""
    from ..integration import generate_ids
    from ..integration.reconstruction import shared_reconstruction, with_repeat_prompt

    if cell.method == FULL and captured is None:
        return generate_ids(model, context_ids, question_ids, method=None, max_new_tokens=max_new, stop_token_ids=stop_ids)
    if cell.method == FULL:
        method, ratio = full_as_ratio_zero(None, 0.0)
        return generate_ids(model, context_ids, question_ids, method=method, compression_ratio=ratio, prefill=captured,
                            max_new_tokens=max_new, stop_token_ids=stop_ids)
    size = {"compression_ratio": cell.ratio} if cell.mode == "prefill" else {"budget": stream_budget(cell.method, cell.ratio, context_ids.shape[1])}
    options = CompressionOptions(method=cell.method, mode=cell.mode, seed=config.seed, **block_settings(cell.mode, config.chunk_size), **size)
    if options.compressor.requirements.needs("reconstruction"):  # KVzip: the context's prefill and reconstruction forward
        options = with_repeat_prompt(options, tokenizer)
        recorded = None if reconstructions is None else shared_reconstruction(model, options, context_ids, reconstructions)
        return generate_ids(model, context_ids, question_ids, options, max_new_tokens=max_new, stop_token_ids=stop_ids,
                            prefill=recorded)
    return generate_ids(model, context_ids, question_ids, options, max_new_tokens=max_new, stop_token_ids=stop_ids,
                        prefill=captured if cell.mode == "prefill" else None)


def _recording_kind(cell: Cell, method: Method | None) -> bool | None:
    """Which recorded prefill a cell (running `method`, None for the full cache) answers from: None (its own
    forwards: streamed modes, KVzip's reconstruction, a method that reads the layers' hidden states, which a
    recording does not keep), True (one recorded with the attention mass its method scores by, H2O's) or False (the
    model's own attention).

    A method scored by attention mass records the prefill through `causal_attention_with_mass`, whose rounding
    differs from the model's attention; keeping the two recordings apart makes every cell answer as it would
    alone, whatever other methods share the sample."""
    if cell.method == FULL:
        return False
    if cell.mode != "prefill":
        return None
    needs = method.requirements
    return needs.needs("attention_mass") if needs.compresses_a_recorded_prefill else None


def _resolved(cell: Cell) -> tuple[str, dict, dict] | None:
    """`resolve_method` of a (not full) cell's method name in its mode; None for a named setting with no method in that
    mode (`kvzip_refit` streamed), whose cell records the refusal when it runs, as a prefill-only method's streamed
    cell does (the whole run failed before its first cell)."""
    try:
        return resolve_method(cell.method, cell.mode)
    except ValueError:
        return None


def _method_of(cell: Cell) -> Method | None:
    """The method a (not full) cell runs, its name resolved for its mode (the default: the mode's default method); None
    where the name has none in that mode (`_resolved`)."""
    resolved = _resolved(cell)
    return None if resolved is None else build_method(resolved[0], **resolved[1])


def stream_budget(method: str, ratio: float, n_tokens: int) -> int:
    """Middle budget a streamed (chunked/decode) cache gets: what `ratio` keeps of n_tokens, less the method's
    sink and window (the prefill-mode budget), refused when below what the method's stream accepts. In full-precision
    tokens: a method whose budget is read as memory (the default) turns it into its quantized slots per layer."""
    return CompressionOptions(method=method, compression_ratio=ratio, mode="chunked").token_budget_for(n_tokens)


class ResultsFile:
    """The sweep's results JSONL, appended one whole line at a time under an exclusive lock.

    Several writers (shards, the Ray driver) may share it. Under the lock each writer first reads
    what the others appended since its last write, so `write` skips a cell whose key is already in
    the file and no cell is ever recorded twice. A record whose sample is already in the file from
    another prompt (`PROMPT_DIGEST`: another Python's text, another kvcompress's generator) is refused,
    so every cell of a sample pairs with the others on the same prompt. A last line torn by an interrupted writer (no
    newline after it) is cut off before the next record is appended, so every line before the last
    is a whole record, and an undecodable one is corruption (`_parse_lines`).
    """

    def __init__(self, path: Path):
        self.path = path
        self.path.touch()
        self._done: set[str] = set()
        self._prompts: dict[str, str] = {}  # sample (`sample_of`) -> the prompt digest its first record holds
        self._offset = 0
        self._lines = 0  # whole lines read so far

    def _catch_up(self, f) -> int:
        """Read the whole records appended since the last call; return the length of a torn last line (0: none)."""
        f.seek(self._offset)
        tail = f.read()
        whole = tail.rfind(b"\n") + 1
        for r in _parse_lines(tail[:whole], self.path, self._lines + 1):
            self._done.add(r["key"])
            if r.get(PROMPT_DIGEST) is not None:  # the file's own prompts, as they are (a sample's first digest stands)
                self._prompts.setdefault(sample_of(r), r[PROMPT_DIGEST])
        self._offset += whole
        self._lines += tail.count(b"\n")
        return len(tail) - whole

    def keys(self) -> set[str]:
        """Keys of every record now in the file."""
        with self.path.open("rb") as f:
            fcntl.flock(f, fcntl.LOCK_SH)
            try:
                self._catch_up(f)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return set(self._done)

    def write(self, records: list[dict]) -> int:
        """Append the records whose keys are not yet in the file; return how many were written. ValueError, writing
        none, when one's sample is in the file from another prompt."""
        with self.path.open("r+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                if self._catch_up(f):
                    f.truncate(self._offset)
                fresh = [r for r in records if r["key"] not in self._done]
                prompts = self._prompts_with(fresh)
                f.seek(self._offset)
                f.write("".join(json.dumps(r) + "\n" for r in fresh).encode())
                f.flush()
                self._offset = f.tell()
                self._done.update(r["key"] for r in fresh)
                self._prompts = prompts
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return len(fresh)

    def _prompts_with(self, records: list[dict]) -> dict[str, str]:
        """The file's prompt digests per sample with those of `records` added; ValueError naming the sample when one of
        `records` answered another prompt than the file's, or than a record before it, for its sample."""
        prompts = dict(self._prompts)
        for record in records:
            digest = record.get(PROMPT_DIGEST)
            if digest is None:
                continue
            sample = sample_of(record)
            recorded = prompts.setdefault(sample, digest)
            if digest != recorded:
                raise ValueError(
                    f"{self.path} holds sample {sample!r} answered from another prompt (token ids' sha256 {recorded[:12]}..., "
                    f"this run's {digest[:12]}...): the sample's text changed (the prose tasks read the standard library of "
                    f"the Python that builds them, here {platform.python_version()}; config.json names the Python of the "
                    "folder's latest run), so its cells would not pair; continue that folder with the Python and kvcompress "
                    "that began it, or write to a new folder (--out)")
        return prompts


def _parse_lines(text: bytes, path: Path, first_line: int = 1) -> list[dict]:
    """JSON records of the whole lines of a JSONL text from `path`, its first line numbered `first_line` (a
    last line with no newline after it is torn: skipped); an undecodable whole line is a ValueError naming it."""
    lines = text.split(b"\n")
    records = []
    for number, line in enumerate(lines[:-1], first_line):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(
                f"{path}: line {number} is not a JSON record ({err}); only a torn last line is "
                "expected after an interruption: repair or remove that line, or start a new --out folder"
            ) from None
    return records


def pending_samples(config: SweepConfig, out_dir: str | Path, shard: tuple[int, int] | None = None,
                    model_name: str = "", dtype: str | None = None) -> tuple[ResultsFile, list[tuple]]:
    """The results file of `out_dir` and every (sample, cells not yet recorded) of the sweep (or of its shard).

    shard (i, n): only the samples at positions p with p % n == i, so n processes split the
    samples (with all their cells) without overlap. Writes `out_dir/config.json` (the config,
    model name and dtype, host, shard, start time).
    """
    specs = shard_specs(sample_specs(config), shard)
    out, results = open_run(out_dir)
    done = results.keys()
    check_results_folder(config, out, model_name, dtype)
    write_run_config(out, config, model_name, shard, dtype=dtype)
    todo = [(spec, [c for c in cells_for(spec, config) if c.key not in done]) for spec in specs]
    return results, [(spec, cells) for spec, cells in todo if cells]


def shard_specs(specs: list, shard: tuple[int, int] | None) -> list:
    """The samples of shard (i, n) of `specs`: those at positions p with p % n == i (all of them for shard None). A
    shard that gets none is a ValueError: the sweep has fewer samples than shards."""
    if shard is None:
        return specs
    if not (isinstance(shard, tuple) and len(shard) == 2 and all(isinstance(v, int) for v in shard) and 0 <= shard[0] < shard[1]):
        raise ValueError(f"shard must be (i, n) with 0 <= i < n, got {shard!r}")
    mine = specs[shard[0]::shard[1]]
    if not mine:
        raise ValueError(f"shard {shard[0]}/{shard[1]} gets no sample: the sweep has {len(specs)} (give N <= {len(specs)})")
    return mine


def check_lengths_fit(model, lengths, setting: str = "lengths") -> None:
    """Refuse, before any sample runs, context lengths longer than `model` takes (its `max_position_embeddings`),
    naming `setting` and the model's limit: such a sample's prompt could only be refused after its context's prefill."""
    limit = getattr(model.config, "max_position_embeddings", None)
    over = sorted({n for n in lengths if limit is not None and n > limit})
    if over:
        raise ValueError(f"{setting} {', '.join(map(str, over))} exceed{'s' if len(over) == 1 else ''} the {limit} positions the "
                         f"model takes (max_position_embeddings): give lengths of at most {limit} tokens (a task's question "
                         "and answer take some of them too)")


def any_streams(modes) -> bool:
    """Whether a run of `modes` streams a prompt (chunked or decode mode), so that its block size (`chunk_size`) acts."""
    return any(mode != "prefill" for mode in modes)


def dtype_name(dtype: torch.dtype) -> str:
    """A model's dtype as a results folder records it ("float32")."""
    return str(dtype).removeprefix("torch.")


def open_run(out_dir: str | Path) -> tuple[Path, ResultsFile]:
    """(the results folder, created if missing; its results file) of a run."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out, ResultsFile(out / RESULTS_FILE)


def named_settings_of(methods: list[str]) -> dict[str, dict]:
    """What each name of `NAMED_SETTINGS` among `methods` (DEFAULT, KVZIP_REFIT) stands for in each mode, as JSON holds it:
    a results folder keys such a cell by the name, so a run in which the name stands for another method or setting (another
    version of kvcompress) must not add to its cells (`check_same_run`)."""
    return json.loads(json.dumps({name: NAMED_SETTINGS[name] for name in methods if name in NAMED_SETTINGS}))


def write_run_config(out: Path, config, model_name: str, shard: tuple[int, int] | None, **extra) -> None:
    """`out/config.json`: `extra`, the latest run's config (a dataclass with `methods` and `modes`; a run that streams
    nothing keeps the block size recorded before, which it does not use), what the named settings among the
    methods of every run into the folder stand for (`named_settings_of`, merged with those recorded before, so that a
    later run is checked against each), model name, host, Python version (the prose tasks' text is its standard
    library's), the versions of kvcompress, torch and transformers, threads, shard and start time. Written whole or not at all
    (a shard beside it may be reading it)."""
    path = out / "config.json"
    earlier = read_run_config(path)
    settings = asdict(config)
    if not any_streams(config.modes) and "chunk_size" in earlier.get("config", {}):
        settings["chunk_size"] = earlier["config"]["chunk_size"]  # unused by this run: the streamed cells' stays the folder's
    named = earlier.get("named_settings", {}) | named_settings_of(config.methods)
    meta = extra | {"config": settings, "named_settings": named, "model": model_name, "host": platform.node(),
                    "python": platform.python_version(), "versions": _versions(),
                    "threads": torch.get_num_threads(), "shard": shard,
                    "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    write_whole(path, json.dumps(meta, indent=1).encode())


def _versions() -> dict:
    """The versions of kvcompress (None for a source tree imported without being installed), torch and transformers."""
    import transformers

    import kvcompress

    return {"kvcompress": getattr(kvcompress, "__version__", None), "torch": torch.__version__, "transformers": transformers.__version__}


def read_run_config(path: Path) -> dict:
    """A results folder's `config.json` (what `write_run_config` wrote), {} where there is none yet; a file that is not a JSON
    object is refused, naming it."""
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{str(path)!r} is not the JSON of a run's settings ({err}): restore it, or write to a new folder (--out)") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config", {}), dict):
        raise ValueError(f"{str(path)!r} is not the JSON of a run's settings (an object with a 'config' object), got "
                         f"{describe(meta)}: restore it, or write to a new folder (--out)")
    return meta


def check_results_folder(config: SweepConfig, out_dir: str | Path, model_name: str = "", dtype: str | None = None) -> None:
    """Refuse to add this sweep's records to `out_dir` when the run already there was another kind of run (perplexity),
    or used another prompt layout, setting (`check_same_run`; the block size only where this sweep streams), model or
    dtype; a folder with no run yet takes any. The command line checks this before loading the model."""
    path = Path(out_dir) / "config.json"
    check_same_run(path, {name: getattr(config, name) for name in _RUN_SETTINGS
                          if name != "chunk_size" or any_streams(config.modes)}, model_name, config.methods,
                   dtype=dtype)
    _check_prompt_layout(path, config.prompt_layout)


def check_same_run(path: Path, settings: dict, model_name: str = "", methods: list[str] = (), task: str | None = None,
                   dtype: str | None = None) -> None:
    """Refuse to add records to a results folder whose earlier run (its `config.json`, `path`) was of another kind (task:
    None for the task sweep, PERPLEXITY for the perplexity run: their records and summaries differ) or recorded other
    values of `settings` (those that change every cell's answer, which the cells' keys leave out: a cell recorded under
    the old value would not run again), another model or dtype (its numbers differ: a float32 full cache's bytes are
    twice a bfloat16 cell's), or another meaning of a named setting among `methods`
    (`named_settings_of`: the library's default of another version); what the earlier run did not record is not
    compared. The benchmark's data (`data`) is compared as the place it names, however the path was written."""
    if not path.is_file():
        return
    meta = read_run_config(path)
    if meta.get("task") != task:
        kinds = {None: "task sweep", PERPLEXITY: "perplexity run (--tasks perplexity)"}
        raise ValueError(f"{path.parent} holds the records of a {kinds.get(meta.get('task'), meta.get('task'))}, which a "
                         f"{kinds.get(task, task)} must not add to (their records and summaries differ): write to another "
                         "folder (--out)")
    earlier = meta.get("config", {})
    changed = [f"{name} (--{name.replace('_', '-')}) {_shown(value)}, there {_shown(earlier[name])}"
               for name, value in json.loads(json.dumps(settings)).items() if name in earlier and not _same_setting(name, value, earlier[name])]
    recorded = meta.get("named_settings", {})
    changed += [f"method {name!r} (--methods) stands for {value!r} in this kvcompress, there for {recorded[name]!r}"
                for name, value in named_settings_of(methods).items() if name in recorded and recorded[name] != value]
    if model_name and meta.get("model") and meta["model"] != model_name:
        changed.append(f"model (--model) {model_name!r}, there {meta['model']!r}")
    if dtype and meta.get("dtype") and meta["dtype"] != dtype:
        changed.append(f"dtype (--dtype) {dtype!r}, there {meta['dtype']!r}")
    if changed:
        raise ValueError(f"{path.parent} holds the results of another run: {'; '.join(changed)}. Rerun with that run's settings to "
                         "continue it, or write to a new folder")


def _shown(value) -> str:
    """A setting's value as a refusal shows it: None (left to each task, or not given) as "not given"."""
    return "not given" if value is None else repr(value)


def _same_setting(name: str, value, earlier) -> bool:
    """Whether a run's setting equals the one recorded: the benchmark's data as the place its path names (a run records
    it absolute; an earlier one may have recorded it as typed, relative to where it ran)."""
    if name == "data" and isinstance(value, str) and isinstance(earlier, str):
        return Path(value).resolve() == Path(earlier).resolve()
    return value == earlier


def _check_prompt_layout(path: Path, layout: PromptLayout) -> None:
    """Refuse to add records in `layout` to a results folder whose earlier run (its `config.json`) used another."""
    if not path.is_file():
        return
    recorded = read_run_config(path).get("config", {}).get("prompt_layout", UNRECORDED_PROMPT_LAYOUT)
    earlier = prompt_layout(PromptLayout(**recorded) if isinstance(recorded, dict) else recorded)
    if earlier != layout:
        raise ValueError(f"prompt_layout {layout.name!r} differs from {earlier.name!r}, the layout of the results already in "
                         f"{path.parent}; give that layout ({earlier.name!r}) to continue that run, or write to a new folder")


def run_sample(model, tokenizer, config: SweepConfig, spec, cells: list[Cell], log=print) -> Iterator[dict]:
    """Answer every cell of one sample, yielding one record per cell as it is produced.

    The context is prefilled once (prefill mode) and every method compresses a copy of that
    prefill (a second one, through `causal_attention_with_mass`, serves the methods scored by
    attention mass: `_recording_kind`); each record's `capture_s` is the time of the sample's
    recordings, 0 for a cell that used none. Methods scored by reconstruction (KVzip) share one
    reconstruction of the context instead, recorded by the first of them (in its `wall_s`) and counted in each one's `compress_s`. With
    `config.reuse_prefill` False every cell runs its own forwards. A cell whose method cannot run at
    this size is recorded with its error (and `log`ged).
    """
    from ..integration import build_prompt

    sample = spec.build(config, tokenizer)
    max_new = config.max_new_tokens or sample.max_new_tokens
    context_ids = prompt = None
    try:  # a prompt every cell would refuse (a special token's text in it, too long for the model): before any prefill
        context_ids, question_ids = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix, config.prompt_layout)
        prompt = token_ids_sha256(context_ids, question_ids)
        check_context_length(model, context_ids.shape[1] + question_ids.shape[1], max_new)
    except ValueError as err:
        for cell in cells:
            record = _record(cell, sample, context_ids, 0.0, config.prompt_layout, prompt)
            record |= {"error": f"{type(err).__name__}: {err}", "wall_s": 0.0}
            log(f"[{cell.key}] {record['error']}")
            yield record
        return
    stop_ids = stop_token_ids(tokenizer, sample.stop)
    methods = {cell.key: _method_of(cell) for cell in cells if cell.method != FULL}
    kinds = {cell.key: _recording_kind(cell, methods.get(cell.key)) if config.reuse_prefill else None for cell in cells}
    recordings, start = {}, time.perf_counter()
    for with_mass in sorted({kind for kind in kinds.values() if kind is not None}):
        recordings[with_mass] = capture_qkv(model, context_ids, attention_mass=with_mass)
    capture_s = time.perf_counter() - start
    reconstructions = {} if config.reuse_prefill else None
    for cell in cells:
        record = _record(cell, sample, context_ids, capture_s if kinds[cell.key] is not None else 0.0, config.prompt_layout, prompt)
        start = time.perf_counter()
        try:
            captured = recordings.get(kinds[cell.key])
            res = _answer(model, cell, context_ids, question_ids, captured, config, max_new, stop_ids, tokenizer, reconstructions)
        except (ValueError, RuntimeError) as err:
            record["error"] = f"{type(err).__name__}: {err}"
            log(f"[{cell.key}] {record['error']}")
        else:
            prediction = tokenizer.decode(res.token_ids, skip_special_tokens=True).strip()
            record.update(
                prediction=prediction, score=spec.evaluate(sample, prediction), kv_bytes=res.kv_bytes, kv_bytes_full=res.kv_bytes_full,
                prefill_s=res.prefill_seconds, compress_s=res.compress_seconds, decode_s=res.decode_seconds,
                new_tokens=len(res.token_ids), kv_bits=res.kv_bits,
            )
        record["wall_s"] = time.perf_counter() - start
        yield record


def run_sweep(model, tokenizer, config: SweepConfig, out_dir: str | Path, progress: bool = True, model_name: str = "",
              shard: tuple[int, int] | None = None) -> list[dict]:
    """Run every cell not yet in `out_dir/results.jsonl` (of shard (i, n) only, if given), appending
    one record per cell as it finishes; return all records of the file."""
    if config.benchmark is None:
        check_lengths_fit(model, config.lengths)
        check_lengths_fit(model, config.grid_lengths, "grid_lengths")
    results, todo = pending_samples(config, out_dir, shard, model_name, dtype_name(next(model.parameters()).dtype))
    bar = tqdm(total=sum(len(cells) for _, cells in todo), desc="eval", unit="cell", disable=not progress)
    for spec, cells in todo:
        for record in run_sample(model, tokenizer, config, spec, cells, log=bar.write):
            results.write([record])
            bar.update(1)
    bar.close()
    return read_results(results.path)


def _record(cell: Cell, sample: Sample, context_ids, capture_s: float, layout: PromptLayout, prompt: str | None) -> dict:
    """A cell's record before it runs; context_ids and prompt (its digest) are None for a prompt that could not be built."""
    s = cell.sample
    return s.record_fields() | {
        "key": cell.key, "grid": s.grid, "task": s.task, "length": s.length, "index": s.index, "depth": s.depth,
        "measured_depth": sample.depth, "context_tokens": None if context_ids is None else int(context_ids.shape[1]), "method": cell.method,
        "ratio": cell.ratio, "mode": cell.mode, "answers": sample.answers, "prediction": None, "score": None,
        "error": None, "capture_s": capture_s,
        "prompt_layout": layout.name, PROMPT_DIGEST: prompt,
    } | ({} if cell.method == FULL else _resolved_fields(cell))


def _resolved_fields(cell: Cell) -> dict:
    """What a cell's method name stood for when it ran: the registered method, its parameters and any cache settings
    (sink, window, slack) the name fixes (for the default, whatever `options.DEFAULT_METHODS` held then); None and {}
    where the name has none in the cell's mode."""
    resolved = _resolved(cell)
    if resolved is None:
        return {"resolved_method": None, "method_params": {}}
    name, params, settings = resolved
    return {"resolved_method": name, "method_params": params | settings}


def _rows(records: list[dict], grid: bool) -> Iterator[dict]:
    return (r for r in records if r["grid"] == grid)


def _mean_sem(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def aggregate(records: list[dict], grid: bool = False, by: tuple[str, ...] = ("method", "ratio", "mode", "task", "length")) -> list[dict]:
    """Mean score, its standard error and 95% Wilson interval (ci_low, ci_high) per group of `by`,
    with the count of errored cells and the mean wall time per answered cell."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in _rows(records, grid):
        groups[tuple(r[k] for k in by)].append(r)
    out = []
    for key, rs in groups.items():
        answered = [r for r in rs if r["error"] is None]
        scores = [r["score"] for r in answered]
        mean, sem = _mean_sem(scores) if scores else (float("nan"), float("nan"))
        low, high = wilson(sum(scores), len(scores))
        wall = sum(r["wall_s"] for r in answered) / len(answered) if answered else float("nan")
        out.append(dict(zip(by, key)) | {"n": len(scores), "errors": len(rs) - len(scores), "score": mean, "sem": sem,
                                         "ci_low": low, "ci_high": high, "wall_s": wall})
    return sorted(out, key=_order)


def _order(row: dict) -> tuple:
    """Full cache first, then by method, ratio, mode, task (in TASKS order), length, depth."""
    task = row.get("task")
    return (row["method"] != FULL, row["method"], row.get("ratio") or 0.0, row.get("mode", ""),
            TASKS.index(task) if task else 0, row.get("length", 0), row.get("depth") or 0.0)


def _fmt(row: dict | None) -> str:
    """Score % with its 95% Wilson interval, e.g. `83 (66–93)`."""
    if row is None:
        return ""
    if row["n"] == 0:
        return "n/a"
    return f"{100 * row['score']:.0f} ({100 * row['ci_low']:.0f}–{100 * row['ci_high']:.0f})" + ("*" if row["errors"] else "")


def cell_label(method: str, ratio, mode: str, modes) -> str:
    """A cell's name in tables: 'full cache', or 'method @ ratio', with its mode where the run has several."""
    if method == FULL:
        return "full cache"
    label = f"{method} @ {ratio:g}"
    return label + (f" ({mode})" if len(modes) > 1 else "")


def beyond_model(records: list[dict]) -> list[str]:
    """Tasks whose full-cache score is below FULL_CACHE_BAR: too hard for the model, so their
    compressed scores say nothing about compression (left out of the summary's averages)."""
    full = aggregate(records, by=("method", "task"))
    return [a["task"] for a in full if a["method"] == FULL and a["n"] and a["score"] < FULL_CACHE_BAR]


def score_table(records: list[dict]) -> str:
    """Task-sweep scores (%, with 95% Wilson intervals) per method@ratio: one column per task (mean over
    lengths) and per length (mean over tasks). Tasks in `beyond_model` are marked † and left out of the
    per-length and "all" columns."""
    rows = [r for r in _rows(records, False)]
    if not rows:
        return ""
    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    lengths = sorted({r["length"] for r in rows})
    modes = sorted({r["mode"] for r in rows if r["method"] != FULL})
    hard = beyond_model(records)
    kept = [r for r in records if r["task"] not in hard]
    by_task = {(a["method"], a["ratio"], a["mode"], a["task"]): a for a in aggregate(records, by=("method", "ratio", "mode", "task"))}
    by_len = {(a["method"], a["ratio"], a["mode"], a["length"]): a for a in aggregate(kept, by=("method", "ratio", "mode", "length"))}
    overall = {(a["method"], a["ratio"], a["mode"]): a for a in aggregate(kept, by=("method", "ratio", "mode"))}
    head = ["method @ ratio"] + [t + ("†" if t in hard else "") for t in tasks] + [f"{n} tok" for n in lengths] + ["all"]
    table = []
    for a in aggregate(records, by=("method", "ratio", "mode")):
        k = (a["method"], a["ratio"], a["mode"])
        cells = [_fmt(by_task.get(k + (t,))) for t in tasks] + [_fmt(by_len.get(k + (n,))) for n in lengths] + [_fmt(overall.get(k))]
        table.append(dict(zip(head, [cell_label(*k, modes)] + cells)))
    lines = [tables.markdown_table(table, head)]
    if hard:
        lines += ["", f"† full cache below {FULL_CACHE_BAR:.0%}: the task is beyond this model, so it is not a compression "
                  "result; it is left out of the per-length and \"all\" columns."]
    return "\n".join(lines)


def paired_table(records: list[dict]) -> str:
    """Each method against the best single method of its (ratio, mode, task) on the same samples (exact sign test)."""
    singles = sorted({r["method"] for r in records} - {FULL, *COMPOSED})
    rows = paired_comparisons(records, singles)
    if not rows:
        return ""
    modes = sorted({r["mode"] for r in rows})
    table = [{
        "method @ ratio": cell_label(r["method"], r["ratio"], r["mode"], modes), "task": r["task"], "best single method": r["baseline"],
        "pairs": r["n_pairs"], "method %": f"{100 * r['method_score']:.0f}", "best %": f"{100 * r['baseline_score']:.0f}",
        "wins": r["wins"], "losses": r["losses"], "p (sign test)": f"{r['p']:.3g}",
    } for r in sorted(rows, key=lambda r: (r["ratio"], r["mode"], TASKS.index(r["task"]), r["method"] not in COMPOSED, r["method"]))]
    return tables.markdown_table(table)


def wall_table(records: list[dict]) -> str:
    """Mean wall time, decode time and decoded tokens per answered cell, per task and length (full cache apart)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in _rows(records, False):
        if r["error"] is None:
            groups[(r["task"], r["length"], r["method"] == FULL)].append(r)
    if not groups:
        return ""
    table = []
    for (task, length, full), rs in sorted(groups.items(), key=lambda kv: (TASKS.index(kv[0][0]), kv[0][1], not kv[0][2])):
        tokens = [r["new_tokens"] for r in rs if "new_tokens" in r]
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        table.append({"task": f"{task}{' (full cache)' if full else ''}", "tokens": length, "cells": len(rs),
                      "wall s": f"{mean([r['wall_s'] for r in rs]):.2f}", "decode s": f"{mean([r['decode_s'] for r in rs]):.2f}",
                      "decoded tokens": f"{mean(tokens):.1f}" if tokens else "not recorded"})
    return tables.markdown_table(table)


def heatmap_table(records: list[dict]) -> str:
    """Needle-grid scores (%) per method@ratio and length, one column per depth."""
    agg = aggregate(records, grid=True, by=("method", "ratio", "mode", "length", "depth"))
    if not agg:
        return ""
    depths = sorted({a["depth"] for a in agg})
    modes = sorted({a["mode"] for a in agg if a["method"] != FULL})
    table: dict[tuple, dict] = defaultdict(dict)
    for a in agg:
        table[(a["method"], a["ratio"], a["mode"], a["length"])][a["depth"]] = a
    head = ["method @ ratio", "tokens"] + [f"depth {d:g}" for d in depths]
    rows = [dict(zip(head, [cell_label(method, ratio, mode, modes), length] + [_fmt(row.get(d)) for d in depths]))
            for (method, ratio, mode, length), row in table.items()]
    return tables.markdown_table(rows, head)


def _default_resolutions(records: list[dict]) -> str:
    """What the `default` cells ran in each mode, e.g. "prefill: adakv(scorer=kvzip, window=0)" ("" without such cells)."""
    seen = {(r["mode"], r.get("resolved_method", "not recorded"), tuple(sorted(r.get("method_params", {}).items())))
            for r in records if r["method"] == DEFAULT}
    return "; ".join(f"{mode}: {name}({', '.join(f'{k}={v}' for k, v in params)})"
                     for mode, name, params in sorted(seen, key=lambda s: (MODES.index(s[0]), s[1:])))


def write_summary(records: list[dict], out_dir: str | Path) -> tuple[Path, Path]:
    """`summary.csv` (one row per method, ratio, mode, task, length; and the grid cells) and `summary.md`."""
    out = Path(out_dir)
    csv_path, md_path = out / "summary.csv", out / "summary.md"
    fields = ["kind", "method", "ratio", "mode", "task", "length", "depth", "n", "errors", "score", "sem", "ci_low", "ci_high", "wall_s"]
    kinds = (("task", False, ("method", "ratio", "mode", "task", "length")), ("grid", True, ("method", "ratio", "mode", "task", "length", "depth")))
    tables.write_csv(csv_path, [{"kind": kind, "depth": ""} | row for kind, grid, by in kinds for row in aggregate(records, grid=grid, by=by)],
                     fields)
    captures = {}
    for r in records:  # a sample's recorded prefills, timed once in every cell that answered from them
        key = (r["grid"], r["task"], r["length"], r["index"], r["depth"])
        captures[key] = max(captures.get(key, 0.0), r["capture_s"])
    wall = sum(r["wall_s"] for r in records) + sum(captures.values())
    n_err = sum(r["error"] is not None for r in records)
    layouts = sorted({r.get("prompt_layout", f"not recorded ({UNRECORDED_PROMPT_LAYOUT})") for r in records})
    parts = [f"{len(records)} cells ({n_err} could not run), {wall / 3600:.2f} h of recorded wall time "
             f"(context captures {sum(captures.values()) / 3600:.2f} h). Prompt layout: {', '.join(layouts)}.", ""]
    resolved = _default_resolutions(records)
    if resolved:
        parts += [f"`{DEFAULT}` is the library's default method, here: {resolved}.", ""]
    table = score_table(records)
    if table:
        parts += ["### Task scores (%, 95% Wilson interval)", "", table, "",
                  "A task scored in part (a share of its answers found) enters the interval as that many successes: an "
                  "approximation there, exact for 0/1 scores.", ""]
    paired = paired_table(records)
    if paired:
        parts += ["### Paired comparison with the best single method (same samples)", "",
                  "wins / losses: samples where the method scores above / below the best single method of its "
                  "ratio and task (the one with the highest mean there); p: exact two-sided sign test "
                  "(McNemar's exact test for 0/1 scores).", "", paired, ""]
    walls = wall_table(records)
    if walls:
        parts += ["### Wall time per cell (s, mean over answered cells; decoded tokens)", "", walls, ""]
    grid = heatmap_table(records)
    if grid:
        parts += ["### Needle grid (%)", "", grid, ""]
    if any(r["error"] for r in records):
        parts += ["`*`: some cells of this entry could not run (the error is in results.jsonl); `n/a`: none could.", ""]
    md_path.write_text("\n".join(parts), encoding="utf-8")
    return csv_path, md_path
