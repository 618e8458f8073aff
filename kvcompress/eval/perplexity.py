"""Language modelling under compression: the perplexity protocol of StreamingLLM and H2O as an eval task.

Documents (`prose_document`): real prose that ships offline, the prose paragraphs of the Python
language reference (`eval.capture.prose_paragraphs`, 536 paragraphs, about 31k tokens with the
default SmolLM2 tokenizer). Document i of a seed is the run of consecutive paragraphs (joined by
blank lines, wrapping from the last paragraph to the first) that starts at paragraph
floor(((u + i·0.618...) mod 1)·P), with u = random.Random(seed).random() and P the number of
paragraphs, tokenised with the model's tokenizer (its special tokens included) and cut to exactly
the target length. Starts follow golden-ratio steps around the paragraph cycle, so any number of
documents is spread evenly over the text, document i never depends on how many documents a run
has (raising the count extends a run), and up to a few hundred documents all start at different
paragraphs (seed 0, 30 documents of 2048 SmolLM2 tokens: all 30 differ, their starts at least 11
paragraphs apart, each paragraph in 1 to 3 of them, 2.1 on average).
The text is NOT long enough for many disjoint documents: about 15 disjoint documents of 2048
tokens fit in it, so with more documents (or longer ones) they are overlapping windows of the same
text with different starts; the intervals over documents, which treat documents as independent,
are then somewhat too narrow. A document longer than the whole text is refused. The
documents of one index but different lengths share their start (the shorter is a prefix).

Protocol, per document (n tokens), method, compression ratio r and mode: the first
round(context_fraction·n) tokens (default 3/4) are the context, the other m tokens the
continuation, whose tokens are scored teacher-forced:
- prefill: the context is prefilled in one forward through
  `CompressedCache(model, method, compression_ratio=r, mode="prefill")` (the ratio resolved
  against the context), then the continuation is fed in blocks of `block` tokens (default 64)
  through the same cache (those tokens stay exact).
- chunked: the context goes through the method's stream in blocks of `chunk_size`, with the
  middle budget the ratio gives on the context (`stream_budget`); the stream is compacted (the
  room it reserves for later blocks given back), then the continuation is fed exactly in blocks
  of `block`.
- decode: every token, context and continuation, goes through a `mode="decode"` cache in blocks
  of `chunk_size`, with the middle budget the ratio gives on the whole document
  (`methods.budget.resolve_budget` of n tokens with the method's sink and window).
- full cache (method "full"): a plain transformers `DynamicCache`, the context in one forward,
  the continuation in blocks of `block` — the reference, on the same tokens.
The NLL of continuation token t_j is -log softmax(logits)[t_j] in float32, the logits being those
of the position before it: the context's last position for the first, the continuation blocks
for the others (the last token is never fed: nothing after it is scored). Compressed runs use the
'kvcompress' attention implementation (`integration.use_compressed_attention`), the full cache
the model's own.

Statistics (documents are the unit; lower perplexity is better): a document's log-perplexity is
the mean NLL of its m continuation tokens. Per (method, ratio, mode, length) the perplexity is
exp(mean over documents of the log-perplexities) — every document of a length has the same m, so
this is exp(mean NLL over all continuation tokens) — with exp of the 95% Student-t interval of that
mean (`eval.stats.t_interval`); the ratio to the full cache is exp(mean over documents of
log-perplexity(method) - log-perplexity(full cache)), the paired per-document differences, with
exp of their 95% t-interval (1 = no loss; above 1 = compression costs perplexity).

Output (the sweep's conventions, `eval.runner`): one record per cell in `OUT/results.jsonl`
(appended as cells finish, resumable: recorded cells are skipped on a rerun), `OUT/config.json`,
`OUT/summary.csv` and `OUT/summary.md` (`write_summary`), and `OUT/leaderboard_perplexity.md/.html/.png`
(`eval.leaderboard`, where the records are benchmark "perplexity", task "perplexity", score = the
document's perplexity, flagged `lower_is_better`). A cell whose method cannot run at its size (a
ratio leaving no room beyond the sink and window) is recorded with its error and no score.
"""

from __future__ import annotations

