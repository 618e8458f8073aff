"""`CompressionOptions`: what a user asks of a compressed cache, validated once (docs/design.md, "Options").

Every public entry point that compresses (`kvc.generate`, `generate_ids`, the pipeline,
`CompressedCache`, the evaluation runner) builds one `CompressionOptions` from its keyword
arguments (`CompressionOptions.build`) or takes a ready one, and hands it down by name. A layer
resolves its middle budget from it once, where the number of tokens it compresses is known
(`budget_for`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from .calibration import check_quality, load_calibration
from .checks import as_count, as_fraction, as_seed, check_bool
from .methods.base import Method, UnknownParameters
from .quantization import check_kv_bits, check_storage, slots_in_memory_of
from .methods.budget import check_sink_window, resolve_budget
from .methods.registry import build_method, default_sink_window, method_names
from .names import AUTO_KV_BITS, BUDGET_UNITS, DEFAULT_CHUNK_SIZE, KV_BITS, MODES, PREFILL_APPROXIMATIONS
from .names import DEFAULT_METHOD as DEFAULT
from .names import FULL
from .names import KVZIP_REFIT

# method=DEFAULT, what CompressionOptions is given when no method is named, is by mode the method (name, its parameters,
# and the cache settings, sink, window and stream slack, it runs with unless they are given) that kept the most of the
# full cache's answers to needles in real prose on tuning samples among those whose answer costs about a plain generate
# (docs/design.md, "Why the defaults are what they are", with the evidence in docs/results.md): KVzap's learned KVzip
# scores (`methods.kvzap`, scored from each token's hidden state as it enters the cache, no second forward) shared out by
# AdaKV over every layer's heads (scope "model") with a small per-head floor (each head keeps its own top 5 % of the
# budget). In prefill mode every layer's heads are ranked together; a stream gives each layer the share of the model's
# budget the scorer learned on its training text (`AdaKV.layer_budget`) and re-compresses to 10/11 of it (slack 0.1),
# so that it holds nearly its whole budget after each re-compression. What is kept is stored quantized and the ratio or
# budget is read as memory (budget_unit="memory"): the method keeps as many quantized slots as fit in the bytes (1 -
# ratio) of the context at full precision would take. In prefill mode in 8 bits where those bytes hold at least half the
# context that way, else in 4 bits (kv_bits="auto": `AUTO_BITS`, `AUTO_MIN_SHARE`); on the default model in float32,
# every token in 8 bits at 0.5, about 3 in 4 in 8 bits at 0.75, about 4 in 10 in 4 bits at 0.9. The streams store each
# slot in 8 bits as it enters (kv_bits=8 at every ratio: "auto" reads the context's length, which a stream knows only as
# announced, `stream_length`), about 3.2 times the slots full precision holds in float32. On tuning needles at equal memory,
# quantized slots kept more of the full cache's answers than fewer tokens at full precision, in every mode; in prefill
# mode 8-bit slots kept more than every token in 4 bits at 0.75, and fewer than 4-bit slots at 0.9, where 8 bits hold
# about 3 tokens in 10; in decode mode 8-bit slots kept more than 4-bit ones at 0.75 and at 0.9. It needs a
# KVzap scorer for the model: the package ships the default model's; for another model `kvcompress train-scorer` writes
# one (AdaKV over KVzap, scorer=its path), or name another method.
DEFAULT_METHODS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "prefill": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05}, {"kv_bits": AUTO_KV_BITS, "budget_unit": "memory"}),
    "chunked": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05}, {"slack": 0.1, "kv_bits": 8, "budget_unit": "memory"}),
    "decode": ("adakv", {"scorer": "kvzap", "scope": "model", "alpha_safeguard": 0.05}, {"slack": 0.1, "kv_bits": 8, "budget_unit": "memory"}),
}
# kv_bits AUTO_KV_BITS ("auto", budget_unit "memory", mode "prefill"): the most bits of AUTO_BITS at which the bytes the
# ratio leaves hold at least AUTO_MIN_SHARE (a fraction, numerator and denominator) of the context's middle tokens, else
# the fewest (`CompressionOptions._auto_bits`)
AUTO_BITS = (8, 4)
AUTO_MIN_SHARE = (1, 2)
# KVZIP_REFIT: the prefill default before KVzap, kept by name. KVzip's exact reconstruction scores ranked across every
# layer's heads (AdaKV, scope "model", per-head floor 5 %), every token ranked (no exact window), and the kept slots
# refitted to carry the whole middle's attention mass (log-weights) and output (values) for KVzip's reconstruction
# queries (attention matching). It kept the most of the full cache's answers on the project's prose needles, but one
# answer costs a second forward over the context plus the refits: 7.1x a plain `model.generate` at 2k tokens (one
# thread, 2026-12-02, `benchmarks/default_cost.py`, docs/results.md), 12.7x at 4k when measured on 2026-11-29, growing
# with the length. KVzip needs the whole context: mode "prefill" only.
NAMED_SETTINGS: dict[str, dict[str, tuple[str, dict[str, Any], dict[str, Any]]]] = {
    DEFAULT: DEFAULT_METHODS,
    KVZIP_REFIT: {"prefill": ("adakv", {"scorer": "kvzip", "scope": "model", "alpha_safeguard": 0.05, "refit": "log_weights_values"},
                              {"window": 0})},
}


def without_storage(settings: dict[str, Any]) -> dict[str, Any]:
    """A named setting's cache settings (`NAMED_SETTINGS`) less its storage, kv_bits and budget_unit: the same method at
    full precision, its budget in tokens (what the tuning runs that chose the defaults compare against)."""
    return {k: v for k, v in settings.items() if k not in ("kv_bits", "budget_unit")}


def block_settings(mode: str, chunk_size: int) -> dict[str, int]:
    """{"chunk_size": chunk_size} for a streaming mode, nothing for mode "prefill", which prefills in one forward and refuses
    another chunk_size than the default: what a caller that runs several modes with one block size passes."""
    return {} if mode == "prefill" else {"chunk_size": chunk_size}


def resolve_method(method: str, mode: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(registered name, method parameters, cache settings: sink, window, slack, kv_bits, budget_unit) that `method` stands
    for in `mode`: a name of `NAMED_SETTINGS` (DEFAULT: the mode's default, `DEFAULT_METHODS`; KVZIP_REFIT) its entry
    for the mode, any other name itself, with no parameters or settings."""
    if method not in NAMED_SETTINGS:
        return method, {}, {}
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    by_mode = NAMED_SETTINGS[method]
    if mode not in by_mode:
        raise ValueError(f"method {method!r} runs in mode {' or '.join(map(repr, by_mode))} only, got mode={mode!r}")
    name, params, exact = by_mode[mode]
    return name, dict(params), dict(exact)


