"""Cost benchmarks (DESIGN.md §5, issue 9): what each method costs against the uncompressed baseline.

Every number is a ratio to a baseline measured in the same run (absolute times on a shared
machine are noise); times are the minimum (and median) over repeats, each a wall-clock
`time.perf_counter` interval (after a CUDA synchronise when the tensors are on CUDA).
One module per benchmark, everything re-exported here:

- `overhead`: one layer's worth of heads (synthetic tensors of a model's shapes); each method's
  one-shot `compress`, and each natively streaming method's updates over the same tokens, timed
  against one exact causal attention pass (SDPA) over the same n tokens; `fit_exponent` gives
  the growth exponent a of time ≈ c·n^a (least squares in log-log).
- `decode`: greedy-decoding tokens/s on a real model over one long context, the full cache
  against every method at the given kept fractions (one recorded prefill reused by each method);
  and the attention-only decode step (one query) over a full cache (SDPA) against a compressed
  one (`weighted_attention` over kept·n slots).
- `prefill`: end to end, the `generate` prefill with compression over a plain transformers prefill
  of the same real-prose context on the model, with each method's compression share of its own
  prefill.
- `throughput`: tokens per second a fresh stream absorbs, every method against KeyDiff's.
- `memory`: peak KV bytes the cache stores and peak process memory (resident set, Linux `VmHWM`
  reset per point) during the prompt, `prefill` vs `chunked` mode.
- `config`: `BenchConfig`, every option of a run, checked once and handed whole to `run` and to
  each section; `common`: shapes, synthetic tensors, timing, the machine line; `report`: `run` does
  it all (once per torch thread count when given several), `report` rewrites bench.md and the
  PNGs from the CSVs (`kvcompress.eval.tables` writes and reads them).
"""

from .common import DEFAULT_SIZES, SHAPES, Shape, context_ids, fit_exponent, machine_description, synthetic_layer, time_calls, write_table
from .config import SECTIONS, BenchConfig
from .decode import attention_step_rows, decode_rows, plot_decode
from .memory import memory_rows, peak_process_memory, plot_memory
from .overhead import (
    exact_attention_pass,
    exponent_rows,
    kept_budget,
    method_inputs,
    natively_streaming,
    one_shot,
    overhead_pivot,
    overhead_rows,
    plot_overhead,
    streamed,
    unfit_reason,
)
from .prefill import fused_attention_cost, prefill_rows, prefill_seconds
from .report import read_machines, report, run, write_markdown
from .throughput import throughput_rows

__all__ = [
    "DEFAULT_SIZES", "SECTIONS", "SHAPES", "BenchConfig", "Shape", "attention_step_rows", "context_ids", "decode_rows", "exact_attention_pass",
    "exponent_rows", "fit_exponent", "kept_budget", "machine_description", "memory_rows", "method_inputs",
    "natively_streaming", "one_shot", "overhead_pivot", "overhead_rows", "peak_process_memory", "plot_decode", "plot_memory",
    "plot_overhead", "prefill_rows", "prefill_seconds", "fused_attention_cost", "report", "run", "streamed",
    "synthetic_layer", "throughput_rows", "time_calls", "unfit_reason", "write_markdown", "write_table", "read_machines",
]