import functools
import math
import random
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..cache import CompressedCache
from ..options import MODES
from ..checks import as_count, check_distinct, describe
from ..integration import use_compressed_attention
from ..model_support import model_lock
from ..integration.generation import full_kv_bytes
from ..integration.model import check_context_length, logits_to_keep
from ..integration.reconstruction import reconstruct_context
from ..methods.registry import method_names
from ..names import DEFAULT_CHUNK_SIZE
from ..names import DEFAULT_METHOD as DEFAULT
from ..names import PERPLEXITY
from ..names import PERPLEXITY_BLOCK as DEFAULT_BLOCK
from ..names import PERPLEXITY_CONTEXT_FRACTION as DEFAULT_CONTEXT_FRACTION
from ..names import PERPLEXITY_DOCUMENTS as DEFAULT_DOCUMENTS
from .capture import prose_paragraphs
from .runner import (DEFAULT_RATIOS, FULL, any_streams, check_lengths_fit, check_same_run, dtype_name, open_run, read_results, shard_specs, stream_budget,
                     write_run_config)
from .stats import t_interval
from . import tables

DEFAULT_MODES = ("prefill", "decode")
DEFAULT_LENGTHS = (2048,)
MIN_LENGTH = 64
_GOLDEN = 0.6180339887498949


@dataclass
class PerplexityConfig:
    """What a perplexity run evaluates. methods: registered names and DEFAULT (the library's default for each mode);
    None: every registered method. lengths: document tokens.

    documents: documents per length (document i is `prose_document(i, length, tokenizer, seed)`);
    context_fraction: the share of a document's tokens given as context, the rest is scored;
    block: continuation block size (prefill and chunked modes, full cache); chunk_size: block size
    of every token streamed (chunked: the context; decode: everything); seed: the documents' offset
    and randomised methods' seed; include_full: run the full-cache reference (needed for the
    ratio to the full cache).
    """

    methods: list[str] | None = None
    ratios: list[float] = field(default_factory=lambda: list(DEFAULT_RATIOS))
    modes: list[str] = field(default_factory=lambda: list(DEFAULT_MODES))
    lengths: list[int] = field(default_factory=lambda: list(DEFAULT_LENGTHS))
    documents: int = DEFAULT_DOCUMENTS
    seed: int = 0
    context_fraction: float = DEFAULT_CONTEXT_FRACTION
    block: int = DEFAULT_BLOCK
    chunk_size: int = DEFAULT_CHUNK_SIZE
    include_full: bool = True

    def __post_init__(self):
        if self.methods is None:
            self.methods = method_names()
        for name, values, allowed in (("methods", self.methods, [DEFAULT, *method_names()]), ("modes", self.modes, MODES)):
            if isinstance(values, str) or not isinstance(values, (list, tuple)):
                raise ValueError(f"{name} must be a list of names among {sorted(allowed)}, got {values!r}")
            bad = [v for v in values if v not in allowed]
            if bad:
                raise ValueError(f"{name} must be among {sorted(allowed)}, got {bad}")
        for r in self.ratios:
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r < 1.0:
                raise ValueError(f"ratios must be numbers in [0, 1) (the fraction of tokens removed), got {r!r} in {list(self.ratios)}")
        for n in self.lengths:
            if isinstance(n, bool) or not isinstance(n, int) or n < MIN_LENGTH:
                raise ValueError(f"lengths must be integers >= {MIN_LENGTH} (tokens per document), got {n!r} in {list(self.lengths)}")
        for name in ("methods", "ratios", "modes", "lengths"):
            check_distinct(name, getattr(self, name))
        self.documents = as_count("documents", self.documents, 1)
        self.seed = as_count("seed", self.seed, 0)
        self.block = as_count("block", self.block, 1)
        self.chunk_size = as_count("chunk_size", self.chunk_size, 1)
        f = self.context_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f < 1.0:
            raise ValueError(f"context_fraction must be a number in (0, 1) (the share of each document given as context), got {f!r}")

    def tag(self) -> str:
        """What defines the scored tokens and how they are fed, the first part of every cell key."""
        return f"{PERPLEXITY};seed={self.seed};context={self.context_fraction:g};block={self.block};chunk={self.chunk_size}"


