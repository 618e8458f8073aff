"""`kvc.generate`: greedy generation through a compressed cache in one of three modes.

The modes: docs/design.md, "Model integration: three modes".

The prompt is run here (context in one forward or in blocks, then the question), the first answer
token is the argmax of its last logits, and the rest of the answer comes from an ordinary greedy
`model.generate(past_key_values=cache)`; what this adds is the statistics. Many questions about one
context (`answer_questions_ids`) compress the context once and answer each question from a
snapshot of the compressed cache; a batch of contexts (`generate_batch_ids`) is left-padded into
one forward, padding never kept or attended, or, where one forward cannot compress its rows apart
(KVzip, the default method, streams, a calibration), run one context at a time. A context can also
be compressed alone (`compress_context`), saved (`CompressedCache.save`) and answered from later
(`generate(cache=...)`, `answer_from_cache_ids`): docs/design.md, "Saved caches".
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Collection
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from .. import cache_file
from ..cache import CompressedCache, CompressedLayer, load_cache
from ..checks import as_count, check_bool
from ..decoding import answer_end
from ..methods.base import UnknownParameters
from ..model_support import cache_dropping_length, check_supported, decoding_settings, model_lock, select_compressed_attention, use_compressed_attention
from ..options import CompressionOptions
from .attention import feeding_hidden_states  # the module registers the kvcompress attention
from .prefill_approx import approximate_prefill
from .reconstruction import RecordedReconstruction, load_reconstruction, options_prompt_ids, record_reconstruction, with_repeat_prompt
from .model import (DEFAULT_PROMPT_LAYOUT, PromptLayout, build_prompt, check_context_ids, check_context_length, check_questions, check_rope_forwards,
                    check_token_id_list, check_token_ids, logits_to_keep, vocabulary_size)
from .model import prompt_layout as as_prompt_layout

# Prompts longer than this show a progress bar while they are processed, on a terminal (tqdm disable=None: not in a log).
PROGRESS_MIN_TOKENS = 1024


@dataclass
class GenerationResult:
    """What `generate` returns: the answer and the costs users compare methods by. Bytes count keys and values (and
    any normalizer keys), not log-weights or positions (docs/design.md, "Memory")."""

    text: str  # the answer, decoded (the `*_ids` functions leave it "" and return token_ids only)
    token_ids: list[int]  # the answer's tokens, up to and including the stop token when one ended it
    method: str  # the method that ran, by its registered name ("default" resolved), or "full"
    mode: str  # "prefill", "chunked" or "decode"
    context_tokens: int  # the context's tokens (the part that is compressed; the question is not, unless asked)
    prompt_tokens: int  # the tokens fed before the answer: context and question
    budget: int | None  # the middle budget per KV head the options resolved (the mean over layers where they share it; None: the full cache)
    slots_per_layer: list[int]  # occupied slots per KV head after the answer, in each layer (sink, summary and window)
    kv_bytes_full: int  # what a full cache of the same tokens (prompt and answer but its last token) stores
    kv_bytes: int  # what the cache stores after the answer (in a batch run in one forward the three byte counts are the whole
    # batch's, against a full cache of the same padded batch)
    peak_kv_bytes: int  # the most the cache stored at any step (per layer, summed over the layers)
    prefill_seconds: float  # the prompt's forward passes, compression included (and the question's, except in `answer_questions`)
    compress_seconds: float  # of which compression (and re-compression during the answer in decode mode)
    decode_seconds: float  # generating the answer after the prompt (in `answer_questions`, the question's forward too)
    extra: dict = field(default_factory=dict)  # what only some runs have: "question_seconds", "calibration", "reconstruction", "batch_run", "batch_size"
    realised_compression_ratio: float = 0.0  # fraction of the tokens seen that the cache does not hold (mean over the compressed layers)
    kv_bits: int | None = None  # bits per element the compressed context is stored in (None: full precision)

    @property
    def decode_tokens_per_second(self) -> float:
        """Answer tokens per second of decoding: those after the first (which the prompt's forward gives, in
        `prefill_seconds`) over `decode_seconds`; NaN for an answer of one token."""
        steps = len(self.token_ids) - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        """Every field as plain JSON values (`dataclasses.asdict`, `extra` included), with `decode_tokens_per_second` (None
        for an answer of one token): what `kvcompress generate --json` prints."""
        rate = self.decode_tokens_per_second
        return asdict(self) | {"decode_tokens_per_second": None if math.isnan(rate) else rate}

    def report(self) -> str:
        """Human-readable stats block."""
        saved = 1.0 - self.kv_bytes / self.kv_bytes_full if self.kv_bytes_full else 0.0
        slots = self.slots_per_layer
        kept = f"{min(slots)}..{max(slots)} (mean {sum(slots) / len(slots):.0f})" if slots else "-"
        storage = f", {self.kv_bits}-bit storage" if self.kv_bits is not None else ""
        return "\n".join(
            [
                f"method            {self.method} (mode={self.mode}, middle budget={self.budget}{storage})",
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
    """Bytes a full (uncompressed) transformers cache stores for n_tokens: keys + values of every layer, a sliding-window
    layer's for the last window - 1 tokens it keeps (transformers' `DynamicSlidingWindowLayer`, as kvcompress's)."""
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    tokens = sum(n_tokens if kind == "full_attention" else min(n_tokens, window - 1) for kind, window in check_supported(model))
    return 2 * n_kv * head_dim * tokens * torch.empty(0, dtype=dtype).element_size()


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return set(eos if isinstance(eos, (list, tuple)) else [eos])


@contextmanager
def _greedy_generation_config(model, stop_at_eos: bool):
    """While active, `model.generation_config` holds only the model's token ids (BOS, padding, and end-of-sequence when
    `stop_at_eos`), so model.generate decodes greedily, as `generate_ids` promises, whatever else the user set on the
    model's generation config: a repetition penalty, suppressed or banned tokens, beams or a cache implementation would
    change the answer or refuse the compressed cache."""
    original = model.generation_config
    model.generation_config = GenerationConfig(bos_token_id=original.bos_token_id, pad_token_id=original.pad_token_id,
                                               eos_token_id=original.eos_token_id if stop_at_eos else None)
    try:
        yield
    finally:
        model.generation_config = original


