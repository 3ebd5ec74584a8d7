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

An adapter is identified by ``lora_files.adapter_digest``, the sha256 of its two files: the
prefix cache keys blocks by it (``AdapterRef`` in ``worker_api.adapters``), so a block is only
ever matched by a request for the very weights that computed it. Its files are checked
without torch by ``lora_files.inspect_adapter`` (what a router does to register it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pdserve.models.config import ModelConfig
from pdserve.models.lora_files import LORA_TARGETS, WEIGHTS_FILE, inspect_adapter
from pdserve.models.tensor_parallel import TensorShard


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





def read_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int,
                 digest: str | None = None) -> LoraAdapter:
    """Check the adapter at ``path`` (:func:`~pdserve.models.lora_files.inspect_adapter`,
    ValueError naming it), then read its weights: float32, B scaled, each checked finite."""
    files = inspect_adapter(name, path, config, max_rank, digest)
    weights = {}
    file = Path(files.path) / WEIGHTS_FILE
    try:
        with safe_open(str(file), framework="pt") as f:
            for module, (_, scaling) in files.modules.items():
                a = f.get_tensor(f"base_model.model.{module}.lora_A.weight").float()
                b = f.get_tensor(f"base_model.model.{module}.lora_B.weight").float()
                if not torch.isfinite(a).all() or not torch.isfinite(b).all():
                    raise ValueError(f"LoRA adapter {name!r}: {module} holds non-finite "
                                     f"weights")
                parts = module.split(".")
                weights[(int(parts[2]), parts[4])] = (a.contiguous(),
                                                      (b * scaling).contiguous())
    except SafetensorError as exc:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {file}: {exc}") from None
    return LoraAdapter(name, files.path, files.digest, weights, files.rank)


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
