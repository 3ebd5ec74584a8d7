"""A model on disk, opened once: a Hugging Face folder (config.json, safetensors,
tokenizer.json) or a GGUF file (or a folder holding one .gguf and no config.json).

:func:`open_checkpoint` is the one place that tells the two apart; the config, the tokenizer,
the tensor names and the weights are all read from the :class:`Checkpoint` it returns, so every
reader agrees on which format a path holds.

Opening a Hugging Face folder and reading its config and tokenizer imports neither torch nor
the weight readers (the router does only that); GGUF and the weights load them when asked."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pdserve.models.config import ModelConfig
from pdserve.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from pdserve.models.gguf import GGUFCheckpoint
    from pdserve.models.tensor_parallel import TensorShard


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
        from pdserve.models.loader import hf_tensor_names  # lazy: safetensors and torch

        return hf_tensor_names(self.path)

    def load(self, dtype: torch.dtype, device: torch.device | str,
             shard: TensorShard | None = None) -> torch.nn.Module:
        from pdserve.models.loader import load_hf_model  # lazy: safetensors and torch

        return load_hf_model(self.path, self.model_config, dtype, device, shard)


def find_gguf_file(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: the path itself when it ends in ``.gguf``, or the one
    ``.gguf`` in a folder without ``config.json``; None for an ordinary checkpoint folder."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ValueError(f"{path} holds {len(found)} .gguf files ({names}); pass the one to "
                         "serve as --model path/to/file.gguf")
    return found[0] if found else None


def open_checkpoint(path: str | Path) -> HFCheckpoint | GGUFCheckpoint:
    """The checkpoint ``path`` names. Raises FileNotFoundError naming the path when there is
    none, ValueError for a folder holding several .gguf files."""
    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        from pdserve.models.gguf import GGUFCheckpoint  # lazy: gguf, numpy and torch

        return GGUFCheckpoint(gguf_file)
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    return HFCheckpoint(path)
