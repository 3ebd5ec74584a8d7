"""pdserve.models: the Llama-family decoder, Hugging Face checkpoint loading and tokenizer.

``open_checkpoint(path)`` opens a Hugging Face folder or a GGUF file once; its config,
tokenizer and weights are read from it (``load_model(path)`` is the shortcut to the weights);
``tiny_model_dir()`` generates the built-in tiny model (random weights, gibberish output).

Importing the package imports none of them: the router reads a checkpoint's config and
tokenizer (``models.checkpoint``, ``models.chat_template``) without torch; each name below
loads its module on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.models.attention import Attention, AttentionMetadata
    from pdserve.models.checkpoint import Checkpoint, open_checkpoint
    from pdserve.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
    from pdserve.models.llama import MODEL_REGISTRY, LlamaForCausalLM, build_model
    from pdserve.models.loader import load_model
    from pdserve.models.rope import build_cos_sin_cache
    from pdserve.models.tiny import tiny_model_dir
    from pdserve.models.tokenizer import Tokenizer

_HOMES = {
    "Attention": "attention", "AttentionMetadata": "attention",
    "Checkpoint": "checkpoint", "open_checkpoint": "checkpoint",
    "SUPPORTED_MODEL_TYPES": "config", "ModelConfig": "config",
    "MODEL_REGISTRY": "llama", "LlamaForCausalLM": "llama", "build_model": "llama",
    "load_model": "loader",
    "build_cos_sin_cache": "rope",
    "tiny_model_dir": "tiny",
    "Tokenizer": "tokenizer",
}

__all__ = [
    "MODEL_REGISTRY", "SUPPORTED_MODEL_TYPES", "Attention", "AttentionMetadata", "Checkpoint",
    "LlamaForCausalLM", "ModelConfig", "Tokenizer", "build_cos_sin_cache", "build_model",
    "load_model", "open_checkpoint", "tiny_model_dir",
]


def __getattr__(name: str):
    """A name above from its module, or a submodule (``models.<module>``) as attribute access
    found it when this package imported them all."""
    # lazy: most of these import torch; the router's checkpoint reading does not
    home = _HOMES.get(name)
    if home is not None:
        return getattr(importlib.import_module(f"pdserve.models.{home}"), name)
    try:
        return importlib.import_module(f"pdserve.models.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"pdserve.models.{name}":
            raise
    raise AttributeError(f"module 'pdserve.models' has no attribute {name!r}")
