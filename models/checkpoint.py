"""A model on disk, opened once: a Hugging Face folder (config.json, safetensors,
tokenizer.json) or a GGUF file (or a folder holding one .gguf and no config.json).

:func:`open_checkpoint` is the one place that tells the two apart; the config, the tokenizer,
the tensor names and the weights are all read from the :class:`Checkpoint` it returns, so every
reader agrees on which format a path holds."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

import torch

from pdserve.models.config import ModelConfig
from pdserve.models.gguf import GGUFCheckpoint, find_gguf_file
from pdserve.models.loader import SUPPORTED_DTYPES, hf_tensor_names, load_hf_model
from pdserve.models.tensor_parallel import TensorShard
from pdserve.models.tokenizer import Tokenizer


class Checkpoint(Protocol):
    path: Path
    format: str  # "hf" | "gguf"

    @property
    def model_config(self) -> ModelConfig: ...

    def tokenizer(self) -> Tokenizer: ...

    def tensor_names(self) -> set[str]:
        """Hugging Face names of the weight tensors, read without loading them."""
        ...

    def load(self, dtype: torch.dtype, device: torch.device | str,
             shard: TensorShard | None = None) -> torch.nn.Module:
        """The model in ``dtype`` on ``device``; with ``shard``, that tensor parallel rank's
        part of it."""
        ...


@dataclass(frozen=True)
class HFCheckpoint:
    """A Hugging Face checkpoint folder."""

    path: Path
    format = "hf"

    @cached_property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_hf_folder(self.path)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_hf_folder(self.path)

    def tensor_names(self) -> set[str]:
        return hf_tensor_names(self.path)

    def load(self, dtype: torch.dtype, device: torch.device | str,
             shard: TensorShard | None = None) -> torch.nn.Module:
        return load_hf_model(self.path, self.model_config, dtype, device, shard)


def open_checkpoint(path: str | Path) -> HFCheckpoint | GGUFCheckpoint:
    """The checkpoint ``path`` names. Raises FileNotFoundError naming the path when there is
    none, ValueError for a folder holding several .gguf files."""
    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        return GGUFCheckpoint(gguf_file)
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    return HFCheckpoint(path)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model of the checkpoint at ``path``, in ``dtype`` on ``device``."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}, "
                         f"got {dtype}")
    return open_checkpoint(path).load(dtype, device)
