"""transformers integration: the compressed cache's attention function, the default model, generate()."""

from .attention import ATTENTION_NAME, kvcompress_attention
from .calibrate import calibrate
from .generate import GenerationResult, generate, generate_ids, use_compressed_attention
from .model import build_prompt, load_model

__all__ = [
    "ATTENTION_NAME",
    "GenerationResult",
    "build_prompt",
    "calibrate",
    "generate",
    "generate_ids",
    "kvcompress_attention",
    "load_model",
    "use_compressed_attention",
]
