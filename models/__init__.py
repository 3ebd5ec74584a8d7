"""pdserve.models: the Llama-family decoder, Hugging Face checkpoint loading and tokenizer.

``load_model(dir)`` + ``Tokenizer.from_dir(dir)`` serve any supported checkpoint folder;
``tiny_model_dir()`` generates the built-in tiny model (random weights, gibberish output).
"""

from pdserve.models.attention import Attention, AttentionMetadata
from pdserve.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from pdserve.models.llama import MODEL_REGISTRY, LlamaForCausalLM, build_model
from pdserve.models.loader import load_model
from pdserve.models.rope import build_cos_sin_cache
from pdserve.models.tiny import tiny_model_dir
from pdserve.models.tokenizer import Tokenizer

__all__ = [
    "MODEL_REGISTRY", "SUPPORTED_MODEL_TYPES", "Attention", "AttentionMetadata",
    "LlamaForCausalLM", "ModelConfig", "Tokenizer", "build_cos_sin_cache", "build_model",
    "load_model", "tiny_model_dir",
]