@dataclass(frozen=True)
class Document:
    """One document: its token ids [n], the index of its first paragraph and how many paragraphs it spans (the last cut)."""

    index: int
    ids: list[int]
    first_paragraph: int
    paragraphs: int


def document_start(index: int, seed: int = 0) -> int:
    """Index of the first paragraph of document `index` (golden-ratio steps from a seeded offset)."""
    count = len(prose_paragraphs())
    offset = random.Random(seed).random()
    return int(((offset + index * _GOLDEN) % 1.0) * count)


def prose_document(index: int, n_tokens: int, tokenizer, seed: int = 0) -> Document:
    """Document `index` of `seed`: consecutive prose paragraphs from `document_start`, cut to exactly n_tokens (see the module docstring)."""
    index = as_count("index", index, 0)
    n_tokens = as_count("n_tokens", n_tokens, 2)
    paragraphs = _paragraphs()
    start = document_start(index, as_count("seed", seed, 0))
    count = len(paragraphs)
    take, total = 0, 0
    while take < count:
        paragraph = paragraphs[(start + take) % count]
        total += len(tokenizer(paragraph, add_special_tokens=False)["input_ids"]) + 1  # about one token for the blank line between paragraphs
        take += 1
        if total < n_tokens and take < count:
            continue
        ids = tokenizer("\n\n".join(paragraphs[(start + k) % count] for k in range(take)))["input_ids"]
        if len(ids) >= n_tokens:
            return Document(index, list(ids[:n_tokens]), start, take)
    raise ValueError(f"n_tokens must be at most the prose's size, {len(ids)} tokens with this tokenizer (documents never repeat text), got {n_tokens}")


@functools.lru_cache(maxsize=1)
def _paragraphs() -> tuple[str, ...]:
    return tuple(prose_paragraphs())


def context_length(n_tokens: int, context_fraction: float) -> int:
    """Context tokens of an n-token document: round(fraction·n), leaving at least one token on each side."""
    return min(n_tokens - 1, max(1, round(context_fraction * n_tokens)))


@torch.inference_mode()
def continuation_nll(
    model,
    ids: torch.Tensor,
    n_context: int,
    method: str | None = None,
    *,
    compression_ratio: float | None = None,
    budget: int | None = None,
    mode: str = "prefill",
    block: int = DEFAULT_BLOCK,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    seed: int = 0,
) -> torch.Tensor:
    """NLL [m] (float32, CPU) of each continuation token ids[0, n_context:] under `method`'s cache (None: the full cache).

    ids: integer tensor [1, n]; the context ids[0, :n_context] is fed as the module docstring says for
    `mode`; compression_ratio / budget go to `CompressedCache` (prefill mode takes either, chunked
    and decode a budget).
    """
    return _continuation(model, ids, n_context, method, compression_ratio, budget, mode, block, chunk_size, seed)[0]


@torch.inference_mode()
def _continuation(model, ids, n_context, method, compression_ratio, budget, mode, block, chunk_size, seed):
    """(NLL [m], the cache after the last block) of `continuation_nll`."""
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 2 or ids.is_floating_point():
        raise ValueError(f"ids must be an integer tensor [1, n] with n >= 2 (one document), got {describe(ids)}")
    n = ids.shape[1]
    n_context = as_count("n_context", n_context, 1)
    if n_context >= n:
        raise ValueError(f"n_context must be in [1, n - 1] = [1, {n - 1}] (at least one continuation token to score), got {n_context}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    block, chunk_size = as_count("block", block, 1), as_count("chunk_size", chunk_size, 1)
    if method is None and (compression_ratio is not None or budget is not None):
        raise ValueError(f"method=None is the full cache: it takes no compression_ratio or budget, got compression_ratio={compression_ratio!r}, budget={budget!r}")
    check_context_length(model, n - 1)
    ids = ids.to(next(model.parameters()).device)
    streamed = method is not None and mode != "prefill"
    with model_lock(model), use_compressed_attention(model) if method is not None else nullcontext():
        if method is None:
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config)
        else:
            stream_length = None if not streamed else n_context if mode == "chunked" else n - 1  # decode: every token fed
            cache = CompressedCache(model, method, compression_ratio=compression_ratio, budget=budget, mode=mode, seed=seed,
                                    stream_length=stream_length)
        context = ids[:, :n_context]
        if method is not None and cache.options.compressor.requirements.needs("reconstruction"):  # KVzip: prefill, then its reconstruction
            logits = reconstruct_context(model, cache, context)[0][:, None]
        else:
            for part in context.split(chunk_size, 1) if streamed else [context]:
                logits = _logits(model, part, cache, last_only=True)
        if method is not None and mode == "chunked":
            cache.absorbing = False  # the stream is compacted; the continuation stays exact
        nll = [_token_nll(logits, ids[:, n_context : n_context + 1])]
        position = n_context
        for part in ids[:, n_context : n - 1].split(chunk_size if streamed and mode == "decode" else block, 1):
            width = part.shape[1]
            nll.append(_token_nll(_logits(model, part, cache), ids[:, position + 1 : position + 1 + width]))
            position += width
    return torch.cat(nll).cpu(), cache


