"""LoRA adapter folders checked without reading their weights: all a router needs to register
an adapter (no torch: the router's process never imports it).

A PEFT LoRA folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``rank_pattern``, ``alpha_pattern``, ...) and ``adapter_model.safetensors`` with one
``lora_A`` (rank, in) and one ``lora_B`` (out, rank) per adapted projection, named
``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight``.
:func:`inspect_adapter` checks the config and every tensor's name, dtype and shape (from the
safetensors header) against the base model; ``models.lora.read_adapter`` then reads the weights.
An adapter is identified by :func:`adapter_digest`, the sha256 of its two files.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from pdserve.models.config import ModelConfig, hf_tensor_shapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Hugging Face projection -> (the decoder's module under the layer, part of its fused output)
LORA_TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_KEY = re.compile(r"base_model\.model\.(model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+))"
                  r"\.lora_([AB])\.weight")
_READ_CHUNK = 1 << 20


def adapter_digest(path: str | Path) -> str:
    """The sha256 (hex) of an adapter folder's config and weights files (their names, sizes and
    bytes). FileNotFoundError when either is missing."""
    folder = Path(path)
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        file = folder / name
        digest.update(f"{name}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def _refuse(name: str, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {name!r}: {why}")


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's per-module override: the value of the first key that matches the end of
    ``module``'s dotted name, else ``default``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(name: str, folder: Path) -> dict:
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise _refuse(name, f"{folder / CONFIG_FILE} does not exist (a PEFT LoRA folder holds "
                            f"{CONFIG_FILE} and {WEIGHTS_FILE})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _refuse(name, f"cannot read {folder / CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict):
        raise _refuse(name, f"{CONFIG_FILE} must hold a JSON object")
    checks = [
        (config.get("peft_type", "LORA") == "LORA",
         f"peft_type is {config.get('peft_type')!r}; only LORA adapters are served"),
        (not config.get("use_dora"), "DoRA adapters (use_dora) are not supported"),
        (config.get("bias", "none") == "none",
         f"trained biases (bias={config.get('bias')!r}) are not supported"),
        (not config.get("modules_to_save"),
         "modules_to_save (fully trained modules) is not supported"),
        (not config.get("fan_in_fan_out"), "fan_in_fan_out weights are not supported"),
    ]
    for ok, why in checks:
        if not ok:
            raise _refuse(name, why)
    alpha = config.get("lora_alpha", config.get("r", 8))
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise _refuse(name, f"lora_alpha must be a positive number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise _refuse(name, f"{key} must be an object")
    return config


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter folder that passed :func:`inspect_adapter`."""

    name: str
    path: str
    digest: str  # adapter_digest of its files
    # "model.layers.{i}.{self_attn|mlp}.{proj}" -> (rank, scaling: alpha / r, or / sqrt(r))
    modules: dict[str, tuple[int, float]]

    @property
    def rank(self) -> int:
        """The largest rank among its projections."""
        return max(r for r, _ in self.modules.values())


_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_MAX_HEADER = 100 << 20  # a safetensors header this long is not an adapter's


def _tensor_headers(name: str, path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's (dtype, shape) from a safetensors file's header, no data read."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise _refuse(name, f"{path} does not exist (pickled adapter_model.bin weights are "
                            f"not read: convert them to safetensors)") from None
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as exc:
        raise _refuse(name, f"cannot read {path}: not a safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise _refuse(name, f"cannot read {path}: its header is not a JSON object")
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list):
            raise _refuse(name, f"cannot read {path}: tensor {key!r} has no shape")
        tensors[key] = (str(entry.get("dtype")), tuple(entry["shape"]))
    return tensors


def inspect_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int,
                    digest: str | None = None) -> AdapterFiles:
    """Check the PEFT adapter at ``path`` against the base model ``config`` without reading
    its weights. ValueError naming the adapter and what is wrong: missing files, a rank above
    ``max_rank``, a module the model lacks, shapes that do not match, or (``digest`` given)
    files that changed since they were registered."""
    folder = Path(path)
    if not folder.is_dir():
        raise _refuse(name, f"{folder} is not a folder")
    peft = _read_config(name, folder)
    tensors = _tensor_headers(name, folder / WEIGHTS_FILE)
    try:
        found = adapter_digest(folder)
    except OSError as exc:
        raise _refuse(name, f"cannot read its files: {exc}") from None
    if digest is not None and found != digest:
        raise _refuse(name, f"the files in {folder} changed since the adapter was loaded "
                            f"(sha256 {found[:12]}..., registered {digest[:12]}...); load it "
                            f"again under a new name")
    base_shapes = hf_tensor_shapes(config)
    halves: dict[tuple[str, str], tuple[int, ...]] = {}
    for key, (dtype, shape) in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise _refuse(name, f"tensor {key!r} adapts a module pdserve cannot "
                                f"(LoRA applies to the layers' {', '.join(LORA_TARGETS)})")
        module, _, parent, proj, half = match.groups()
        if proj not in LORA_TARGETS or LORA_TARGETS[proj][0].split(".")[0] != parent:
            raise _refuse(name, f"tensor {key!r}: target module {proj!r} is not one of "
                                f"{', '.join(LORA_TARGETS)}")
        if f"{module}.weight" not in base_shapes:
            raise _refuse(name, f"tensor {key!r}: the base model has no {module} "
                                f"(it has {config.num_hidden_layers} layers)")
        if dtype not in _FLOAT_DTYPES:
            raise _refuse(name, f"tensor {key!r} has dtype {dtype}")
        halves[(module, half)] = shape
    if not halves:
        raise _refuse(name, f"{WEIGHTS_FILE} holds no LoRA weights")
    modules = {}
    default_alpha = peft.get("lora_alpha", peft.get("r", 8))
    for module in sorted({m for m, _ in halves}):
        a, b = halves.get((module, "A")), halves.get((module, "B"))
        if a is None or b is None:
            raise _refuse(name, f"{module} has lora_{'A' if a is None else 'B'} missing")
        out_features, in_features = base_shapes[f"{module}.weight"]
        r = a[0] if a else 0
        if len(a) != 2 or len(b) != 2 or a[1] != in_features or b != (out_features, r):
            raise _refuse(name, f"{module}: lora_A {a} and lora_B {b} do not fit the base "
                                f"weight ({out_features}, {in_features}): expected "
                                f"({r}, {in_features}) and ({out_features}, {r})")
        if not 1 <= r <= max_rank:
            raise _refuse(name, f"{module} has rank {r}, above max_lora_rank ({max_rank}); "
                                f"raise --max-lora-rank")
        alpha = _pattern_value(peft.get("alpha_pattern") or {}, module, default_alpha)
        modules[module] = (r, alpha / (math.sqrt(r) if peft.get("use_rslora") else r))
    return AdapterFiles(name, str(folder), found, modules)
