"""One checkpoint abstraction: a Hugging Face folder and a GGUF file of the same weights open
the same way, and every reader (config, tokenizer, tensor names, weights) agrees on the format
decided once by ``open_checkpoint``."""

from __future__ import annotations

import pytest
import torch

from pdserve.models import open_checkpoint
from pdserve.models.checkpoint import HFCheckpoint
from pdserve.models.gguf import GGUFCheckpoint


def test_a_folder_and_its_gguf_file_answer_alike(hf_checkpoint, gguf_file):
    folder = open_checkpoint(hf_checkpoint("llama"))
    single = open_checkpoint(gguf_file("llama", "F32"))
    assert (type(folder), folder.format) == (HFCheckpoint, "hf")
    assert (type(single), single.format) == (GGUFCheckpoint, "gguf")
    for field in ("num_hidden_layers", "hidden_size", "num_key_value_heads", "vocab_size"):
        assert getattr(folder.model_config, field) == getattr(single.model_config, field)
    assert single.tensor_names() <= folder.tensor_names() | {"lm_head.weight"}
    a, b = folder.load(torch.float32, "cpu"), single.load(torch.float32, "cpu")
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert folder.tokenizer().encode("hello world") == single.tokenizer().encode("hello world")


def test_a_folder_holding_one_gguf_is_that_file(gguf_file, tmp_path):
    (tmp_path / "model.gguf").write_bytes(gguf_file("llama", "F32").read_bytes())
    assert open_checkpoint(tmp_path).path == tmp_path / "model.gguf"


def test_bad_paths_are_errors_naming_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        open_checkpoint(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        open_checkpoint(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="config.json"):
        _ = open_checkpoint(tmp_path).model_config  # an empty folder: not a checkpoint
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ValueError, match="2 .gguf files"):
        open_checkpoint(tmp_path)