def _logits(model, ids: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
    """Logits [1, b or 1, V] of a block fed through the cache (only the last position's when asked and the model allows it)."""
    extra = logits_to_keep(model, last=True) if last_only else {}
    logits = model(ids, past_key_values=cache, use_cache=True, **extra).logits
    return logits[:, -1:] if last_only else logits


def _token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) [b] in float32 from logits [1, b, V] and targets [1, b]."""
    return torch.nn.functional.cross_entropy(logits[0].float(), targets[0], reduction="none")


@dataclass(frozen=True)
class PerplexityCell:
    """One document under one method (FULL: the full cache), ratio and mode."""

    length: int
    index: int
    method: str
    ratio: float | None
    mode: str

    def key(self, config: PerplexityConfig) -> str:
        return f"{config.tag()}|{self.length}|{self.index}|{self.method}|{self.ratio}|{self.mode}"


def cells_of(config: PerplexityConfig, length: int, index: int) -> list[PerplexityCell]:
    """The full cache (once) and every mode × method × ratio of one document."""
    cells = [PerplexityCell(length, index, FULL, None, "-")] if config.include_full else []
    return cells + [PerplexityCell(length, index, m, r, mode) for mode in config.modes for m in config.methods for r in config.ratios]


def run_cell(model, document: Document, cell: PerplexityCell, config: PerplexityConfig, log=print) -> dict:
    """The record of one cell; a method that cannot run at this size is recorded with its error (and `log`ged)."""
    n = len(document.ids)
    n_context = context_length(n, config.context_fraction)
    record = {
        "key": cell.key(config), "benchmark": PERPLEXITY, "task": PERPLEXITY, "lower_is_better": True, "grid": False,
        "length": cell.length, "index": cell.index, "depth": None, "method": cell.method, "ratio": cell.ratio, "mode": cell.mode,
        "seed": config.seed, "first_paragraph": document.first_paragraph, "paragraphs": document.paragraphs,
        "context_tokens": n_context, "scored_tokens": n - n_context, "budget": None, "nll_mean": None, "score": None,
        "kv_bytes": None, "kv_bytes_full": None, "error": None,
    }
    start = time.perf_counter()
    try:
        size = {}
        if cell.method != FULL:
            if cell.mode == "prefill":
                size = {"compression_ratio": cell.ratio}
            else:
                size = {"budget": stream_budget(cell.method, cell.ratio, n if cell.mode == "decode" else n_context)}
                record["budget"] = size["budget"]
        ids = torch.tensor([document.ids])
        nll, cache = _continuation(model, ids, n_context, None if cell.method == FULL else cell.method, size.get("compression_ratio"),
                                   size.get("budget"), cell.mode if cell.method != FULL else "prefill", config.block, config.chunk_size, config.seed)
    except (ValueError, RuntimeError) as err:
        record["error"] = f"{type(err).__name__}: {err}"
        log(f"[{record['key']}] {record['error']}")
    else:
        mean = float(nll.double().mean())
        full = full_kv_bytes(model, n - 1, next(model.parameters()).dtype)
        record.update(nll_mean=mean, score=math.exp(mean), kv_bytes_full=full, kv_bytes=full if cell.method == FULL else cache.nbytes())
    record["wall_s"] = time.perf_counter() - start
    return record


def check_perplexity_folder(config: PerplexityConfig, out_dir: str | Path, model_name: str = "", dtype: str | None = None) -> None:
    """Refuse to add this run's records to `out_dir` when the run already there was a task sweep, or used another seed,
    context fraction, block, block size of the streams (where this run streams), model or dtype (`runner.check_same_run`). The
    command line checks this before loading the model."""
    settings = ("seed", "context_fraction", "block") + (("chunk_size",) if any_streams(config.modes) else ())
    check_same_run(Path(out_dir) / "config.json", {name: getattr(config, name) for name in settings}, model_name, config.methods,
                   task=PERPLEXITY, dtype=dtype)


def perplexity_documents(config: PerplexityConfig) -> list[tuple[int, int]]:
    """The run's documents as (length, index), in the order shards split them."""
    return [(length, i) for i in range(config.documents) for length in config.lengths]