@dataclass(frozen=True)
class CompressionOptions:
    """One compressed generation's settings; invalid values are refused when it is built.

    method: a registered method name (`kvc.methods()`), DEFAULT (the default: the best measured
    method for the mode, `DEFAULT_METHODS`, resolved to its name and parameters when built; with a
    calibration, the method the calibration was fitted for), KVZIP_REFIT ("kvzip_refit": the slow,
    prefill-only default before KVzap, `NAMED_SETTINGS`), or
    None for the full, uncompressed cache (which then takes no budget, ratio, slack or method
    parameters; FULL, "full", its name on the command line and in an evaluation's records, is read as None). method_params: the method's own parameters (its dataclass fields), checked by
    building it (`compressor`); the default method takes none (name the method to set them).
    budget / compression_ratio: exactly one for a method. budget is the middle budget per KV head
    (sink and window come on top); compression_ratio is the fraction of the tokens removed (both
    measured in memory with budget_unit "memory"), resolved by each layer against the tokens it
    compresses (`budget_for`).
    mode: "prefill" (compress the first forward once), "chunked" (stream the prompt in blocks of
    `chunk_size`), "decode" (stream every token, the answer's included).
    sink / window: exact tokens at the start and end; None is the method's own default (`default_sink`, `default_window`).
    seed: the seed of randomised methods (each layer draws from its own generator).
    slack: the room a re-compressing stream fills before it compresses again, as a fraction of what
    it compresses back to, both within the budget (`methods.budget.stream_split`: 0.5 compresses to
    2/3 of the budget; None: the method's default); chunked and decode modes only, and an error for
    a method whose stream never re-compresses (Express, SubGen).
    chunk_size: block size of the chunked and decode modes' prompt (and of an approximate prefill); in
    mode "prefill" without prefill_approx the context goes in one forward, and another chunk_size than the
    default is an error rather than ignored.
    compress_question: the question goes through compression with the context (default: it is
    appended exactly afterwards, as kvpress does).
    quality + calibration (a `kvcompress.calibration.Calibration` or its JSON path, loaded when the
    options are built), in place of budget and compression_ratio: context-calibrated compression,
    the smallest compression whose predicted quality meets `quality` (in (0, 1]), chosen from the
    context's own NLL when it is known (`calibrated`). The curve predicts the quality of the method
    it was fitted for, with its parameters, so that method runs: with no method named (DEFAULT) the
    calibration's method and parameters are used; a method named must be the calibration's (another
    is an error naming both), and method parameters given must agree with the calibration's (theirs
    fill the rest).
    kv_bits: None (full precision; for a named setting, unset: its own bits, the default's "auto" in prefill mode and
    8 in the streams; the default at full precision is its method named with its parameters, `DEFAULT_METHODS`)
    or 8, 4, 2: the compressed context is stored quantized, keys per
    channel and values per slot in groups of `kv_group_size` (default 32), KIVI's scheme
    (`kvcompress.quantization`). What is quantized is what compression keeps: in prefill mode the
    compressed first forward, once it is done. Its exact sink and window, and in prefill and chunked modes every
    later token (question, answer), stay at full precision. In chunked and decode modes the stream itself stores
    its slots quantized, keys and values each per slot (a slot is quantized once, as it enters the stream): a
    block-wise stream's buffer (`quantization.QuantizedSlots`) and a native stream's state
    (`methods.base.QuantizedState`) alike; when a chunked prompt ends, what its stream keeps is stored as a
    prefilled context is (keys per channel). "auto" (budget_unit "memory", mode "prefill",
    the default's there): each layer picks its bits from the bytes the ratio leaves, 8 where 8-bit slots in them hold
    at least half the context's middle tokens, else 4 (`AUTO_BITS`, `AUTO_MIN_SHARE`).
    repeat_prompt_ids: for a method scored by a reconstruction forward (KVzip, and AdaKV over its scores), the token
    ids of the repeat instruction placed before each repeated chunk of the context (`kvc.generate` renders
    "Repeat the previous context exactly." through the tokenizer's chat template when none is given:
    `integration.reconstruction.with_repeat_prompt`); None repeats the context with no instruction. A method
    without a reconstruction forward takes none.
    budget_unit: what budget and compression_ratio measure: "tokens" (slots per head, and the fraction of the tokens
    removed, kvpress's convention) or "memory" (the KV bytes of that many tokens at full precision). With kv_bits,
    "memory" keeps as many quantized slots as fit in the bytes the budget or ratio gives the middle at full precision
    (`quantization.slots_in_memory_of`; a stream's slots as they enter it, keys per slot), at most every middle token;
    without kv_bits the two are the same. None: "memory" for the default, "tokens" otherwise. A calibration (its
    curve fitted in tokens) refuses "memory".
    prefill_approx: None (the context's prefill is exact) or "express": the context's keys and values come from a
    chunked forward with Thinformer Express attention, which the method then compresses (`integration.prefill_approx`);
    mode "prefill" with the question kept out of compression only.
    """

    method: str | None = DEFAULT
    method_params: dict[str, Any] = field(default_factory=dict)
    budget: int | None = None
    compression_ratio: float | None = None
    mode: str = "prefill"
    sink: int | None = None
    window: int | None = None
    seed: int = 0
    slack: float | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    compress_question: bool = False
    quality: float | None = None
    calibration: Any = None
    kv_bits: int | str | None = None
    kv_group_size: int | None = None
    repeat_prompt_ids: tuple[int, ...] | None = None
    prefill_approx: str | None = None
    budget_unit: str | None = None
    compressor: Method | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self):
        if self.method is not None and not isinstance(self.method, str):  # named before it is looked up (a list is unhashable)
            raise ValueError(f"method must be a method's name (a str: one of the named settings {', '.join(map(repr, NAMED_SETTINGS))} "
                             f"or a registered method, kvc.methods()) or None for the full cache, got {self.method!r}")
        asked = self.method
        if self.method == FULL:
            object.__setattr__(self, "method", None)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        check_bool("compress_question", self.compress_question)
        if self.compress_question and self.mode == "decode":
            raise ValueError("compress_question=True changes nothing in mode='decode', which streams the question (and the answer) "
                             "through compression anyway; leave it out")
        if not isinstance(self.method_params, dict):
            raise ValueError(f"method_params must be a dict of the method's parameters, got {self.method_params!r}")
        object.__setattr__(self, "method_params", dict(self.method_params))
        object.__setattr__(self, "seed", as_seed(self.seed))
        object.__setattr__(self, "chunk_size", as_count("chunk_size", self.chunk_size, 1))
        if self.chunk_size != DEFAULT_CHUNK_SIZE and self.mode == "prefill" and self.prefill_approx is None:
            raise ValueError(f"chunk_size={self.chunk_size} is the prompt's block size in mode 'chunked' or 'decode' (or an approximate "
                             "prefill's, prefill_approx): mode 'prefill' prefills the context in one forward, so leave it unset")
        self._check_budget_unit()
        if self.quality is not None:
            check_quality(self.quality)
        if self.calibration is not None and self.method is not None:
            self._resolve_calibration()
        if self.method in NAMED_SETTINGS:
            self._resolve_named()
        self._check_storage()  # after the named settings, which may set kv_bits
        if self.method is None:
            given = {k: v for k, v in (("budget", self.budget), ("compression_ratio", self.compression_ratio), ("slack", self.slack),
                                       ("sink", self.sink), ("window", self.window), ("kv_bits", self.kv_bits),
                                       ("repeat_prompt_ids", self.repeat_prompt_ids), ("prefill_approx", self.prefill_approx),
                                       ("budget_unit", self.budget_unit)) if v is not None}
            given.update({k: v for k, v in (("quality", self.quality), ("calibration", self.calibration)) if v is not None})
            given.update({k: v for k, v, default in (("seed", self.seed, 0), ("compress_question", self.compress_question, False))
                          if v != default})  # nothing is drawn, nothing compressed
            if given:
                raise ValueError(f"method={asked!r} is the full cache: it takes no {', '.join(given)}")
            if self.method_params:
                raise UnknownParameters(f"method={asked!r} is the full cache: it takes no parameters {sorted(self.method_params)}",
                                        sorted(self.method_params))
            return
        if self.method not in method_names():
            raise ValueError(f"unknown method {self.method!r}; choose None or {FULL!r} (the full cache), one of the named settings "
                             f"{', '.join(map(repr, NAMED_SETTINGS))}, or a registered method: {', '.join(method_names())}")
        if self.budget_unit is None:
            object.__setattr__(self, "budget_unit", "tokens")
        if self.kv_bits == AUTO_KV_BITS and (self.budget_unit != "memory" or self.mode != "prefill"):
            raise ValueError(f"kv_bits={AUTO_KV_BITS!r} picks the bits from the bytes the ratio leaves a prefilled context: it takes "
                             f"budget_unit='memory' in mode 'prefill', got budget_unit={self.budget_unit!r} in mode {self.mode!r}")
        object.__setattr__(self, "compressor", build_method(self.method, **self.method_params))
        self.compressor.check_mode(self.mode)  # a prefill-only method (KVzip) refuses chunked and decode
        self._check_model_steps()
        sink, window = check_sink_window(*default_sink_window(self.method, self.sink, self.window))
        object.__setattr__(self, "sink", sink)
        object.__setattr__(self, "window", window)
        if self.streams:
            self.compressor.check_stream_window(window)
        if self.quality is not None or self.calibration is not None:
            if self.quality is None or self.calibration is None or self.budget is not None or self.compression_ratio is not None:
                raise ValueError(
                    "context-calibrated compression takes quality and calibration together, and no budget or compression_ratio; "
                    f"got quality={self.quality!r}, calibration={self.calibration!r}, budget={self.budget!r}, "
                    f"compression_ratio={self.compression_ratio!r}"
                )
        else:
            resolve_budget(10**9, self.budget, self.compression_ratio, 0, 0)  # exactly one, each in range
            # ... kept as Python numbers (a NumPy number or 0-d tensor given), as `to_dict` writes them
            if self.budget is not None:
                object.__setattr__(self, "budget", as_count("budget", self.budget, 1))
            else:
                object.__setattr__(self, "compression_ratio", as_fraction("compression_ratio", self.compression_ratio,
                                                                          "the fraction of tokens removed"))
        if self.slack is not None:
            if self.mode == "prefill":
                raise ValueError(f"slack={self.slack!r} sets how streams re-compress: it applies to mode 'chunked' or 'decode', not 'prefill'")
            self.compressor.stream_slack(self.slack)

    def _check_model_steps(self) -> None:
        """repeat_prompt_ids (a non-empty sequence of token ids, kept as a tuple) only for a method scored by a reconstruction
        forward; prefill_approx one of `PREFILL_APPROXIMATIONS`, in mode "prefill" with the question kept out of compression."""
        ids = self.repeat_prompt_ids
        if ids is not None:
            if not self.compressor.requirements.needs("reconstruction"):
                raise ValueError(f"repeat_prompt_ids is the instruction of a reconstruction forward (KVzip's); method {self.method!r} "
                                 "runs none: leave it unset")
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not len(ids) or \
                    not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):  # a set or dict has no order
                raise ValueError(f"repeat_prompt_ids must be a non-empty sequence (list or tuple) of token ids (ints >= 0), got {ids!r}")
            object.__setattr__(self, "repeat_prompt_ids", tuple(ids))
        if self.prefill_approx is not None:
            if self.prefill_approx not in PREFILL_APPROXIMATIONS:
                raise ValueError(f"prefill_approx must be one of {PREFILL_APPROXIMATIONS} or None, got {self.prefill_approx!r}")
            if self.mode != "prefill" or self.compress_question:
                raise ValueError(
                    "prefill_approx computes the context's cache approximately, compresses it with the method, then reads the "
                    f"question exactly: it needs mode='prefill' and compress_question=False (got mode={self.mode!r}, "
                    f"compress_question={self.compress_question!r})"
                )
            if self.method is not None and self.compressor.requirements.needs("hidden_states"):
                raise ValueError(f"prefill_approx={self.prefill_approx!r} records each layer's queries, keys and values, and method "
                                 f"{self.method!r} scores the layers' hidden states (KVzap), which it does not keep: use a method "
                                 "that reads no hidden states (e.g. 'snapkv'), or leave prefill_approx unset")

    def _resolve_calibration(self) -> None:
        """calibration loaded (`load_calibration`), and the method it was fitted for set with its parameters: method=DEFAULT
        becomes that method, another named method is refused, and method_params given must agree with the calibration's."""
        calibration = load_calibration(self.calibration)
        object.__setattr__(self, "calibration", calibration)
        if self.method not in (DEFAULT, calibration.method):
            raise ValueError(
                f"calibration was fitted for method {calibration.method!r}, got method={self.method!r}: its curve predicts the "
                f"quality of {calibration.method!r} only; fit one for {self.method!r} (kvc.calibrate(model, tokenizer, samples, "
                f"method={self.method!r}), `kvcompress calibrate --method {self.method}`), or name no method to run {calibration.method!r}"
            )
        clash = {k: v for k, v in self.method_params.items() if calibration.method_params.get(k, v) != v}
        if clash:
            raise ValueError(f"method parameters {clash} differ from those the calibration was fitted with, {calibration.method_params}; "
                             "its curve predicts the quality of the method with those")
        object.__setattr__(self, "method", calibration.method)
        object.__setattr__(self, "method_params", {**calibration.method_params, **self.method_params})

    def _resolve_named(self) -> None:
        """A name of `NAMED_SETTINGS` (DEFAULT, KVZIP_REFIT) becomes the registered method it stands for in this mode, with
        its parameters and its cache settings (sink, window, slack, kv_bits, budget_unit) where none are given."""
        name, params, exact = resolve_method(self.method, self.mode)
        if self.method_params:
            raise UnknownParameters(f"method parameters {sorted(self.method_params)} need a registered method: {self.method!r} in mode "
                                    f"{self.mode!r} is {name!r} with {params or 'its own defaults'}; pass method={name!r} with the "
                                    "parameters you want", sorted(self.method_params))
        if exact.get("kv_bits") == AUTO_KV_BITS and self.kv_bits is None and self.budget_unit == "tokens":
            raise ValueError(f"budget_unit='tokens' with {self.method!r} in mode {self.mode!r}: its bits are picked from the memory the "
                             f"ratio leaves (kv_bits={AUTO_KV_BITS!r}); pass kv_bits (8, 4 or 2) to store quantized slots at a "
                             f"budget in tokens, name the method (method={name!r} with its parameters {params}) to keep full "
                             "precision, or leave budget_unit unset")
        object.__setattr__(self, "method", name)
        object.__setattr__(self, "method_params", dict(params))
        for key, value in exact.items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)

    def _check_budget_unit(self) -> None:
        """budget_unit None or one of BUDGET_UNITS, and not "memory" beside a calibration."""
        if self.budget_unit is not None and self.budget_unit not in BUDGET_UNITS:
            raise ValueError(f"budget_unit must be one of {BUDGET_UNITS} (what budget and compression_ratio measure) or None, "
                             f"got {self.budget_unit!r}")
        if self.budget_unit == "memory" and self.calibration is not None:
            raise ValueError("budget_unit='memory' with a calibration: its curve predicts quality from the fraction of tokens kept; "
                             "leave budget_unit unset")

    def _check_storage(self) -> None:
        """kv_bits and kv_group_size checked, kv_group_size resolved when kv_bits is set (`quantization.check_storage`);
        kv_bits AUTO_KV_BITS ("auto") kept as given."""
        auto = isinstance(self.kv_bits, str) and self.kv_bits == AUTO_KV_BITS
        if not auto:
            try:
                check_kv_bits(self.kv_bits)
            except ValueError:
                raise ValueError(f"kv_bits must be None (full precision), one of {', '.join(map(str, KV_BITS))} (bits per stored key and "
                                 f"value element) or {AUTO_KV_BITS!r} (the bits picked from the bytes the ratio leaves), got {self.kv_bits!r}") from None
        bits, group_size = check_storage(AUTO_BITS[0] if auto else self.kv_bits, self.kv_group_size)
        object.__setattr__(self, "kv_bits", AUTO_KV_BITS if auto else bits)
        object.__setattr__(self, "kv_group_size", group_size)

    @classmethod
    def build(cls, options: "CompressionOptions | None" = None, **settings) -> "CompressionOptions":
        """`options` as given, or options from keyword settings: this class's fields by name, any other name a method parameter."""
        if options is not None:
            if not isinstance(options, CompressionOptions):
                raise ValueError(f"options must be a CompressionOptions, got {options!r}")
            if settings:
                raise ValueError(f"pass either options=CompressionOptions(...) or keyword settings, not both (got {sorted(settings)})")
            return options
        names = {f.name for f in fields(cls) if f.init}
        params = {k: v for k, v in settings.items() if k not in names}
        known = {k: v for k, v in settings.items() if k in names}
        if params and known.get("method_params"):
            raise ValueError(f"pass method parameters either in method_params or as keywords, not both (got {sorted(params)})")
        try:
            return cls(**known, **({"method_params": params} if params else {}))
        except UnknownParameters as err:
            if not set(err.names) <= set(params):  # not a keyword of this call's (a scorer's own parameters)
                raise
            # a misspelt option would otherwise be reported as a method parameter alone
            raise UnknownParameters(f"unknown setting(s) {err.names}: not an option ({', '.join(sorted(names))}), and {err}",
                                    err.names) from None

    def to_dict(self) -> dict[str, Any]:
        """The settings by field name (what `CompressionOptions(**d)` builds again), e.g. to save with a cache."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    @property
    def streams(self) -> bool:
        """Whether the cache streams tokens through the method (chunked and decode modes)."""
        return self.mode != "prefill"

    def calibrated(self, compression_ratio: float) -> "CompressionOptions":
        """These options with the ratio a calibration chose in place of quality and calibration."""
        return replace(self, quality=None, calibration=None, compression_ratio=compression_ratio)

    @property
    def reads_memory(self) -> bool:
        """Whether the budget depends on the stored slots' size: budget or compression_ratio read as memory with kv_bits."""
        return self.budget_unit == "memory" and self.kv_bits is not None

    def token_budget_for(self, length: int) -> int:
        """The middle budget per KV head in full-precision tokens for `length` tokens, before any memory reading
        (`budget_for`): what a check reads before the layers' shapes are known (the reading raises no other error)."""
        return resolve_budget(length, self.budget, self.compression_ratio, self.sink, self.window, self.compressor, streaming=self.streams)

    def _quantized_budget(self, length: int | None, head_dim: int | None, dtype: torch.dtype | None) -> tuple[int, int] | None:
        """With the budget read as memory in kv_bits storage (`reads_memory`): (the quantized slots that fit the bytes of the
        full-precision middle budget, at most every middle token (`quantization.slots_in_memory_of`), their bits: kv_bits,
        or with AUTO_KV_BITS those `_auto_bits` picks); None where quantizing buys no slot (the full-precision budget keeps
        every middle token of `length` already, or fits no more slots quantized), so the layer keeps the full-precision
        budget at full precision. None when the budget is not read as memory."""
        if not self.reads_memory:
            return None
        middle = self.token_budget_for(length)
        every = None if length is None else length - self.sink - self.window  # None: a stream of unknown length
        if every is not None and middle >= every:
            return None
        if head_dim is None or dtype is None:
            raise ValueError("a budget read as memory with kv_bits needs the layer's head_dim and dtype to resolve a budget")
        keys_axis = "token" if self.streams else "channel"  # a stream quantizes each slot as it enters (`QuantizedSlots`)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if self.kv_bits == AUTO_KV_BITS:
            if every is None:
                raise ValueError(f"kv_bits={AUTO_KV_BITS!r} picks the bits from the context's length, which is not known here")
            bits, fit = self._auto_bits(middle, every, head_dim, itemsize)
        else:
            bits, fit = self.kv_bits, slots_in_memory_of(middle, self.kv_bits, self.kv_group_size, head_dim, itemsize, keys_axis)
        if every is not None:
            fit = min(fit, every)
        return (fit, bits) if fit > middle else None

    def _auto_bits(self, middle: int, every: int, head_dim: int, itemsize: int) -> tuple[int, int]:
        """kv_bits AUTO_KV_BITS: (bits, the slots that fit) for the most bits of AUTO_BITS whose slots, in the bytes of
        `middle` full-precision slots of a prefilled context (keys per channel), hold at least AUTO_MIN_SHARE of its
        `every` middle tokens; else for the fewest. Integer arithmetic."""
        share_num, share_den = AUTO_MIN_SHARE
        for bits in AUTO_BITS:
            fit = slots_in_memory_of(middle, bits, self.kv_group_size, head_dim, itemsize, "channel")
            if share_den * fit >= share_num * every:
                break
        return bits, fit

    def storage_for(self, length: int | None, head_dim: int | None = None, dtype: torch.dtype | None = None) -> tuple[int, int | None]:
        """(middle budget per KV head, bits it is stored in) for a layer that compresses `length` tokens (a stream: all the
        tokens it will take; None with a budget: not known) of `head_dim` in `dtype`. With the budget or ratio read as
        memory in kv_bits storage (`reads_memory`), the quantized slots that fit its bytes and their bits
        (`_quantized_budget`), or, where quantizing buys no slot (a ratio of 0, a budget of every token, a budget too
        small for a key group's scales), the full-precision budget at full precision; otherwise the budget in tokens, in
        kv_bits (head_dim and dtype not read)."""
        quantized = self._quantized_budget(length, head_dim, dtype)
        if quantized is not None:
            return quantized
        return self.token_budget_for(length), None if self.reads_memory else self.kv_bits

    def bits_for(self, length: int | None, head_dim: int | None = None, dtype: torch.dtype | None = None) -> int | None:
        """The bits of `storage_for`."""
        return self.storage_for(length, head_dim, dtype)[1]

    def budget_for(self, length: int | None, head_dim: int | None = None, dtype: torch.dtype | None = None) -> int:
        """The middle budget of `storage_for`."""
        return self.storage_for(length, head_dim, dtype)[0]
