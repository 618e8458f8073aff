"""`kvc.generate`: greedy generation through a compressed cache in one of three modes (DESIGN.md §3)."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..api import default_sink_window
from ..cache import MODES, CompressedCache, CompressionSettings, check_supported
from ..checks import as_count, describe
from ..methods.base import build_method, check_sink_window, resolve_budget
from .attention import ATTENTION_NAME
from .model import check_context_length

# Prompts longer than this show a progress bar while they are processed.
PROGRESS_MIN_TOKENS = 1024


@dataclass
class GenerationResult:
    """What `generate` returns: the answer and the costs users compare methods by."""

    text: str
    token_ids: list[int]
    method: str
    mode: str
    context_tokens: int
    prompt_tokens: int
    budget: int | None
    slots_per_layer: list[int]
    kv_bytes_full: int
    kv_bytes: int
    peak_kv_bytes: int
    prefill_seconds: float
    compress_seconds: float
    decode_seconds: float
    extra: dict = field(default_factory=dict)
    realised_compression_ratio: float = 0.0  # fraction of the tokens seen that the cache does not hold (mean over layers)

    @property
    def decode_tokens_per_second(self) -> float:
        return len(self.token_ids) / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    def report(self) -> str:
        """Human-readable stats block."""
        saved = 1.0 - self.kv_bytes / self.kv_bytes_full if self.kv_bytes_full else 0.0
        slots = self.slots_per_layer
        kept = f"{min(slots)}..{max(slots)} (mean {sum(slots) / len(slots):.0f})" if slots else "-"
        return "\n".join(
            [
                f"method            {self.method} (mode={self.mode}, middle budget={self.budget})",
                f"prompt tokens     {self.prompt_tokens} (context {self.context_tokens})",
                f"tokens kept/layer {kept} per KV head (realised compression ratio {self.realised_compression_ratio:.3f} of all tokens seen)",
                f"KV bytes          full {_mib(self.kv_bytes_full)} -> stored {_mib(self.kv_bytes)} "
                f"({saved:.0%} saved; peak {_mib(self.peak_kv_bytes)})",
                f"time              prefill {self.prefill_seconds:.2f}s (compression {self.compress_seconds:.2f}s), "
                f"decode {self.decode_seconds:.2f}s for {len(self.token_ids)} tokens",
            ]
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def full_kv_bytes(model, n_tokens: int, dtype: torch.dtype) -> int:
    """Bytes a full (uncompressed) cache stores for n_tokens: keys + values of every layer."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * n_kv * head_dim * n_tokens * torch.empty(0, dtype=dtype).element_size()