def run_perplexity(model, tokenizer, config: PerplexityConfig, out_dir: str | Path, progress: bool = True, model_name: str = "",
                   shard: tuple[int, int] | None = None) -> list[dict]:
    """Run every cell not yet in `out_dir/results.jsonl` (of shard (i, n) only: the documents at positions p with
    p % n == i), appending one record per cell as it finishes; return all records of the file.

    Writes `out_dir/config.json` (the config, model name, host, shard, start time).
    """
    check_lengths_fit(model, config.lengths)
    documents = shard_specs(perplexity_documents(config), shard)
    out, results = open_run(out_dir)
    done = results.keys()
    dtype = dtype_name(next(model.parameters()).dtype)
    check_perplexity_folder(config, out, model_name, dtype)
    write_run_config(out, config, model_name, shard, task=PERPLEXITY, dtype=dtype)
    todo = [(doc, [c for c in cells_of(config, *doc) if c.key(config) not in done]) for doc in documents]
    todo = [(doc, cells) for doc, cells in todo if cells]
    bar = tqdm(total=sum(len(cells) for _, cells in todo), desc=PERPLEXITY, unit="cell", disable=not progress)
    for (length, index), cells in todo:
        document = prose_document(index, length, tokenizer, config.seed)
        for cell in cells:
            results.write([run_cell(model, document, cell, config, log=bar.write)])
            bar.update(1)
    bar.close()
    return read_results(results.path)


def _perplexity_records(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("task") == PERPLEXITY]


