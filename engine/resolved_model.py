"""What an engine config means on this machine, before any weight is read
(:class:`ResolvedModel`): the checkpoint, device, dtype, attention backend and context limit.
``EngineParts.build`` (engine/parts.py), the memory budget check and the tensor parallel
followers start from it."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.host_memory import keep_freed_host_memory
from pdserve.kernels import linear as klinear
from pdserve.kernels import resolve_backend
from pdserve.models import Checkpoint, ModelConfig, open_checkpoint
from pdserve.models.tensor_parallel import TensorShard

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedModel:
    """What an engine config means on this machine, before any weight is read."""

    checkpoint: Checkpoint
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype  # the dtype weights and activations run in
    backend: str  # attention kernels: "torch" | "native" | "triton"
    max_model_len: int  # the context limit in force

    @classmethod
    def of(cls, config: EngineConfig) -> ResolvedModel:
        checkpoint = open_checkpoint(config.model)
        mc = checkpoint.model_config
        device = config.resolve_device()
        dtype = config.resolve_dtype(getattr(mc, "torch_dtype", None), device)
        max_model_len = config.max_model_len or mc.max_position_embeddings
        if max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({mc.max_position_embeddings})")
        return cls(checkpoint, mc, device, dtype, resolve_backend(config.attention_backend, device),
                   max_model_len)

    def load_model(self, config: EngineConfig, shard: TensorShard | None = None,
                   device: torch.device | None = None) -> torch.nn.Module:
        """The weights on ``device`` (default: this machine's), packed for the CPU's GEMM
        when ``config`` says so; with ``shard``, one tensor parallel rank's part."""
        device = self.device if device is None else device
        if device.type == "cpu":
            keep_freed_host_memory()
            if self.dtype == torch.bfloat16 and not klinear.bf16_native():
                warn_bf16_emulated()
        model = self.checkpoint.load(self.dtype, device, shard)
        if config.cpu_packed_gemm:
            model.pack_linears()  # (a no-op but on a CPU in float32 or bf16)
        return model


@functools.cache
def warn_bf16_emulated() -> None:
    """Say once per process that bf16 on this CPU is emulated, so slower than float32."""
    logger.warning("dtype bfloat16 is emulated on this CPU (oneDNN has no bf16 kernels for it; "
                   "they need AVX-512, AVX512-BF16 or AMX), so it runs slower than float32 "
                   "and its linear layers are not packed; use --dtype float32 (or auto) here")
