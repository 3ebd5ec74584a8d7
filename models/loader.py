"""Load a Hugging Face checkpoint folder (config.json + safetensors) into our decoder.

Steps, in order, each with an error that names the file and tensor at fault:

1. ``config.json`` -> :class:`ModelConfig` (missing file, unsupported architecture).
2. Find the weights: ``model.safetensors.index.json`` (sharded), ``model.safetensors``, or any
   ``*.safetensors`` files in the folder.
3. Take an inventory of every tensor's name, shape and dtype without reading data, and check it
   against the shapes the config implies: unexpected tensor, missing tensor, shape mismatch,
   non-float tensor.
4. Build the model on the ``meta`` device, materialise it on ``device`` in ``dtype``, and copy
   each tensor in (q/k/v into the fused ``qkv_proj``, gate/up into ``gate_up_proj``).

``lm_head.weight`` may be absent: the head is then tied to the embedding (what transformers does
for ``tie_word_embeddings`` checkpoints, which never store it).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.models.checkpoint import open_checkpoint
from pdserve.models.config import ModelConfig, hf_tensor_shapes
from pdserve.models.llama import build_model
from pdserve.models.tensor_parallel import TensorShard

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}  # safetensors dtype names we can convert from
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved
# HF projection name -> (our fused projection, index of the slice it fills)
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def find_weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index when sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        for path in files:
            if not path.is_file():
                raise FileNotFoundError(f"{index} names shard {path.name}, which is missing "
                                        f"from {model_dir}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    hint = " (only PyTorch .bin weights found; convert them to safetensors)" if any(
        model_dir.glob("*.bin")) else ""
    raise FileNotFoundError(f"no safetensors weights (model.safetensors or "
                            f"model.safetensors.index.json) in {model_dir}{hint}")


def _inventory(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """name -> (file, shape) for every tensor, reading headers only."""
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name in found:
                    raise ValueError(f"tensor {name!r} is stored twice: in {found[name][0].name} "
                                     f"and {path.name}")
                tensor_slice = f.get_slice(name)
                dtype = tensor_slice.get_dtype()
                if dtype not in _FLOAT_DTYPES:
                    raise ValueError(f"tensor {name!r} in {path.name} has dtype {dtype}; only "
                                     "unquantized float checkpoints are supported")
                found[name] = (path, tuple(tensor_slice.get_shape()))
    return found


def check_tensors(config: ModelConfig, found: dict[str, tuple[Path, tuple[int, ...]]],
                  source: str = "config.json") -> bool:
    """Raise on any unexpected, missing or misshapen tensor; return whether to tie lm_head.
    ``source`` names where the config came from in the messages."""
    expected = hf_tensor_shapes(config)
    unexpected = sorted(n for n in found if n not in expected and not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        name = unexpected[0]
        raise ValueError(f"unexpected tensor {name!r} in {found[name][0].name} "
                         f"({len(unexpected)} unexpected in all: {unexpected[:5]}) for a "
                         f"{config.model_type} model with this {source}")
    missing = sorted(n for n in expected if n not in found and n != "lm_head.weight")
    if missing:
        raise ValueError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all: "
                         f"{missing[:5]}) in the checkpoint's weight files")
    for name, (path, shape) in found.items():
        if name in expected and shape != expected[name]:
            raise ValueError(f"tensor {name!r} in {path.name} has shape {list(shape)}, but "
                             f"{source} implies {list(expected[name])}")
    tie = config.tie_word_embeddings or "lm_head.weight" not in found
    if tie and not config.tie_word_embeddings:
        logger.warning("checkpoint has no lm_head.weight; tying it to the embedding")
    return tie


def _target(model: torch.nn.Module, name: str) -> tuple[torch.nn.Parameter, int]:
    """Our parameter for HF tensor ``name`` and the row offset its data starts at (in the
    model's own shapes: a tensor parallel rank's model is smaller than the checkpoint's)."""
    config = model.config
    parts = name.split(".")
    offset = 0
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, index = _FUSED[parts[-2]]
        if fused == "qkv_proj":
            offset = (0, config.q_size, config.q_size + config.kv_size)[index]
        else:
            offset = index * config.intermediate_size
        parts[-2] = fused
    return model.get_parameter(".".join(parts)), offset


def copy_tensor(model, config: ModelConfig, name: str, tensor: torch.Tensor,
                shard: TensorShard | None = None) -> None:
    """Copy HF tensor ``name`` of the checkpoint whose config is ``config`` into its (possibly
    fused) parameter of ``model``; with ``shard``, only that tensor parallel rank's part."""
    if shard is not None:
        tensor = shard.slice(config, name, tensor)
    param, offset = _target(model, name)
    with torch.no_grad():
        param[offset:offset + tensor.shape[0]].copy_(tensor)


def _copy_weights(model, config: ModelConfig, found, tie: bool,
                  shard: TensorShard | None) -> None:
    by_file: dict[Path, list[str]] = {}
    for name, (path, _) in found.items():
        if name.endswith(_IGNORED_SUFFIXES) or (tie and name == "lm_head.weight"):
            continue
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                copy_tensor(model, config, name, f.get_tensor(name), shard)


def load_hf_model(model_dir: Path, config: ModelConfig, dtype: torch.dtype,
                  device: torch.device | str,
                  shard: TensorShard | None = None) -> torch.nn.Module:
    """Load a Hugging Face checkpoint folder whose config is ``config``; see the module
    docstring for the steps. With ``shard``: that tensor parallel rank's model, built from its
    local config (:mod:`pdserve.models.tensor_parallel`)."""
    start = time.perf_counter()
    files = find_weight_files(model_dir)
    found = _inventory(files)
    tie = check_tensors(config, found)
    model = build_model(config if shard is None else shard.local_config(config), dtype=dtype,
                        device=device)
    if tie:
        model.tie_weights()
    _copy_weights(model, config, found, tie, shard)
    logger.info("loaded %s (%s, %.1fM params, %d file(s)) in %.2fs", model_dir.name,
                config.model_type, config.num_parameters() / 1e6, len(files),
                time.perf_counter() - start)
    return model


def hf_tensor_names(model_dir: Path) -> set[str]:
    """Names of the tensors a Hugging Face folder holds, read from the safetensors headers
    only; raises when there are no weights."""
    names: set[str] = set()
    for path in find_weight_files(model_dir):
        with safe_open(path, framework="pt") as f:
            names.update(f.keys())
    return names


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model of the checkpoint at ``path`` (Hugging Face or GGUF), in ``dtype`` on
    ``device``."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}, "
                         f"got {dtype}")
    return open_checkpoint(path).load(dtype, device)