def summarize(records: list[dict]) -> list[dict]:
    """One row per (method, ratio, mode, length), full cache first: documents scored and errored, the
    perplexity with its 95% interval over documents, the paired ratio to the full cache with its
    interval (on the documents both scored), the mean NLL, the KV bytes kept and the mean wall time."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in _perplexity_records(records):
        groups[(r["method"], r["ratio"], r["mode"], r["length"])].append(r)
    full = {(r["length"], r["index"]): r["nll_mean"] for r in _perplexity_records(records) if r["method"] == FULL and r["error"] is None}
    rows = []
    for (method, ratio, mode, length), rs in groups.items():
        scored = [r for r in rs if r["error"] is None]
        mean, low, high = t_interval([r["nll_mean"] for r in scored])
        pairs = [r["nll_mean"] - full[(length, r["index"])] for r in scored if (length, r["index"]) in full]
        d_mean, d_low, d_high = t_interval(pairs) if method != FULL else (float("nan"),) * 3
        kept = [r["kv_bytes"] / r["kv_bytes_full"] for r in scored]
        rows.append({
            "method": method, "ratio": ratio, "mode": mode, "length": length, "n": len(scored), "errors": len(rs) - len(scored),
            "nll_mean": mean, "perplexity": math.exp(mean), "ppl_low": math.exp(low), "ppl_high": math.exp(high),
            "pairs": len(pairs), "ratio_to_full": math.exp(d_mean), "ratio_low": math.exp(d_low), "ratio_high": math.exp(d_high),
            "kv_fraction": sum(kept) / len(kept) if kept else float("nan"),
            "wall_s": sum(r["wall_s"] for r in scored) / len(scored) if scored else float("nan"),
        })
    return sorted(rows, key=lambda r: (r["method"] != FULL, r["method"], r["ratio"] or 0.0, r["mode"], r["length"]))


def _interval(value: float, low: float, high: float) -> str:
    if math.isnan(value):
        return "n/a"
    if math.isnan(low):
        return f"{value:.3f} (no interval)"
    return f"{value:.3f} [{low:.3f}, {high:.3f}]"


def perplexity_table(records: list[dict]) -> str:
    """Perplexity and its ratio to the full cache (95% t-intervals over documents) per method @ ratio (mode) and length."""
    rows = summarize(records)
    if not rows:
        return ""
    modes = {r["mode"] for r in rows if r["method"] != FULL}
    table = []
    for r in rows:
        if r["method"] == FULL:
            label, vs_full = "full cache", "1"
        else:
            label = f"{r['method']} @ {r['ratio']:g}" + (f" ({r['mode']})" if len(modes) > 1 else "")
            vs_full = _interval(r["ratio_to_full"], r["ratio_low"], r["ratio_high"]) if r["pairs"] else "n/a"
        ppl = _interval(r["perplexity"], r["ppl_low"], r["ppl_high"]) if r["n"] else "n/a"
        kept = f"{100 * r['kv_fraction']:.0f}%" if r["n"] else "n/a"
        table.append({"method @ ratio": label, "tokens": r["length"], "documents": f"{r['n']}{'*' if r['errors'] else ''}",
                      "perplexity [95% CI]": ppl, "× full cache [95% CI]": vs_full, "KV kept": kept})
    return tables.markdown_table(table)


def write_summary(records: list[dict], out_dir: str | Path) -> tuple[Path, Path]:
    """`summary.csv` (one row per method, ratio, mode and length, see `summarize`) and `summary.md` (the table and its caption)."""
    out = Path(out_dir)
    rows = summarize(records)
    if not rows:
        raise ValueError("records must hold perplexity results (a run of `kvcompress eval --tasks perplexity`), got none")
    csv_path, md_path = out / "summary.csv", out / "summary.md"
    tables.write_csv(csv_path, rows)
    ppl = _perplexity_records(records)
    n_docs = len({(r["length"], r["index"]) for r in ppl})
    n_err = sum(r["error"] is not None for r in ppl)
    parts = [
        f"{len(ppl)} cells ({n_err} could not run) on {n_docs} documents, {sum(r['wall_s'] for r in ppl) / 3600:.2f} h of recorded wall time.", "",
        "### Language modelling under compression (perplexity, lower is better)", "", perplexity_table(records), "",
        "Perplexity: exp of the mean NLL of the continuation tokens (the last quarter of each document by default), "
        "the 95% interval a Student t interval over documents of their log-perplexity, exponentiated. × full cache: "
        "exp of the mean per-document difference of log-perplexity against the full cache on the same document, "
        "with its 95% t interval (1 = no loss, above 1 = compression costs perplexity). KV kept: stored KV bytes "
        "after the last token over the full cache's (prefill mode: the compressed context, its method's exact sink and window "
        "on top of the ratio, plus the exact continuation; "
        "decode mode: the stream, whose re-compression slack and block in progress come out of its budget). Prefill mode: the ratio applies to the context; decode mode: "
        "to the whole document, every token streamed. Documents overlap when there are more than the prose holds "
        "disjointly (`kvcompress.eval.perplexity`). `*`: some documents could not run (see results.jsonl); n/a: none could.", "",
    ]
    md_path.write_text("\n".join(parts), encoding="utf-8")
    return csv_path, md_path


def write_report(records: list[dict], out_dir: str | Path) -> list[Path]:
    """summary.csv, summary.md and the leaderboard files (`eval.leaderboard.write_leaderboard`); summary.md first."""
    from .leaderboard import write_leaderboard

    csv_path, md_path = write_summary(records, out_dir)
    return [md_path, csv_path, *write_leaderboard(_perplexity_records(records), out_dir)]
