"""Will an engine fit its memory budget? Answered as a worker would plan it, without loading a
weight: the model config from the checkpoint, the weight bytes from the model built on the
``meta`` device (a head tied to the embedding where the checkpoint has no ``lm_head.weight``, as
the loader does; GGUF weights counted dequantized, as loaded), the activations from
``engine.capacity.memory``'s estimate."""

from __future__ import annotations

import torch

from pdserve.engine.capacity import memory
from pdserve.engine.config import DEFAULT_CPU_MEMORY_BUDGET, EngineConfig
from pdserve.engine.resolved_model import ResolvedModel
from pdserve.kernels.linear import can_pack
from pdserve.models import ModelConfig, build_model
from pdserve.models.checkpoint import Checkpoint
from pdserve.models.tensor_parallel import TensorShard


def meta_weight_bytes(checkpoint: Checkpoint, mc: ModelConfig, dtype: torch.dtype,
                      packed_head: bool = False) -> int:
    """What ``engine.capacity.memory.weight_bytes`` will count for the loaded model, read from the
    safetensors headers and a ``meta``-device model (no weight is read). ``packed_head``: the
    engine packs its GEMMs, so a head tied to the embedding gets a copy of its own."""
    names = checkpoint.tensor_names()  # safetensors headers or a GGUF's tensor table
    model = build_model(mc, dtype=dtype, device="meta")
    tied = "lm_head.weight" not in names
    if tied:
        model.tie_weights()
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if tied and packed_head:
        total += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return total


def check_engine_fits(config: EngineConfig) -> int | None:
    """Plan ``config``'s KV pool as a worker on this machine would; returns the number of
    blocks (None when the budget is this process's to guess: CUDA with no explicit budget, or
    a pinned ``num_kv_blocks``). Raises what the worker would: :class:`MemoryBudgetError`,
    ``ValueError`` for a context longer than the model's or a model that does not split
    ``tensor_parallel_size`` ways, ``FileNotFoundError`` for a folder with no checkpoint.
    With tensor parallelism the plan is one rank's (each rank has the budget)."""
    resolved = ResolvedModel.of(config)
    mc, device, dtype = resolved.model_config, resolved.device, resolved.dtype
    mc = TensorShard.rank_config(mc, config.tensor_parallel_size)
    backend, max_model_len = resolved.backend, resolved.max_model_len
    budget = config.memory_budget_bytes
    if budget is None and device.type == "cpu":
        budget = DEFAULT_CPU_MEMORY_BUDGET
    if budget is None or config.num_kv_blocks is not None:
        resolved.checkpoint.tensor_names()  # a folder without weights still fails here
        return None
    packs = config.cpu_packed_gemm and can_pack(torch.empty(1, 1, dtype=dtype, device=device))
    weights = meta_weight_bytes(resolved.checkpoint, mc, dtype, packed_head=packs)
    activations = memory.estimate_activation_bytes(mc, config, dtype, max_model_len,
                                                   attention_scratch=backend != "triton")
    layer_dtypes = memory.kv_layer_dtypes(mc.num_hidden_layers, dtype, config)
    per_block = memory.kv_bytes_per_block(mc, config, layer_dtypes)
    return memory.blocks_in_budget(config, budget, weights, activations, per_block, max_model_len)
