"""Names and defaults the command line checks while parsing and shows in its help, without importing their owners.

Their owners import torch (and transformers), seconds of start-up that `--help` and an argument
error must not pay. Each constant here is a copy; tests/test_cli.py checks every one against its
owner (named beside it), so a change there fails the tests until it is made here too.
"""

# kvcompress.methods.registry.method_names(): every registered method
METHODS = ("adakv", "balancekv", "clustergen", "compactor", "expected_attention", "express", "h2o", "hybrid", "keydiff", "knorm",
           "kvzip", "pyramidkv", "random", "snapkv", "streamingllm", "subgen", "tova")
DEFAULT_METHOD = "default"  # kvcompress.options.DEFAULT
MODES = ("prefill", "chunked", "decode")  # kvcompress.options.MODES
DEFAULT_CHUNK_SIZE = 128  # kvcompress.options.DEFAULT_CHUNK_SIZE
PROMPT_LAYOUTS = ("blank_line", "newline", "blank_line_primed", "newline_primed")  # kvcompress.integration.model.PROMPT_LAYOUTS (its keys)
DEFAULT_PROMPT_LAYOUT = "blank_line_primed"  # kvcompress.integration.model.DEFAULT_PROMPT_LAYOUT
KV_BITS = (8, 4, 2)  # kvcompress.quantization.KV_BITS
DTYPES = ("float32", "bfloat16", "float16")  # kvcompress.integration.model.DTYPES (its keys)

CALIBRATION_RETENTIONS = (0.1, 0.25, 0.5, 0.75, 0.9)  # kvcompress.integration.calibrate_model.DEFAULT_RETENTIONS

SWEEP_RATIOS = (0.5, 0.75, 0.9)  # kvcompress.eval.runner.DEFAULT_RATIOS
SWEEP_LENGTHS = (2048, 4096, 8000)  # kvcompress.eval.runner.DEFAULT_LENGTHS
SWEEP_SAMPLES = 30  # kvcompress.eval.runner.DEFAULT_SAMPLES
APPROX_RATIOS = (0.5, 0.75, 0.875, 0.9375)  # kvcompress.eval.approx.DEFAULT_APPROX_RATIOS
APPROX_LAYERS = (1, 2, 5, 15)  # kvcompress.eval.approx.DEFAULT_APPROX_LAYERS
PERPLEXITY = "perplexity"  # kvcompress.eval.perplexity.PERPLEXITY
PERPLEXITY_BLOCK = 64  # kvcompress.eval.perplexity.DEFAULT_BLOCK
PERPLEXITY_DOCUMENTS = 30  # kvcompress.eval.perplexity.DEFAULT_DOCUMENTS
PERPLEXITY_CONTEXT_FRACTION = 0.75  # kvcompress.eval.perplexity.DEFAULT_CONTEXT_FRACTION

BENCH_SECTIONS = ("overhead", "prefill", "throughput", "decode", "attention", "memory")  # kvcompress.eval.bench.SECTIONS
BENCH_SHAPES = ("smollm2", "llama8b")  # kvcompress.eval.bench.SHAPES (its keys)
BENCH_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)  # kvcompress.eval.bench.DEFAULT_SIZES