class use_compressed_attention:
    """Context manager: run `model` with the 'kvcompress' attention implementation, restoring the old one after."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(ATTENTION_NAME)
        return self.model

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.previous)
        return False


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return set(eos if isinstance(eos, (list, tuple)) else [eos])


@torch.inference_mode()
def generate_ids(
    model,
    context_ids: torch.Tensor,
    question_ids: torch.Tensor | None = None,
    method: str | None = "snapkv",
    budget: int | None = None,
    compression_ratio: float | None = None,
    mode: str = "prefill",
    max_new_tokens: int = 64,
    sink: int | None = None,
    window: int | None = None,
    seed: int = 0,
    chunk_size: int = 128,
    compress_question: bool = False,
    progress: bool = False,
    stop_at_eos: bool = True,
    prefill: dict | None = None,
    quality: float | None = None,
    calibration=None,
    **method_params,
) -> GenerationResult:
    """Greedy generation on token ids [1, n] through a compressed cache; `method=None` is the full cache.

    prefill: the context (and the question too if compress_question) is prefilled in one forward
    and compressed once; chunked: the context is fed in blocks of `chunk_size` through the
    method's stream (stored KV <= sink + budget + window + chunk_size per head); decode: as
    chunked, and every later token (question, answer) keeps going through the stream. A
    compression_ratio is resolved against the context length (the prompt length in prefill
    mode with compress_question). prefill: a recorded full prefill of the context
    ({layer: (queries, keys, values)}, see `kvcompress.eval.capture.capture_qkv`) to compress
    instead of running the context again (prefill mode, question kept out of compression).
    quality + calibration (a `kvcompress.calibration.Calibration` or its JSON path): context-
    calibrated compression (Compactor seed §3.5) — the ratio is the smallest compression whose
    predicted quality meets `quality`, chosen from this context's NLL; it is reported in
    `result.extra["calibration"]`.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(context_ids, torch.Tensor) or context_ids.ndim != 2 or context_ids.shape[1] == 0 or context_ids.is_floating_point():
        raise ValueError(f"empty context or bad ids: context_ids must be an integer tensor [1, n] with n >= 1, got {describe(context_ids)}")
    if context_ids.shape[0] != 1:
        raise ValueError(f"generate takes one sequence (batch size 1), got batch size {context_ids.shape[0]}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    seed = as_count("seed", seed, 0)
    check_supported(model)
    device = next(model.parameters()).device
    context_ids = context_ids.to(device)
    if question_ids is not None and (not isinstance(question_ids, torch.Tensor) or question_ids.ndim != 2 or question_ids.shape[0] != 1 or question_ids.is_floating_point()):
        raise ValueError(f"question_ids must be an integer tensor [1, m] or None, got {describe(question_ids)}")
    question_ids = question_ids.to(device) if question_ids is not None and question_ids.shape[1] > 0 else None
    n_context = context_ids.shape[1]
    n_prompt = n_context + (question_ids.shape[1] if question_ids is not None else 0)
    check_context_length(model, n_prompt)
    chosen = None
    if quality is not None or calibration is not None:
        from ..calibration import calibrated_ratio

        if quality is None or calibration is None or budget is not None or compression_ratio is not None or method is None:
            raise ValueError("context-calibrated compression takes a method, quality and calibration together, and no budget or compression_ratio")
        chosen = calibrated_ratio(model, context_ids, calibration, quality)
        compression_ratio = chosen["compression_ratio"]

    cache, middle_budget = None, None
    if method is not None:
        m = build_method(method, **method_params)
        sink, window = default_sink_window(method, sink, window)
        check_sink_window(sink, window)
        compressed_length = n_prompt if (compress_question or mode == "decode") else n_context
        middle_budget = resolve_budget(compressed_length, budget, compression_ratio, sink, window, m, streaming=mode != "prefill")
        settings = CompressionSettings(m, mode, middle_budget, None, sink, window, seed)
        if prefill is not None:
            if mode != "prefill" or compress_question:
                raise ValueError("a recorded prefill serves mode='prefill' with the question kept out of compression")
            cache = CompressedCache.from_prefill(model, settings, prefill)
        else:
            cache = CompressedCache(model, settings)
    elif budget is not None or compression_ratio is not None or method_params or prefill is not None:
        raise ValueError("method=None is the full cache: it takes no budget, compression_ratio, method parameters or recorded prefill")

    one_forward = mode == "prefill" or cache is None
    absorbed = question_ids if (compress_question and question_ids is not None) else None
    if one_forward:
        blocks = [context_ids if absorbed is None else torch.cat([context_ids, absorbed], 1)]
    else:
        blocks = list(context_ids.split(chunk_size, dim=1)) + (list(absorbed.split(chunk_size, dim=1)) if absorbed is not None else [])
    rest = question_ids if absorbed is None else None
    if prefill is not None:
        if question_ids is None:
            raise ValueError("a recorded prefill needs question_ids: the question's forward gives the first answer token")
        blocks = []

    bar = None
    if progress and n_prompt >= PROGRESS_MIN_TOKENS:
        per_block = model.config.num_hidden_layers if cache is not None else 1
        bar = tqdm(total=len(blocks) * per_block, desc=f"prefill ({mode})", unit="layer" if len(blocks) == 1 else "step", leave=False)

    with use_compressed_attention(model) if cache is not None else nullcontext():
        past = cache
        if cache is None:
            from transformers import DynamicCache

            past = DynamicCache(config=model.config)
        cache_bar(cache, bar)
        start = time.perf_counter()
        logits = None
        for block in blocks:
            logits = model(block, past_key_values=past, use_cache=True).logits[:, -1]
            if bar is not None and cache is None:
                bar.update(1)
        cache_bar(cache, None)
        if bar is not None:
            bar.close()
        if cache is not None:
            cache.absorbing = mode == "decode"
        if rest is not None:
            logits = model(rest, past_key_values=past, use_cache=True).logits[:, -1]
        prefill_seconds = time.perf_counter() - start

        eos = _eos_ids(model) if stop_at_eos else set()
        new_tokens: list[int] = []
        start = time.perf_counter()
        for step in range(max_new_tokens):
            token = int(logits.argmax(-1))
            new_tokens.append(token)
            if token in eos or step == max_new_tokens - 1:
                break
            logits = model(torch.tensor([[token]], device=device), past_key_values=past, use_cache=True).logits[:, -1]
        decode_seconds = time.perf_counter() - start

    dtype = next(model.parameters()).dtype
    total = n_prompt + max(len(new_tokens) - 1, 0)
    full = full_kv_bytes(model, total, dtype)
    if cache is not None:
        kv_bytes, peak, slots, compress_seconds = cache.nbytes(), cache.peak_bytes(), cache.slots_per_layer(), cache.compress_seconds()
    else:
        kv_bytes, peak, slots, compress_seconds = full, full, [total] * model.config.num_hidden_layers, 0.0
    return GenerationResult(
        text="",
        token_ids=new_tokens,
        method=method or "full",
        mode=mode,
        context_tokens=n_context,
        prompt_tokens=n_prompt,
        budget=middle_budget,
        slots_per_layer=slots,
        kv_bytes_full=full,
        kv_bytes=kv_bytes,
        peak_kv_bytes=peak,
        prefill_seconds=prefill_seconds,
        compress_seconds=compress_seconds,
        decode_seconds=decode_seconds,
        extra={"calibration": chosen} if chosen is not None else {},
        realised_compression_ratio=1.0 - sum(slots) / len(slots) / total,
    )


def cache_bar(cache, bar) -> None:
    if cache is not None:
        cache.progress = bar


def generate(
    model,
    tokenizer,
    context: str,
    question: str | None = None,
    method: str | None = "snapkv",
    compression_ratio: float | None = None,
    budget: int | None = None,
    mode: str = "prefill",
    max_new_tokens: int = 64,
    progress: bool = True,
    **kwargs,
) -> GenerationResult:
    """Answer `question` about `context` with a compressed cache (see `generate_ids` for every option).

    The context is compressed and the question appended exactly afterwards (kvpress's
    convention; `compress_question=True` opts in). Returns a GenerationResult with the answer
    text and stats (tokens kept per layer, KV bytes full/stored/peak, prefill, compression and
    decode time).
    """
    from .model import build_prompt

    if not isinstance(context, str):
        raise ValueError(f"context must be a str, got {type(context).__name__} (decode bytes first, e.g. context.decode('utf-8'))")
    if not context.strip():
        raise ValueError("empty context: pass a non-empty context string")
    context_ids, question_ids = build_prompt(tokenizer, context, question)
    result = generate_ids(
        model, context_ids, question_ids, method=method, budget=budget, compression_ratio=compression_ratio,
        mode=mode, max_new_tokens=max_new_tokens, progress=progress, **kwargs,
    )
    result.text = tokenizer.decode(result.token_ids, skip_special_tokens=True).strip()
    return result
