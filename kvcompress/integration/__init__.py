"""transformers integration: the compressed cache's attention function, the default model, generate(), the pipeline.

Importing the package registers the "kvcompress" attention (which a `CompressedCache` switches its
model to) and the "kvcompress-text-generation" pipeline; everything else loads when first used.
"""

from importlib import import_module

from . import attention  # noqa: F401  (registers the "kvcompress" attention implementation)
from .pipeline import TASK as PIPELINE_TASK  # registers the "kvcompress-text-generation" pipeline
from .pipeline import CompressedTextGenerationPipeline

_EXPORTS = {
    "ATTENTION_NAME": "kvcompress.model_support",
    "CompressedCache": "kvcompress.cache",
    "GenerationResult": "kvcompress.integration.generation",
    "answer_from_cache_ids": "kvcompress.integration.generation",
    "answer_log_probs_ids": "kvcompress.integration.generation",
    "answer_questions_ids": "kvcompress.integration.generation",
    "build_prompt": "kvcompress.integration.model",
    "calibrate": "kvcompress.integration.calibrate_model",
    "compress_context": "kvcompress.integration.generation",
    "compress_context_ids": "kvcompress.integration.generation",
    "generate": "kvcompress.integration.generation",
    "generate_batch_ids": "kvcompress.integration.generation",
    "generate_ids": "kvcompress.integration.generation",
    "kvcompress_attention": "kvcompress.integration.attention",
    "load_cache": "kvcompress.cache",
    "load_model": "kvcompress.integration.model",
    "use_compressed_attention": "kvcompress.model_support",
}

__all__ = [
    "ATTENTION_NAME",
    "CompressedCache",
    "CompressedTextGenerationPipeline",
    "GenerationResult",
    "PIPELINE_TASK",
    "answer_from_cache_ids",
    "answer_log_probs_ids",
    "answer_questions_ids",
    "build_prompt",
    "calibrate",
    "compress_context",
    "compress_context_ids",
    "generate",
    "generate_batch_ids",
    "generate_ids",
    "kvcompress_attention",
    "load_cache",
    "load_model",
    "use_compressed_attention",
]


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvcompress.integration' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
