"""transformers integration: the compressed cache's attention function, the default model, generate(), the pipeline."""

from ..cache import CompressedCache
from .attention import ATTENTION_NAME, kvcompress_attention
from .calibrate import calibrate
from .generate import GenerationResult, answer_questions_ids, generate, generate_batch_ids, generate_ids, use_compressed_attention
from .model import build_prompt, load_model
from .pipeline import TASK as PIPELINE_TASK  # registers the "kvcompress-text-generation" pipeline
from .pipeline import CompressedTextGenerationPipeline

__all__ = [
    "ATTENTION_NAME",
    "CompressedCache",
    "CompressedTextGenerationPipeline",
    "GenerationResult",
    "PIPELINE_TASK",
    "answer_questions_ids",
    "build_prompt",
    "calibrate",
    "generate",
    "generate_batch_ids",
    "generate_ids",
    "kvcompress_attention",
    "load_model",
    "use_compressed_attention",
]
