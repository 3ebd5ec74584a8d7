"""pdserve.models: the Llama-family decoder, Hugging Face checkpoint loading and tokenizer.

``open_checkpoint(path)`` opens a Hugging Face folder or a GGUF file once; its config,
tokenizer and weights are read from it (``load_model(path)`` is the shortcut to the weights);
``tiny_model_dir()`` generates the built-in tiny model (random weights, gibberish output).
"""

from pdserve.models.attention import Attention, AttentionMetadata
from pdserve.models.checkpoint import Checkpoint, load_model, open_checkpoint
from pdserve.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from pdserve.models.llama import MODEL_REGISTRY, LlamaForCausalLM, build_model
from pdserve.models.rope import build_cos_sin_cache
from pdserve.models.tiny import tiny_model_dir
from pdserve.models.tokenizer import Tokenizer

__all__ = [
    "MODEL_REGISTRY", "SUPPORTED_MODEL_TYPES", "Attention", "AttentionMetadata", "Checkpoint",
    "LlamaForCausalLM", "ModelConfig", "Tokenizer", "build_cos_sin_cache", "build_model",
    "load_model", "open_checkpoint", "tiny_model_dir",
]
