"""LoRA adapters on disk: a PEFT folder read, checked against the base model, and laid out for
the decoder's fused projections.

A PEFT LoRA folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``rank_pattern``, ``alpha_pattern``, ...) and ``adapter_model.safetensors`` with one
``lora_A`` (rank, in) and one ``lora_B`` (out, rank) per adapted projection, named
``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight``. The update of a
projection is ``scaling * B (A x)`` with ``scaling = alpha / r`` (``alpha / sqrt(r)`` with
rsLoRA); :func:`read_adapter` folds the scaling into B.

What pdserve serves: the seven projections of the Llama family (q, k, v, o, gate, up, down),
any subset of them in any subset of the layers, each with its own rank up to the engine's
``max_lora_rank``. Refused, with the reason: DoRA, trained biases, ``modules_to_save``, LoRA on
the embedding or the head, ``fan_in_fan_out`` weights, pickled ``adapter_model.bin`` weights,
shapes that do not match the base model.

An adapter is identified by :func:`adapter_digest`, the sha256 of its two files: the prefix
cache keys blocks by it (``AdapterRef`` in ``worker_api.adapters``), so a block is only ever
matched by a request for the very weights that computed it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pdserve.models.config import ModelConfig
from pdserve.models.loader import hf_tensor_shapes
from pdserve.models.tensor_parallel import TensorShard

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


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter read from disk: per (layer, projection), A (rank, in) and B (out, rank)
    with the scaling folded in, float32 on the CPU."""

    name: str
    path: str
    digest: str  # adapter_digest of its files
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    rank: int  # the largest rank among its projections

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    @property
    def target_modules(self) -> list[str]:
        return sorted({proj for _, proj in self.weights}, key=list(LORA_TARGETS).index)


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


def read_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int,
                 digest: str | None = None) -> LoraAdapter:
    """Read and check the PEFT adapter at ``path`` for the base model ``config``. ValueError
    naming the adapter and what is wrong: missing files, a rank above ``max_rank``, a module
    the model lacks, shapes that do not match, or (``digest`` given) files that changed since
    they were registered."""
    folder = Path(path)
    if not folder.is_dir():
        raise _refuse(name, f"{folder} is not a folder")
    peft = _read_config(name, folder)
    try:
        found = adapter_digest(folder)
    except FileNotFoundError as exc:
        raise _refuse(name, f"{exc.filename} does not exist (pickled adapter_model.bin weights "
                            f"are not read: convert them to safetensors)") from None
    except OSError as exc:
        raise _refuse(name, f"cannot read its files: {exc}") from None
    if digest is not None and found != digest:
        raise _refuse(name, f"the files in {folder} changed since the adapter was loaded "
                            f"(sha256 {found[:12]}..., registered {digest[:12]}...); load it "
                            f"again under a new name")
    base_shapes = hf_tensor_shapes(config)
    halves: dict[tuple[str, str], torch.Tensor] = {}
    try:
        with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                match = _KEY.fullmatch(key)
                if match is None:
                    raise _refuse(name, f"tensor {key!r} adapts a module pdserve cannot "
                                        f"(LoRA applies to the layers' {', '.join(LORA_TARGETS)})")
                module, layer, parent, proj, half = match.groups()
                if proj not in LORA_TARGETS or LORA_TARGETS[proj][0].split(".")[0] != parent:
                    raise _refuse(name, f"tensor {key!r}: target module {proj!r} is not one of "
                                        f"{', '.join(LORA_TARGETS)}")
                if f"{module}.weight" not in base_shapes:
                    raise _refuse(name, f"tensor {key!r}: the base model has no {module} "
                                        f"(it has {config.num_hidden_layers} layers)")
                tensor = f.get_tensor(key)
                if not tensor.is_floating_point():
                    raise _refuse(name, f"tensor {key!r} has dtype {tensor.dtype}")
                halves[(module, half)] = tensor.float()
    except SafetensorError as exc:
        raise _refuse(name, f"cannot read {folder / WEIGHTS_FILE}: {exc}") from None
    if not halves:
        raise _refuse(name, f"{WEIGHTS_FILE} holds no LoRA weights")
    weights, rank = {}, 0
    default_alpha = peft.get("lora_alpha", peft.get("r", 8))
    for module in sorted({m for m, _ in halves}):
        a, b = halves.get((module, "A")), halves.get((module, "B"))
        if a is None or b is None:
            raise _refuse(name, f"{module} has lora_{'A' if a is None else 'B'} missing")
        out_features, in_features = base_shapes[f"{module}.weight"]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features \
                or b.shape != (out_features, r):
            raise _refuse(name, f"{module}: lora_A {tuple(a.shape)} and lora_B "
                                f"{tuple(b.shape)} do not fit the base weight "
                                f"({out_features}, {in_features}): expected "
                                f"({r}, {in_features}) and ({out_features}, {r})")
        if not 1 <= r <= max_rank:
            raise _refuse(name, f"{module} has rank {r}, above max_lora_rank ({max_rank}); "
                                f"raise --max-lora-rank")
        alpha = _pattern_value(peft.get("alpha_pattern") or {}, module, default_alpha)
        scaling = alpha / (math.sqrt(r) if peft.get("use_rslora") else r)
        if not torch.isfinite(a).all() or not torch.isfinite(b).all():
            raise _refuse(name, f"{module} holds non-finite weights")
        parts = module.split(".")
        weights[(int(parts[2]), parts[4])] = (a.contiguous(), (b * scaling).contiguous())
        rank = max(rank, r)
    return LoraAdapter(name, str(folder), found, weights, rank)


# the decoder's fused modules under each layer, with the projections of their parts in order
_FUSED_PARTS = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
                "self_attn.o_proj": ("o_proj",), "mlp.gate_up_proj": ("gate_proj", "up_proj"),
                "mlp.down_proj": ("down_proj",)}
_ROW_PARALLEL = ("o_proj", "down_proj")  # their A is split by input columns, B replicated


def _linears(model: torch.nn.Module):
    for layer_idx, layer in enumerate(model.model.layers):
        for module, projections in _FUSED_PARTS.items():
            yield layer_idx, projections, layer.get_submodule(module)


def init_lora_slots(model: torch.nn.Module, slots: int, rank: int) -> int:
    """Give every adaptable projection of ``model`` zeroed pools of ``slots`` adapters of rank up
    to ``rank``; returns the bytes they take."""
    total = 0
    for _, _, linear in _linears(model):
        linear.init_lora(slots, rank)
        total += linear.lora_a.nbytes + linear.lora_b.nbytes
    return total


def write_lora_slot(model: torch.nn.Module, slot: int, adapter: LoraAdapter,
                    config: ModelConfig, shard: TensorShard | None = None) -> None:
    """Put ``adapter`` (read for the full model ``config``) in ``slot`` of every projection;
    with ``shard``, that tensor parallel rank's part: B split like the base weight's rows
    (q, k, v, gate, up), A like its input columns (o, down)."""
    for layer_idx, projections, linear in _linears(model):
        pairs = []
        for proj in projections:
            pair = adapter.weights.get((layer_idx, proj))
            if pair is not None and shard is not None:
                name = f"model.layers.{layer_idx}.{LORA_TARGETS[proj][0].split('.')[0]}." \
                       f"{proj}.weight"
                a, b = pair
                pair = ((shard.slice(config, name, a), b) if proj in _ROW_PARALLEL
                        else (a, shard.slice(config, name, b)))
            pairs.append(pair)
        linear.set_lora(slot, pairs)