@dataclass
class _Prompt:
    """A tokenised prompt batch: context ids [B, n] (left-padded, mask [B, n] or None) and question ids [B or 1, m] or None."""

    context_ids: torch.Tensor
    question_ids: torch.Tensor | None
    mask: torch.Tensor | None = None


@contextmanager
def _running(model, options: CompressionOptions):
    """While active, `model` runs what `options`' method needs (read once from its `Requirements`): the 'kvcompress'
    attention, and the hidden states captured for a method that reads them (`attention.feeding_hidden_states`); the
    full cache (method None) runs the model as it is. It holds the model's lock (`model_support.model_lock`), so that
    calls on one model from several threads run one at a time."""
    with model_lock(model):
        if options.method is None:
            yield
            return
        hidden = feeding_hidden_states(model) if options.compressor.requirements.needs("hidden_states") else nullcontext()
        with use_compressed_attention(model), hidden:
            yield


class _Session:
    """One compressed context on the model: builds the cache, prefills, then answers (greedy) through model.generate.

    How the context is prefilled is chosen once, from the options and what the method needs (`Requirements`): a plain
    forward through the cache (in blocks in a streaming mode); a recorded full prefill (`prefill`) or an approximate
    one (`CompressionOptions.prefill_approx`) compressed as it is (`CompressedCache.from_prefill`); or, for a method
    scored by a reconstruction forward (KVzip), the context's prefill followed by that forward with the options' repeat
    instruction (`reconstruction.record_reconstruction`), run here or recorded once by the caller for several caches.
    """

    def __init__(self, model, prompt: _Prompt, options: CompressionOptions, max_new_tokens: int, prefill: dict | None = None):
        context_ids = prompt.context_ids
        check_context_ids(context_ids, model)  # and the ids' range: once per call
        check_supported(model)
        self.model, self.options, self.mode = model, options, options.mode
        self.device = next(model.parameters()).device
        self.context_ids = context_ids.to(self.device)
        self.context_mask = prompt.mask.to(self.device) if prompt.mask is not None else None
        question_ids = prompt.question_ids
        self.question_ids = question_ids.to(self.device) if question_ids is not None and question_ids.shape[1] > 0 else None
        n_context = context_ids.shape[1]
        n_prompt = n_context + (self.question_ids.shape[1] if self.question_ids is not None else 0)
        check_context_length(model, n_prompt, max_new_tokens)
        self.n_context, self.n_prompt, self.method_name = n_context, n_prompt, options.method
        self.compress_question, self.max_new_tokens = options.compress_question, max_new_tokens
        self.check_rope(n_prompt - n_context)
        self.chosen = None
        if options.quality is not None:
            from ..calibration import calibrated_ratio

            if context_ids.shape[0] != 1:
                raise ValueError(f"context-calibrated compression takes one context, got a batch of {context_ids.shape[0]}")
            self.chosen = calibrated_ratio(model, self.context_ids, options.calibration, options.quality)
            self.options = options.calibrated(self.chosen["compression_ratio"])
        # decode mode streams every token, the answer's included: a ratio is the fraction removed of all of them
        self.stream_length = n_prompt + max_new_tokens if options.mode == "decode" else n_prompt if options.compress_question else n_context
        if self.chosen is not None:  # a ratio the user did not give: what cannot be honoured is said in terms of the quality
            try:
                self.options.token_budget_for(self.stream_length)
            except ValueError as error:
                raise ValueError(f"quality={options.quality} makes the calibration choose compression ratio "
                                 f"{self.chosen['compression_ratio']:.6g} for this context, which cannot be honoured ({error}); "
                                 "ask for a higher quality") from None
        if prefill is not None and (options.streams or options.compress_question or options.method is None):
            raise ValueError("a recorded prefill serves a method in mode='prefill' with the question kept out of compression")
        self.approximates = options.prefill_approx is not None
        if self.approximates and (prefill is not None or self.question_ids is None):
            raise ValueError(f"prefill_approx={options.prefill_approx!r} computes the context's cache itself, then reads the question "
                             f"exactly: it needs a question and no recorded prefill (question given: {self.question_ids is not None}, "
                             f"prefill given: {prefill is not None})")
        self.reconstructs = options.method is not None and options.compressor.requirements.needs("reconstruction")
        self.reconstruction = None
        self.recorded = prefill if isinstance(prefill, RecordedReconstruction) else None
        self.cache, self.prefill = None, None if self.recorded is not None else prefill
        if self.reconstructs and (self.prefill is not None or self.approximates):
            raise ValueError(f"method {options.method!r} compresses through its own reconstruction forward after a fresh prefill of the "
                             "context, or from that forward recorded (`reconstruction.record_reconstruction`): a recorded prefill is not "
                             "supported, nor an approximate one; name another method for it, e.g. method='compactor'")
        if self.recorded is not None and not self.reconstructs:
            raise ValueError(f"a recorded reconstruction serves a method scored by reconstruction (e.g. 'kvzip'), got method={options.method!r}; "
                             "pass a recorded full prefill (`capture_qkv`) instead")
        if self.recorded is not None:
            self.recorded.check_matches(self.context_ids, options_prompt_ids(options))

    def check_rope(self, n_question: int) -> None:
        """`check_rope_forwards` for the context followed by a question of n_question tokens (0: none), fed as the options
        feed them: in blocks in a streaming mode; in prefill mode in one forward, the question after it unless compressed
        with it."""
        mode, chunk = self.options.mode, self.options.chunk_size
        n_prompt = self.n_context + n_question
        if self.options.streams:
            pre_rope = self.method_name is not None and self.options.compressor.requirements.needs("pre_rope_keys")
            check_rope_forwards(self.model, min(chunk, self.n_context), n_prompt, f"in blocks of chunk_size={chunk} (mode={mode!r})",
                                "use mode='prefill' with compress_question=True" + ("" if pre_rope else ", a chunk_size above {switch},")
                                + " or a prompt within {switch} tokens")
        elif n_question and not self.options.compress_question:
            check_rope_forwards(self.model, self.n_context, self.n_context + n_question, "as the context's forward and then the "
                                "question's", "compress the question with the context (compress_question=True), or keep the prompt "
                                "within {switch} tokens")

    def check_questions(self, questions_ids: list[torch.Tensor]) -> None:
        """`check_rope` and `check_answers_stay_compressed` for the session's context followed by each of several questions
        [1, m_i], before any work."""
        self.check_rope(max(q.shape[1] for q in questions_ids))
        self.check_answers_stay_compressed([self.n_context + q.shape[1] for q in questions_ids])

    def check_answers_stay_compressed(self, n_prompts) -> None:
        """Refuse, before any work, a compressed cache's answer (greedy through `model.generate`, up to the session's
        max_new_tokens) after a prompt of any of `n_prompts` tokens that would cross the length where `model.generate`
        drops the cache it decodes from (`cache_dropping_length`: Phi-3): the rest of the answer would come from an
        uncompressed recomputation."""
        drop = cache_dropping_length(self.model)
        if self.method_name is None or drop is None:
            return
        for n_prompt in n_prompts:
            if n_prompt <= drop < n_prompt + self.max_new_tokens - 1:
                raise ValueError(f"this model's model.generate drops the cache it decodes from when the sequence first passes "
                                 f"original_max_position_embeddings={drop} tokens, to recompute it with its long RoPE factors, which a "
                                 f"compressed cache cannot give: the answer to a prompt of {n_prompt} tokens would go on from an "
                                 f"uncompressed cache past that point; lower max_new_tokens to {drop - n_prompt + 1} or fewer, or give "
                                 f"a prompt of more than {drop} tokens")

    def new_cache(self):
        if self.method_name is None:
            from transformers import DynamicCache

            return DynamicCache(config=self.model.config)
        if self.prefill is not None:
            return CompressedCache.from_prefill(self.model, self.options, self.prefill)
        return CompressedCache(self.model, self.options, stream_length=self.stream_length if self.options.streams else None)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None, logits: bool = True) -> torch.Tensor | None:
        """Run ids [B or 1, b] (their padding mask [B, b], default none) through the cache; -> last logits [B, V], or None
        when `logits` is False (a context block before the last: the language-model head is not run at all)."""
        ids = ids.expand(self.ids.shape[0], -1)
        mask = torch.ones_like(ids) if mask is None else mask
        self.ids, self.mask = torch.cat([self.ids, ids], 1), torch.cat([self.mask, mask], 1)
        extra = {}
        if self.context_mask is not None:  # a padded batch: the mask and the rows' own positions
            extra = {"attention_mask": self.mask, "position_ids": (self.mask.cumsum(-1) - 1).clamp_min(0)[:, -ids.shape[1] :]}
        extra.update(logits_to_keep(self.model, last=logits))  # as model.generate does: the last position's logits, or none
        out = self.model(ids, past_key_values=self.cache, use_cache=True, **extra)
        return out.logits[:, -1] if logits else None

    def run_context(self, progress: bool):
        """Prefill (and compress) the context, plus the question if it is compressed too; -> (last logits or None, seconds,
        an approximate prefill's included)."""
        approx_seconds = 0.0
        if self.approximates:  # Express computes the context's cache, the method compresses it as a recorded prefill
            start = time.perf_counter()
            self.prefill = approximate_prefill(self.model, self.context_ids, self.options.prefill_approx, chunk_size=self.options.chunk_size,
                                               seed=self.options.seed)
            approx_seconds = time.perf_counter() - start
        self.cache = self.new_cache()
        rows = self.context_ids.shape[0]
        self.ids = self.context_ids if self.prefill is not None else self.context_ids[:, :0]  # what the cache holds
        self.mask = torch.ones_like(self.ids)
        absorbed = self.question_ids if (self.compress_question and self.question_ids is not None) else None
        if self.prefill is not None:
            if self.question_ids is None:
                raise ValueError("a recorded prefill needs question_ids: the question's forward gives the first answer token")
            blocks = []
        elif self.mode == "prefill":
            blocks = [self.context_ids if absorbed is None else torch.cat([self.context_ids, absorbed.expand(rows, -1)], 1)]
        else:
            blocks = list(self.context_ids.split(self.options.chunk_size, dim=1)) + (list(absorbed.split(self.options.chunk_size, dim=1)) if absorbed is not None else [])
        bar = None
        if progress and self.n_prompt >= PROGRESS_MIN_TOKENS:
            per_block = sum(isinstance(layer, CompressedLayer) for layer in self.cache.layers) if self.method_name is not None else 1
            bar = tqdm(total=len(blocks) * per_block, desc=f"prefill ({self.mode})", unit="layer" if len(blocks) == 1 else "step", leave=False,
                       disable=None)
        compressed = self.method_name is not None
        if compressed:
            self.cache.progress = bar
        start = time.perf_counter()
        logits = None
        try:  # the bar is closed however the prompt ends (a refused block, an interrupt)
            for i, block in enumerate(blocks):
                mask = None
                if i == 0 and self.context_mask is not None:
                    mask = torch.cat([self.context_mask, torch.ones_like(block[:, self.context_mask.shape[1] :])], 1)
                # the first answer token comes from the prompt's last block: the question's forward (`answer`) when it is
                # kept out of compression, else the context's (or the absorbed question's) last block
                last = i == len(blocks) - 1 and (absorbed is not None or self.question_ids is None)
                logits = self.reconstruct(block) if self.reconstructs else self.forward(block, mask, logits=last)
                if bar is not None and not compressed:
                    bar.update(1)
        finally:
            if compressed:
                self.cache.progress = None
            if bar is not None:
                bar.close()
        if compressed:
            self.cache.absorbing = self.mode == "decode"
            self.cache.token_ids = self.ids
        return logits, approx_seconds + time.perf_counter() - start

    def reconstruct(self, ids: torch.Tensor) -> torch.Tensor:
        """KVzip: prefill ids [B, b] into the fresh cache and compress it with the context's reconstruction (the recorded one
        when the session was given it), whose forwards' cost counts as compression time; -> last logits [B, V]."""
        self.ids, self.mask = torch.cat([self.ids, ids], 1), torch.cat([self.mask, torch.ones_like(ids)], 1)
        recorded = self.recorded or record_reconstruction(self.model, self.cache, ids)
        logits, self.reconstruction = load_reconstruction(self.model, self.cache, recorded)
        return logits

    def adopt(self, cache: CompressedCache) -> None:
        """Answer from `cache`, a compressed context of this session's context ids (`cache.token_ids`), instead of
        compressing the context here."""
        self.cache, self.ids = cache, self.context_ids
        self.mask = torch.ones_like(self.ids)

    def answer(self, question_ids, logits, max_new_tokens: int, stop_at_eos: bool, stop_token_ids: Collection[int] = ()) -> tuple[list[list[int]], float, float]:
        """Append question_ids (exact) and decode greedily, each row stopping where `answer_end` says (EOS if
        stop_at_eos; a stop token after the row's first other token); -> (tokens per row, question seconds, decode seconds)."""
        start = time.perf_counter()
        if question_ids is not None:
            logits = self.forward(question_ids)
        question_seconds = time.perf_counter() - start
        start = time.perf_counter()
        first = logits.argmax(-1, keepdim=True)
        eos, stops = _eos_ids(self.model) if stop_at_eos else set(), set(stop_token_ids)
        tokens = first
        if max_new_tokens > 1 and not all(int(t) in eos for t in first[:, 0]):  # a stop token cannot end a row's first token
            seen = self.ids.shape[1]
            ids, mask = torch.cat([self.ids, first], 1), torch.cat([self.mask, torch.ones_like(first)], 1)
            pad = self.model.generation_config.pad_token_id
            pad = pad if pad is not None else (min(eos | stops) if eos | stops else 0)
            criteria = StoppingCriteriaList([_StopAfterOtherTokens(stops, first)] if stops else [])
            with _greedy_generation_config(self.model, stop_at_eos):
                out = self.model.generate(
                    ids, attention_mask=mask, past_key_values=self.cache, max_new_tokens=max_new_tokens - 1,
                    do_sample=False, pad_token_id=pad, stopping_criteria=criteria, **({"eos_token_id": sorted(eos)} if eos else {}),
                )
            tokens = out[:, seen:]
        decode_seconds = time.perf_counter() - start
        answers = [row[: answer_end(row, eos, stops) or len(row)] for row in tokens.tolist()]
        return answers, question_seconds, decode_seconds

    def result(self, tokens: list[int], prefill_seconds: float, decode_seconds: float, row: int, extra: dict) -> GenerationResult:
        dtype = next(self.model.parameters()).dtype
        padding = 0 if self.context_mask is None else int((self.context_mask[row] == 0).sum())
        total = self.n_prompt - padding + max(len(tokens) - 1, 0)  # the row's own tokens: its padding is not counted
        full = full_kv_bytes(self.model, total, dtype)
        if self.method_name is not None:
            kv_bytes, peak, compress_seconds = self.cache.nbytes(), self.cache.peak_bytes(), self.cache.compress_seconds()
            budget, compressed = self.cache.middle_budget(row), [isinstance(layer, CompressedLayer) for layer in self.cache.layers]
            # a sliding-window layer stores a padded row's window as wide as the batch's: the row's own tokens in it
            slots = [s if c else min(s, total) for s, c in zip(self.cache.slots_per_layer(row), compressed)]
            kept = [s for s, c in zip(slots, compressed) if c]
            realised = 1.0 - sum(kept) / len(kept) / total
        else:  # the full cache: every token, a sliding-window layer its window's
            slots = [total if kind == "full_attention" else min(total, window - 1) for kind, window in check_supported(self.model)]
            kv_bytes, peak, compress_seconds, budget, realised = full, full, 0.0, None, 0.0
        if self.chosen is not None:
            extra = {**extra, "calibration": self.chosen}
        if self.reconstruction is not None:
            extra = {**extra, "reconstruction": asdict(self.reconstruction)}
        return GenerationResult(
            text="", token_ids=tokens, method=self.method_name or "full", mode=self.mode,
            context_tokens=self.n_context, prompt_tokens=self.n_prompt, budget=budget,
            slots_per_layer=slots, kv_bytes_full=full, kv_bytes=kv_bytes, peak_kv_bytes=peak,
            prefill_seconds=prefill_seconds, compress_seconds=compress_seconds, decode_seconds=decode_seconds, extra=extra,
            realised_compression_ratio=realised, kv_bits=self.cache.kv_bits if isinstance(self.cache, CompressedCache) else None,
        )


