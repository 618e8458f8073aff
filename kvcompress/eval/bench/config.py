"""`BenchConfig`: every option of a bench run, checked once when it is built, then handed whole to `run` and each section."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...checks import as_count, as_fraction, as_seed, check_distinct
from ...methods.registry import method_names
from ...names import BENCH_SECTIONS as SECTIONS
from ...names import DEFAULT_CHUNK_SIZE
from ...options import MODES
from .common import DEFAULT_SIZES, SHAPES, Shape

STREAM_CHOICES = ("native", "all", "none")

_SEQUENCES = ("sections", "methods", "shapes", "sizes", "kept", "step_contexts", "memory_sizes", "memory_modes", "threads")
# Integer options and their smallest value (of every entry, for a sequence).
_COUNTS = {
    "sizes": 2, "repeats": 1, "block": 1, "prefill_tokens": 2, "prefill_repeats": 1, "plain_every": 1, "kernel_repeats": 1,
    "throughput_tokens": 2, "throughput_repeats": 1, "decode_context": 1, "decode_tokens": 2, "step_contexts": 1, "step_repeats": 1,
    "memory_sizes": 1, "memory_budget": 1, "chunk_size": 1, "threads": 1,
}


@dataclass(frozen=True)
class BenchConfig:
    """What a bench run measures and how; the field names are `kvcompress bench`'s flags (`--memory-sizes` is memory_sizes).

    sections: among SECTIONS. methods: registered names; None is every one.
    overhead: `shapes` at token counts `sizes`, `compression_ratio` of them removed, `repeats` timed
    calls stopping after `max_seconds` (a call slower than that is not run at larger n), streams
    fed `block` tokens per update for the methods `stream` says (native, all, none).
    prefill: `prefill_tokens` of real prose, `prefill_ratio` removed, `prefill_repeats` rounds, a plain
    prefill before every `plain_every` methods, `kernel_repeats` calls of the attention-mass kernel.
    throughput: `throughput_tokens` streamed in blocks of `block` on `throughput_shape`, `throughput_repeats` runs.
    decode: greedy `decode_tokens` after a `decode_context`-token context, at each fraction in `kept`.
    attention: the decode step's attention on `step_shape` at `step_contexts`, at each `kept`, `step_repeats` calls.
    memory: `memory_method` at prompt lengths `memory_sizes`, middle budget `memory_budget`, in
    `memory_modes`, chunked mode in blocks of `chunk_size`.
    threads: torch CPU threads; () is torch's choice, several counts run everything once per count.
    model: the checkpoint directory of the model sections (None: the default model). seed: of the
    synthetic tensors and randomised methods. device, dtype: where and in what the tensors (and the model) are.

    Sequences are stored as tuples; methods=None as every registered method.
    """

    sections: Sequence[str] = SECTIONS
    methods: Sequence[str] | None = None
    shapes: Sequence[Shape] = (SHAPES["smollm2"], SHAPES["llama8b"])
    sizes: Sequence[int] = DEFAULT_SIZES
    compression_ratio: float = 0.5
    repeats: int = 3
    block: int = 128
    max_seconds: float = 30.0
    stream: str = "native"
    prefill_tokens: int = 4096
    prefill_ratio: float = 0.75
    prefill_repeats: int = 2
    plain_every: int = 4
    kernel_repeats: int = 3
    throughput_shape: Shape = SHAPES["llama8b"]
    throughput_tokens: int = 8192
    throughput_repeats: int = 3
    decode_context: int = 8000  # with the chat template, question and answer, within the default model's 8192 positions
    kept: Sequence[float] = (0.25, 0.5)
    decode_tokens: int = 32
    step_shape: Shape = SHAPES["llama8b"]
    step_contexts: Sequence[int] = (8192, 32768)
    step_repeats: int = 50
    memory_method: str = "keydiff"
    memory_sizes: Sequence[int] = (2048, 4096, 8192, 16384)
    memory_budget: int = 1024
    memory_modes: Sequence[str] = ("chunked", "prefill")
    chunk_size: int = DEFAULT_CHUNK_SIZE
    threads: Sequence[int] = ()
    model: str | None = None
    seed: int = 0
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if self.methods is None:
            object.__setattr__(self, "methods", method_names())
        for name in _SEQUENCES:
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list or tuple, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        for name, values, allowed in (("sections", self.sections, SECTIONS), ("methods", self.methods, method_names()),
                                      ("memory_modes", self.memory_modes, MODES)):
            unknown = [v for v in values if v not in allowed]
            if unknown or not values:
                raise ValueError(f"{name} must name one or more of {list(allowed)}, got {unknown or 'none'}")
        if self.memory_method not in method_names():
            raise ValueError(f"memory_method must be one of {method_names()}, got {self.memory_method!r}")
        for name, minimum in _COUNTS.items():
            value = getattr(self, name)
            if isinstance(value, tuple):
                if not value and name != "threads":
                    raise ValueError(f"{name} must hold at least one integer >= {minimum}, got none")
                object.__setattr__(self, name, tuple(as_count(name, v, minimum) for v in value))
            else:
                object.__setattr__(self, name, as_count(name, value, minimum))
        for name in _SEQUENCES:
            check_distinct(name, getattr(self, name))
        object.__setattr__(self, "seed", as_seed(self.seed))
        object.__setattr__(self, "compression_ratio", as_fraction("compression_ratio", self.compression_ratio, "the fraction of the n tokens removed"))
        object.__setattr__(self, "prefill_ratio", as_fraction("prefill_ratio", self.prefill_ratio, "the fraction of the context removed"))
        bad = [k for k in self.kept if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0.0 < k <= 1.0]
        if bad or not self.kept:
            raise ValueError(f"kept must hold fractions of the context kept, in (0, 1], got {bad or 'none'}")
        if isinstance(self.max_seconds, bool) or not isinstance(self.max_seconds, (int, float)) or not self.max_seconds >= 0:
            raise ValueError(f"max_seconds must be a number of seconds >= 0, got {self.max_seconds!r}")
        if self.stream not in STREAM_CHOICES:
            raise ValueError(f"stream must be one of {', '.join(STREAM_CHOICES)}, got {self.stream!r}")
        bad = [s for s in (*self.shapes, self.throughput_shape, self.step_shape) if not isinstance(s, Shape)]
        if bad or not self.shapes:
            raise ValueError(f"shapes, throughput_shape and step_shape must be bench Shapes (e.g. SHAPES[{', '.join(map(repr, SHAPES))}]), got {bad or 'none'}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model must be a checkpoint directory (str) or None for the default model, got {self.model!r}")
        if not isinstance(self.device, torch.device):
            raise ValueError(f"device must be a torch.device, got {self.device!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch dtype, got {self.dtype!r}")
