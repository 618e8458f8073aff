"""The names and defaults the command line checks while parsing and shows in its help: their one home.

Plain values with no imports, so the parser reads them without torch or transformers (seconds of
start-up that `--help` and an argument error must not pay). The library imports them from here
(each comment names the module that uses the value, under the name it has there); none is a copy.

METHODS lists the registered methods (a method registers itself with `methods.registry.register`
when its module is imported, which needs torch): a new method's name is added here too, and
tests/test_cli.py checks that this list is the registry's.
"""

# kvcompress.methods.registry.method_names(): every registered method
METHODS = ("adakv", "balancekv", "clustergen", "compactor", "expected_attention", "express", "h2o", "hybrid", "keydiff", "knorm",
           "kvzap", "kvzip", "pyramidkv", "random", "snapkv", "streamingllm", "subgen", "tova")
DEFAULT_METHOD = "default"  # kvcompress.options.DEFAULT
KVZIP_REFIT = "kvzip_refit"  # kvcompress.options.KVZIP_REFIT: the prefill default before KVzap, by name
FULL = "full"  # the uncompressed cache, by name: the command line's --method full and the sweeps' records
MODES = ("prefill", "chunked", "decode")  # kvcompress.options.MODES
DEFAULT_CHUNK_SIZE = 256  # kvcompress.options.DEFAULT_CHUNK_SIZE
PREFILL_APPROXIMATIONS = ("express",)  # kvcompress.integration.prefill_approx: how a context's prefill may be approximated
# kvcompress.integration.model.PROMPT_LAYOUTS: name -> (separator, primed), the fields of its PromptLayout
PROMPT_LAYOUTS = {
    "blank_line": ("\n\n", False),
    "newline": ("\n", False),
    "blank_line_primed": ("\n\n", True),
    "newline_primed": ("\n", True),
}
# kvcompress.integration.model.DEFAULT_PROMPT_LAYOUT. Chosen on the prose name needle's tuning seeds at 2k tokens, in two
# bodies of prose (docs/prompt_layout.md): in both, priming beat both unprimed layouts, the blank line was no worse than
# the newline primed, and unprimed (a call without an answer prefix) the blank line did better.
DEFAULT_PROMPT_LAYOUT = "blank_line_primed"
KV_BITS = (8, 4, 2)  # kvcompress.quantization.KV_BITS
# kvcompress.options.CompressionOptions.kv_bits: the bits picked per layer from the bytes the ratio leaves (AUTO_BITS)
AUTO_KV_BITS = "auto"
BUDGET_UNITS = ("tokens", "memory")  # kvcompress.options.CompressionOptions.budget_unit: what budget and compression_ratio measure
DTYPES = ("float32", "bfloat16", "float16")  # kvcompress.integration.model.DTYPES: the names of its torch dtypes

CALIBRATION_RETENTIONS = (0.1, 0.25, 0.5, 0.75, 0.9)  # kvcompress.integration.calibrate_model.DEFAULT_RETENTIONS

SWEEP_RATIOS = (0.5, 0.75, 0.9)  # kvcompress.eval.runner.DEFAULT_RATIOS
# kvcompress.eval.runner.DEFAULT_LENGTHS. "8k" is 8000 context tokens: the default model's 8192 positions must also
# hold the question and the answer.
SWEEP_LENGTHS = (2048, 4096, 8000)
# kvcompress.eval.runner.DEFAULT_SAMPLES: samples per (task, length); one sample moves a score by at most 1/30 (3.3 points).
SWEEP_SAMPLES = 30
APPROX_RATIOS = (0.5, 0.75, 0.875, 0.9375)  # kvcompress.eval.approx.DEFAULT_APPROX_RATIOS
APPROX_LAYERS = (1, 2, 5, 15)  # kvcompress.eval.approx.DEFAULT_APPROX_LAYERS
PERPLEXITY = "perplexity"  # kvcompress.eval.perplexity.PERPLEXITY: the task's name (and its benchmark's, for the leaderboard)
PERPLEXITY_BLOCK = 64  # kvcompress.eval.perplexity.DEFAULT_BLOCK
PERPLEXITY_DOCUMENTS = 30  # kvcompress.eval.perplexity.DEFAULT_DOCUMENTS
PERPLEXITY_CONTEXT_FRACTION = 0.75  # kvcompress.eval.perplexity.DEFAULT_CONTEXT_FRACTION

BENCH_SECTIONS = ("overhead", "prefill", "throughput", "decode", "attention", "memory")  # kvcompress.eval.bench.SECTIONS
# kvcompress.eval.bench.SHAPES: name -> (KV heads, query heads, head dimension), the fields of its Shape
BENCH_SHAPES = {
    "smollm2": (3, 9, 64),  # the default model, SmolLM2-135M-Instruct
    "llama8b": (8, 32, 128),  # Llama-3-8B-like: 8 KV heads x 128, 32 query heads
}
BENCH_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)  # kvcompress.eval.bench.DEFAULT_SIZES
# The largest seed the library takes (`CompressionOptions.seed`, every --seed): seeds derived from it (a task's samples, a
# bench size's tensors) stay within a torch generator's 64 bits.
MAX_SEED = 2**63 - 1