class _StopAfterOtherTokens(StoppingCriteria):
    """`answer_end`'s stop-token rule inside `model.generate`, per row and on the device (no host synchronisation a
    step): a row ends at a stop token once it holds another token; `first` [B, 1], the rows' first answer tokens."""

    def __init__(self, stop_ids: Collection[int], first: torch.Tensor):
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=first.device)
        self.other = ~self.is_stop(first[:, 0])

    def is_stop(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B] bool: which tokens are stop tokens (an equality test against each: `torch.isin` sorts, and synchronises
        on CUDA, from 10 ids on)."""
        return (tokens[:, None] == self.stop_ids).any(-1)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        is_stop = self.is_stop(input_ids[:, -1])
        ended = is_stop & self.other
        self.other = self.other | ~is_stop
        return ended


@torch.inference_mode()
def generate_ids(
    model,
    context_ids: torch.Tensor,
    question_ids: torch.Tensor | None = None,
    options: CompressionOptions | None = None,
    *,
    max_new_tokens: int = 64,
    progress: bool = False,
    stop_at_eos: bool = True,
    stop_token_ids: Collection[int] = (),
    prefill: dict | RecordedReconstruction | None = None,
    **settings,
) -> GenerationResult:
    """Greedy generation on token ids [1, n] through a compressed cache.

    options: a `CompressionOptions`, or its fields as keyword settings (method, budget or
    compression_ratio, mode, sink, window, seed, slack, chunk_size, compress_question, quality +
    calibration, and the method's own parameters); `method=None` is the full cache (transformers' `DynamicCache`, fed
    as the mode feeds a stream: the context in one forward in prefill mode, in blocks of `chunk_size` otherwise). Modes:
    prefill: the context (and the question too with compress_question) is prefilled in one
    forward and compressed once; chunked: the context is fed in blocks of `chunk_size` through the
    method's stream; decode: as chunked, and every later token (question, answer) keeps going
    through the stream. A compression_ratio is resolved against the context length (the prompt
    length with compress_question; in decode mode, the prompt plus max_new_tokens, every token the
    stream takes). prefill: a recorded full prefill of the context ({layer: (queries, keys,
    values)}, see `kvcompress.eval.capture.capture_qkv`) to compress instead of running the
    context again (prefill mode, question kept out of compression); for a method scored by
    reconstruction (KVzip), the context's `RecordedReconstruction` (`reconstruction.record_reconstruction`
    with the same repeat instruction, the options' `repeat_prompt_ids`) instead: its forwards' seconds count in
    compress_seconds, not in prefill_seconds, which holds only this call's work. With the options'
    prefill_approx="express" the context's cache comes from a chunked forward with Thinformer Express attention
    (`integration.prefill_approx`), then the method compresses it. stop_token_ids: decoding also
    stops after any of these tokens once the answer holds another token (`answer_end`: a leading newline does not end
    an answer, as LongBench keeps an answer's first non-empty line). The first answer token is the argmax after the prompt; the
    rest comes from greedy `model.generate` on the same cache.
    """
    options = build_options(options, **settings)
    _check_answer_settings(max_new_tokens, stop_at_eos, progress)
    check_context_ids(context_ids)
    if context_ids.shape[0] != 1:
        raise ValueError(f"generate_ids takes one sequence (batch size 1), got batch size {context_ids.shape[0]}; use generate_batch_ids")
    if question_ids is not None:
        check_token_ids("question_ids", question_ids, "[1, m] or None", model, rows=1, least=0)
    session = _Session(model, _Prompt(context_ids, question_ids), options, max_new_tokens, prefill)
    session.check_answers_stay_compressed([session.n_prompt])
    with _running(model, options):
        logits, prefill_seconds = session.run_context(progress)
        question = session.question_ids if not options.compress_question else None
        (tokens,), question_seconds, decode_seconds = session.answer(question, logits, max_new_tokens, stop_at_eos, stop_token_ids)
    return session.result(tokens, prefill_seconds + question_seconds, decode_seconds, 0, {})


@torch.inference_mode()
def answer_log_probs_ids(
    model,
    context_ids: torch.Tensor,
    question_ids: torch.Tensor,
    answer_ids: torch.Tensor,
    options: CompressionOptions | None = None,
    *,
    prefill: dict | RecordedReconstruction | None = None,
    **settings,
) -> torch.Tensor:
    """Teacher forcing through a compressed cache: log-probabilities [a, V] (float32) of the token after the context,
    the question and the first i tokens of answer_ids [1, a], for i = 0 .. a-1 (row i: the distribution the i-th
    answer token is chosen from).

    The cache is the one `generate_ids` builds from the same context_ids [1, n], question_ids [1, m], options (or
    settings; method=None: the full cache) and prefill; the question stays out of compression
    (compress_question=True is refused) and the answer is fed in one forward after it; in decode mode, where every
    token passes through the streams, a token at a time, as `generate_ids` feeds it. With the answer `generate_ids`
    gave, each row's argmax is that answer's token.
    """
    options = build_options(options, **settings)
    if options.compress_question:
        raise ValueError("answer_log_probs_ids keeps the question out of compression, got compress_question=True")
    for name, ids in (("context_ids", context_ids), ("question_ids", question_ids), ("answer_ids", answer_ids)):
        check_token_ids(name, ids, "[1, m] with m >= 1", None if name == "context_ids" else model, rows=1)  # the context's range: `_Session`
    session = _Session(model, _Prompt(context_ids, question_ids), options, answer_ids.shape[1], prefill)
    with _running(model, options):
        session.run_context(False)
        answer = answer_ids[:, :-1].to(session.device)
        if options.mode == "decode":  # the streams may re-compress between any two answer tokens
            steps = [model(session.question_ids, past_key_values=session.cache, use_cache=True, logits_to_keep=1).logits[0]]
            steps += [model(answer[:, i : i + 1], past_key_values=session.cache, use_cache=True).logits[0] for i in range(answer.shape[1])]
            logits = torch.cat(steps)
        else:
            ids = torch.cat([session.question_ids, answer], 1)
            logits = model(ids, past_key_values=session.cache, use_cache=True, logits_to_keep=answer_ids.shape[1]).logits[0]
    return logits.float().log_softmax(-1)


@torch.inference_mode()
def answer_questions_ids(
    model, context_ids: torch.Tensor, questions_ids: list[torch.Tensor], options: CompressionOptions | None = None, *,
    max_new_tokens: int = 64, stop_at_eos: bool = True, progress: bool = False, **settings,
) -> list[GenerationResult]:
    """One context [1, n], many questions [1, m_i]: the context is prefilled and compressed once.

    Each question then starts from a snapshot of the compressed cache (`CompressedCache.restore`):
    no re-prefill, no re-compression. Every result carries the shared `prefill_seconds` (context
    prefill + compression, paid once) and its own `decode_seconds` (question forward + answer;
    `extra["question_seconds"]` is the question forward). Takes generate_ids' options except
    compress_question (a compressed question would change the compressed context) and prefill_approx (which reads one
    question after the context it approximates: `generate_ids`). In decode mode a
    compression_ratio is resolved against the context, the longest question and max_new_tokens, as generate_ids
    resolves it for one question (ratio 0 compresses nothing).
    """
    options = build_options(options, **settings)
    _check_answer_settings(max_new_tokens, stop_at_eos, progress)
    if options.compress_question:
        raise ValueError("many questions share one compressed context: compress_question=True is not possible")
    check_context_ids(context_ids)
    _check_questions(model, context_ids.shape[1], questions_ids, max_new_tokens)
    session = _Session(model, _Prompt(context_ids, None), options, max_new_tokens)
    session.check_questions(questions_ids)
    if session.mode == "decode":  # every question and answer streams too: a ratio is of the context, the longest question and answer
        session.stream_length += max(q.shape[1] for q in questions_ids)
    with _running(model, options):
        _, prefill_seconds = session.run_context(progress)
        return _answer_each(session, questions_ids, prefill_seconds, max_new_tokens, stop_at_eos)


def _check_questions(model, n_context: int, questions_ids: list[torch.Tensor], max_new_tokens: int) -> None:
    """Raise before any work when questions_ids is not a non-empty list, a question is not a token id tensor [1, m] with
    m >= 1 in the model's vocabulary, or when the context, the longest question and its answer need more positions than
    the model has."""
    check_token_id_list("questions_ids", questions_ids, "[1, m]", model)
    check_context_length(model, n_context + max(q.shape[1] for q in questions_ids), max_new_tokens)


def _answer_each(session: _Session, questions_ids: list[torch.Tensor], prefill_seconds: float, max_new_tokens: int,
                 stop_at_eos: bool) -> list[GenerationResult]:
    """Each question [1, m] appended to the session's compressed context and answered; the cache is rolled back to
    that context after each (and after the last)."""
    results = []
    compressed, seen, ids, mask = session.method_name is not None, session.cache.get_seq_length(), session.ids, session.mask
    snapshot = session.cache.snapshot() if compressed else None
    for question_ids in questions_ids:
        session.ids, session.mask = ids, mask
        session.question_ids = question_ids.to(session.device)
        session.n_prompt = session.n_context + question_ids.shape[1]
        (tokens,), question_seconds, decode_seconds = session.answer(session.question_ids, None, max_new_tokens, stop_at_eos)
        results.append(session.result(tokens, prefill_seconds, question_seconds + decode_seconds, 0, {"question_seconds": question_seconds}))
        if compressed:
            session.cache.restore(snapshot)
        else:
            session.cache.crop(seen - session.cache.get_seq_length())  # the full cache rolls back by cropping (a negative count)
    return results


@torch.no_grad()  # not inference mode: the cache it returns goes on under model.generate, whose in-place writes inference tensors refuse
def compress_context_ids(model, context_ids: torch.Tensor, options: CompressionOptions | None = None, *, progress: bool = False,
                         **settings) -> CompressedCache:
    """The context [1, n] prefilled and compressed once, as `answer_questions_ids` does before its questions: the cache,
    its `token_ids` the context's, ready to `save` or to answer from (`answer_from_cache_ids`, `generate(cache=...)`).

    Takes `generate_ids`' options. A chunked cache's prompt is ended (what its streams keep stored, with
    kv_bits quantized); a decode-mode cache's streams stay live, so every later token (question,
    answer) goes through them, and its compression_ratio is resolved against the context alone
    (the questions to come are not known). The full cache (method=None), compress_question (no
    question here) and prefill_approx (which reads one question after its context: `generate_ids`) are refused. Leaves the model on the 'kvcompress' attention implementation, as
    `CompressedCache(model, method)` does.
    """
    options = build_options(options, **settings)
    if options.method is None or options.compress_question:
        given = "the full cache (method=None or 'full')" if options.method is None else f"method={options.method!r}"
        raise ValueError(
            "compress_context compresses a context once for later questions: it takes a method and the question kept out of "
            f"compression; got {given}, compress_question={options.compress_question!r}"
        )
    check_bool("progress", progress)
    check_context_ids(context_ids)
    if context_ids.shape[0] != 1:
        raise ValueError(f"compress_context takes one context (batch size 1), got batch size {context_ids.shape[0]}")
    session = _Session(model, _Prompt(context_ids, None), options, 0)  # no answer here
    with _running(model, options):
        session.run_context(progress)
    select_compressed_attention(model, keep=True)
    return session.cache


@torch.no_grad()  # not inference mode: the cache it answers from lives on, and goes on under model.generate
def answer_from_cache_ids(
    model, cache: "CompressedCache | str | os.PathLike", questions_ids: list[torch.Tensor], *, max_new_tokens: int = 64,
    stop_at_eos: bool = True,
) -> list[GenerationResult]:
    """Answer each question [1, m] from a compressed context: a `CompressedCache` with its `token_ids` (from
    `compress_context_ids`, `load_cache`) or the path of a saved one (loaded with `load_cache`).

    Each question is appended exactly after the context's tokens and decoded greedily, as
    `answer_questions_ids` does with the same settings (the cache's own `options`); the cache is
    rolled back to the context after each question, so it can be used again. Results carry
    prefill_seconds 0 (the context was compressed before).
    """
    if isinstance(cache, (str, os.PathLike)):
        cache_file.existing_file(cache, "cache")
        cache = load_cache(cache, model)
    if not isinstance(cache, CompressedCache) or cache.token_ids is None:
        raise ValueError(f"cache must be a CompressedCache holding a compressed context with its token_ids (kvc.compress_context, "
                         f"kvc.load_cache) or the path of a saved one, got {cache!r}")
    if cache.get_seq_length() != cache.token_ids.shape[1]:
        raise ValueError(f"cache holds {cache.get_seq_length()} tokens, but its token_ids are the context's {cache.token_ids.shape[1]}: "
                         "later tokens were added since it was compressed (e.g. by model.generate); roll it back with "
                         "cache.restore(cache.snapshot() taken right after compressing), or compress the context again")
    cache.check_same_model(model)
    _check_answer_settings(max_new_tokens, stop_at_eos)
    _check_questions(model, cache.token_ids.shape[1], questions_ids, max_new_tokens)
    session = _Session(model, _Prompt(cache.token_ids, None), cache.options, max_new_tokens)
    session.check_questions(questions_ids)
    session.adopt(cache)
    with _running(model, cache.options):
        return _answer_each(session, questions_ids, 0.0, max_new_tokens, stop_at_eos)


@torch.inference_mode()
def generate_batch_ids(
    model, contexts_ids: list[torch.Tensor], question_ids: torch.Tensor | None = None, options: CompressionOptions | None = None, *,
    max_new_tokens: int = 64, stop_at_eos: bool = True, progress: bool = False, pad_token_id: int | None = None, **settings,
) -> list[GenerationResult]:
    """A batch of contexts [1, n_b] (any lengths) with one question [1, m]: one answer per context, the one it gets alone.

    The batch runs in one forward, left-padded when the lengths differ: padding is never attended, kept or counted,
    each row is compressed alone and answers as it would alone. Those results share the batch's times and KV bytes
    (for the whole batch); `slots_per_layer` is the row's own; extra["batch_run"] is "one_forward". Where one forward
    cannot compress its rows apart (`_runs_one_by_one`), each context is compressed and answered as its own context
    through `generate_ids`, one after the other, giving exactly its solo answer: a padded batch in mode 'chunked' or
    'decode' (a stream takes no padding), any batch of a randomized method there or with one budget over every layer (it
    draws for all the rows at once), any batch streamed by a method whose stream scores its rows together
    (`Method.stream_rows_apart` False: AdaKV over SnapKV's scores), any batch with an approximate prefill (prefill_approx), or a padded batch with a
    method scored by its own reconstruction forward (KVzip), with one budget over every layer (budget scope "model": AdaKV with scope='model', the default) or with its budget read as memory in quantized storage; and any batch with context-calibrated compression (quality +
    calibration: each context's ratio is chosen from its own NLL). Those results are `generate_ids`' own (each with
    its own times and KV bytes) and extra["batch_run"] is "one_by_one". Every result's extra["batch_size"] is the
    number of contexts. (A padded batch through one `CompressedCache`, as `model.generate` runs it, is always one
    forward: there a stream, AdaKV with scope='model', KVzip and the default are refused with the cause.)
    """
    options = build_options(options, **settings)
    # one row each: a row more would not be answered
    check_token_id_list("contexts_ids", contexts_ids, "[1, n]", model, note=" (one context; a batch is a list of them)")
    if question_ids is not None:
        check_token_ids("question_ids", question_ids, "[1, m] or None", model, rows=1, least=0)
    pad_token_id = as_count("pad_token_id", pad_token_id, 0, optional=True)
    vocab = vocabulary_size(model)
    if pad_token_id is not None and pad_token_id >= vocab:
        raise ValueError(f"pad_token_id must be None or a token id from 0 to {vocab - 1} (the model's vocabulary of {vocab}), "
                         f"got {pad_token_id}")
    _check_answer_settings(max_new_tokens, stop_at_eos, progress)
    width = max(c.shape[1] for c in contexts_ids)
    padded = any(c.shape[1] != width for c in contexts_ids)
    batch = {"batch_size": len(contexts_ids)}
    if _runs_one_by_one(options, padded):
        results = [generate_ids(model, c, question_ids, options, max_new_tokens=max_new_tokens, progress=progress, stop_at_eos=stop_at_eos)
                   for c in contexts_ids]
        for res in results:
            res.extra = {**res.extra, **batch, "batch_run": "one_by_one"}
        return results
    pad = pad_token_id if pad_token_id is not None else (model.generation_config.pad_token_id or 0)
    ids = torch.stack([torch.cat([c.new_full((width - c.shape[1],), pad), c[0]]) for c in contexts_ids])
    mask = torch.stack([torch.arange(width) >= width - c.shape[1] for c in contexts_ids]).long()
    session = _Session(model, _Prompt(ids, question_ids, mask if padded else None), options, max_new_tokens)
    session.check_answers_stay_compressed([session.n_prompt])
    with _running(model, options):
        logits, prefill_seconds = session.run_context(progress)
        question = session.question_ids if not session.compress_question else None
        answers, question_seconds, decode_seconds = session.answer(question, logits, max_new_tokens, stop_at_eos)
    results = []
    for row, tokens in enumerate(answers):
        res = session.result(tokens, prefill_seconds + question_seconds, decode_seconds, row, {**batch, "batch_run": "one_forward"})
        res.context_tokens = contexts_ids[row].shape[1]
        res.prompt_tokens = session.n_prompt - width + res.context_tokens
        results.append(res)
    # the cache's bytes are the batch's: so is what they compare with, a full cache of the same padded batch (every row
    # its padded prompt and as many answer steps as the longest answer took)
    steps = max(len(tokens) for tokens in answers)
    batch_full = len(answers) * full_kv_bytes(model, session.n_prompt + max(steps - 1, 0), next(model.parameters()).dtype)
    for res in results:
        res.kv_bytes_full = batch_full
        if options.method is None:
            res.kv_bytes = res.peak_kv_bytes = batch_full
    return results


def _runs_one_by_one(options: CompressionOptions, padded: bool) -> bool:
    """Whether `generate_batch_ids` runs each context alone rather than the batch in one forward: with
    context-calibrated compression (a ratio per context), with an approximate prefill, for a randomized method streamed or
    with one budget over every layer, or for a padded batch that a stream would take (padding and all) or whose method
    compresses the rows of one forward together (its own reconstruction forward, one budget over every layer) or whose
    budget is read as memory in quantized storage (a row may then store other bits than another)."""
    if options.quality is not None:
        return True
    if options.prefill_approx is not None:
        return True  # the approximate prefill streams the batch (Express, which draws for every row at once)
    needs = options.compressor.requirements if options.method is not None else None
    if needs is not None and options.compressor.randomized and (options.streams or needs.budget_scope == "model"):
        return True  # drawn row by row (`CompressedLayer._draws_per_row`), which neither a stream nor one budget over layers does
    if needs is not None and options.streams and not options.compressor.stream_rows_apart:
        return True  # a stream that scores a batch's rows together (`Method.stream_rows_apart`)
    if not padded or options.streams:
        return padded
    if options.reads_memory:
        return True  # rows of other lengths may hold their budgets in other bits (`CompressionOptions.bits_for`)
    return needs is not None and (needs.needs("reconstruction") or needs.budget_scope == "model")


def compress_context(model, tokenizer, context: str, options: CompressionOptions | None = None, *, progress: bool = True,
                     **settings) -> CompressedCache:
    """`context` compressed once, for questions asked later: the cache of `compress_context_ids` on the context's
    chat-formatted ids (`build_prompt`, the part before the question), ready to `save` or to pass to `generate(cache=...)`.

        cache = kvc.compress_context(model, tokenizer, document, method="keydiff", compression_ratio=0.75, kv_bits=4)
        cache.save("doc.kvc")
        kvc.generate(model, tokenizer, cache="doc.kvc", questions=["Who?", "When?"])
    """

    if not isinstance(context, str) or not context.strip():
        raise ValueError(f"context must be a non-empty str, got {context!r}")
    options = with_repeat_prompt(build_options(options, **settings), tokenizer)
    return compress_context_ids(model, build_prompt(tokenizer, context)[0], options, progress=progress)


def build_options(options: CompressionOptions | None, **settings) -> CompressionOptions:
    """`CompressionOptions.build`, where settings that are neither options nor the method's parameters but are
    `model.generate`'s decoding settings (do_sample, temperature, num_beams, a streamer, ...) are refused as such,
    naming where they apply; a method's own parameter of such a name is the method's."""
    try:
        return CompressionOptions.build(options, **settings)
    except UnknownParameters as err:
        decoding, others = decoding_settings(err.names, settings)
        if not decoding:
            raise
        raise ValueError(f"{', '.join(decoding)} {'is one of' if len(decoding) == 1 else 'are'} model.generate's decoding settings: "
                         "kvcompress answers greedily, up to max_new_tokens or, with stop_at_eos, the end of the answer; to sample, "
                         "search beams or stream, pass a kvc.CompressedCache to model.generate as past_key_values" + others) from None


def generate(
    model,
    tokenizer,
    context: str | list[str] | None = None,
    question: str | None = None,
    options: CompressionOptions | None = None,
    *,
    questions: list[str] | None = None,
    cache: "CompressedCache | str | os.PathLike | None" = None,
    max_new_tokens: int = 64,
    progress: bool = True,
    stop_at_eos: bool = True,
    prompt_layout: "str | PromptLayout" = DEFAULT_PROMPT_LAYOUT,
    **settings,
) -> GenerationResult | list[GenerationResult]:
    """Answer `question` about `context` with a compressed cache.

    options: a `CompressionOptions`, or its fields as keyword settings, e.g.
    `method="keydiff", compression_ratio=0.5, mode="chunked"` (see `CompressionOptions` for every
    one, `generate_ids` for the modes).

    The context is compressed and the question appended exactly afterwards (kvpress's
    convention; `compress_question=True` opts in). Returns a GenerationResult with the answer
    text and stats (tokens kept per layer, KV bytes full/stored/peak, prefill, compression and
    decode time). `questions=[...]` (instead of question): one answer per question, the context
    compressed once (`answer_questions_ids`). A list of contexts: one answer per context, the one it
    gets alone, from one left-padded batch, or, where one forward cannot compress the rows apart (e.g. a
    padded batch with KVzip, the default method in mode 'prefill', or a stream; any batch with a
    calibration; `generate_batch_ids` lists every case), from each context run alone; extra["batch_run"] says which.

    cache (instead of context, options and settings): a compressed context made earlier, by
    `compress_context` or saved and given as its path (`load_cache`): `question` or
    `questions` are appended exactly after its tokens and answered with its own settings, as they
    would be after that context compressed here (`answer_from_cache_ids`).

    prompt_layout: how the question follows the context (`build_prompt`, docs/prompt_layout.md).

    Decoding is greedy, up to `max_new_tokens` or (stop_at_eos) the end of the answer, so a run gives the same answer
    each time; `model.generate` with a `CompressedCache` samples, searches beams and streams, and `model.generate`'s
    decoding settings (do_sample, temperature, num_beams, ...) are refused here, naming it (`build_options`; a method's own
    parameter of such a name is the method's).
    """

    check_questions(question, questions)
    check_bool("progress", progress)
    prompt_layout = as_prompt_layout(prompt_layout, parameter="prompt_layout")
    if cache is not None:
        if context is not None or options is not None or settings:
            raise ValueError(
                "cache=... answers from a compressed context with its own settings: pass question or questions, and no context, "
                f"options or settings (got context={'given' if context is not None else None}, options={options!r}, settings={sorted(settings)})"
            )
        _check_model_and_tokenizer(model, tokenizer)
        asked = questions if questions is not None else [question]
        questions_ids = [build_prompt(tokenizer, "", q, layout=prompt_layout)[1] for q in asked]  # the question's ids do not depend on the context
        for i, (q, ids) in enumerate(zip(asked, questions_ids)):
            if ids.shape[1] == 0:  # question=None with a tokenizer without a chat template (whose closing tokens would follow)
                raise ValueError(f"{'question' if questions is None else f'questions[{i}]'}={q!r} adds no tokens after the context with "
                                 "this tokenizer, and an answer from a compressed context (cache=...) starts from the question's "
                                 "forward: pass a question")
        results = answer_from_cache_ids(model, cache, questions_ids, max_new_tokens=max_new_tokens, stop_at_eos=stop_at_eos)
        for res in results:
            res.text = tokenizer.decode(res.token_ids, skip_special_tokens=True).strip()
        return results if questions is not None else results[0]
    if context is None:
        raise ValueError("context must be a str, got NoneType; a batch is a list of str, and cache= answers from a compressed context "
                         "(kvc.compress_context, a saved file) instead")
    contexts = context if isinstance(context, list) else [context]
    bad = [c for c in contexts if not isinstance(c, str)]
    if bad:
        raise ValueError(f"context must be a str, got {type(bad[0]).__name__}" + (" (decode bytes first, e.g. context.decode('utf-8'))" if isinstance(bad[0], bytes) else "") + "; a batch is a list of str")
    if not contexts or any(not c.strip() for c in contexts):
        raise ValueError("empty context: pass a non-empty context string (or a non-empty list of them)")
    if questions is not None and isinstance(context, list):
        raise ValueError("questions=[...] asks many questions about one context: pass one context string")
    _check_model_and_tokenizer(model, tokenizer)
    options = with_repeat_prompt(build_options(options, **settings), tokenizer)
    run = dict(max_new_tokens=max_new_tokens, progress=progress, stop_at_eos=stop_at_eos)
    if questions is not None:
        context_ids, _ = build_prompt(tokenizer, contexts[0], questions[0], layout=prompt_layout)
        questions_ids = [build_prompt(tokenizer, contexts[0], q, layout=prompt_layout)[1] for q in questions]
        results = answer_questions_ids(model, context_ids, questions_ids, options, **run)
    elif isinstance(context, list):
        prompts = [build_prompt(tokenizer, c, question, layout=prompt_layout) for c in contexts]
        results = generate_batch_ids(model, [c for c, _ in prompts], prompts[0][1], options, pad_token_id=tokenizer.pad_token_id, **run)
    else:
        context_ids, question_ids = build_prompt(tokenizer, context, question, layout=prompt_layout)
        results = [generate_ids(model, context_ids, question_ids, options, **run)]
    for res in results:
        res.text = tokenizer.decode(res.token_ids, skip_special_tokens=True).strip()
    return results if (questions is not None or isinstance(context, list)) else results[0]


def _check_answer_settings(max_new_tokens, stop_at_eos, progress: bool = False) -> None:
    """Refuse a max_new_tokens below 1 or a stop_at_eos or progress that is not a bool (a truthy string would be read as
    True)."""
    as_count("max_new_tokens", max_new_tokens, 1)
    check_bool("stop_at_eos", stop_at_eos)
    check_bool("progress", progress)



def _check_model_and_tokenizer(model, tokenizer) -> None:
    """`generate`'s model and tokenizer, each named when it is not what `kvc.load_model` returns (e.g. the two swapped)."""
    check_supported(model)
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise ValueError(f"tokenizer must be a transformers tokenizer (e.g. kvc.load_model()'s second result), got {type(tokenizer).__name__}")
