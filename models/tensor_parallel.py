"""Which part of each weight a tensor parallel rank holds (Megatron-style splits).

A group of ``size`` ranks splits every decoder layer so that each rank computes its own heads
and its own slice of the MLP, and one all-reduce after each block's output projection sums
the partial results (the model's ``join_tensor_group``):

* ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``: split by output rows
  (column parallel): rank r holds query heads ``[r * h / n, (r + 1) * h / n)``, the K/V heads
  those queries read, and ``intermediate_size / n`` rows of gate and of up.
* ``o_proj``, ``down_proj``: split by input columns (row parallel), matching the rows above;
  their bias is held by rank 0 alone (zeros elsewhere) so the all-reduce adds it once.
* With fewer K/V heads than ranks (GQA), each K/V head is replicated on ``n / kv_heads``
  ranks, as vLLM does; otherwise each rank holds ``kv_heads / n`` of them.
* Embedding, final norm, the per-layer norms (q/k norms are per head) and the head are
  replicated: every rank embeds, only rank 0 computes logits.

A rank's model is the plain decoder built from :meth:`TensorShard.local_config` (the same
config with 1/n of the heads and of the MLP), so the attention, the KV pool and the memory
ledger need no change: each rank's KV pool holds its own K/V heads for every block.
:func:`head_routes` says which of its heads a rank ships to each rank of another group (a
prefill group's KV into a decode group of another size).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pdserve.models.config import ModelConfig

_COLUMN_SPLIT = ("gate_proj", "up_proj")  # rows split evenly (q/k/v split by heads)
_ROW_SPLIT = ("o_proj", "down_proj")  # input columns split; bias on rank 0 only


@dataclass(frozen=True)
class TensorShard:
    """Rank ``rank`` of a tensor parallel group of ``size``."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} is outside a group of "
                             f"{self.size}")

    def check(self, config: ModelConfig) -> None:
        """Raise ValueError naming the setting when ``config`` cannot be split ``size`` ways."""
        n, kv = self.size, config.num_key_value_heads
        for name in ("num_attention_heads", "intermediate_size"):
            if getattr(config, name) % n:
                raise ValueError(f"tensor_parallel_size ({n}) must divide the model's {name} "
                                 f"({getattr(config, name)})")
        if kv % n and n % kv:
            raise ValueError(f"tensor_parallel_size ({n}) must divide the model's "
                             f"num_key_value_heads ({kv}) or be a multiple of it")

    def num_kv_heads(self, config: ModelConfig) -> int:
        """K/V heads this rank holds (one, replicated, when the group outnumbers them)."""
        return max(1, config.num_key_value_heads // self.size)

    def first_kv_head(self, config: ModelConfig) -> int:
        """The first of this rank's K/V heads in the full model."""
        return self.rank * config.num_key_value_heads // self.size

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config of this rank's model: 1/n of the query heads and of the MLP, its K/V
        heads (head_dim, layers and vocabulary unchanged)."""
        self.check(config)
        return dataclasses.replace(
            config, num_attention_heads=config.num_attention_heads // self.size,
            num_key_value_heads=self.num_kv_heads(config),
            intermediate_size=config.intermediate_size // self.size)

    @staticmethod
    def rank_config(config: ModelConfig, size: int) -> ModelConfig:
        """What each rank of a group of ``size`` computes (``config`` itself when alone; every
        rank's shapes are rank 0's)."""
        return config if size == 1 else TensorShard(0, size).local_config(config)

    def slice(self, config: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the Hugging Face tensor ``name`` of the full model ``config``
        (the tensor itself when replicated)."""
        parts = name.split(".")
        if len(parts) < 2 or parts[-1] not in ("weight", "bias"):
            return tensor
        projection, is_bias = parts[-2], parts[-1] == "bias"
        d = config.head_dim
        if projection == "q_proj":
            rows = config.num_attention_heads // self.size * d
            return tensor.narrow(0, self.rank * rows, rows)
        if projection in ("k_proj", "v_proj"):
            return tensor.narrow(0, self.first_kv_head(config) * d, self.num_kv_heads(config) * d)
        if projection in _COLUMN_SPLIT:
            rows = config.intermediate_size // self.size
            return tensor.narrow(0, self.rank * rows, rows)
        if projection in _ROW_SPLIT:
            if is_bias:
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            width = tensor.shape[1] // self.size
            return tensor.narrow(1, self.rank * width, width)
        return tensor


def head_routes(config: ModelConfig, sender: TensorShard,
                receivers: int) -> list[tuple[int, tuple[int, int]]]:
    """Which K/V heads ``sender`` (a rank of a group that computed the KV) ships to each rank
    of a group of ``receivers`` ranks that takes it: ``[(receiver rank, (first, end))]`` in
    the model's head numbering. Every receiver gets each of its heads exactly once, from the
    lowest sender rank that holds it (ranks replicating a head leave it to the first)."""
    first = sender.first_kv_head(config)
    end = first + sender.num_kv_heads(config)
    if sender.rank > 0:  # heads a lower rank holds are its to send
        lower = TensorShard(sender.rank - 1, sender.size)
        first = max(first, lower.first_kv_head(config) + lower.num_kv_heads(config))
    routes = []
    for rank in range(receivers):
        receiver = TensorShard(rank, receivers)
        start = max(first, receiver.first_kv_head(config))
        stop = min(end, receiver.first_kv_head(config) + receiver.num_kv_heads(config))
        if start < stop:
            routes.append((rank, (start, stop)))
    return routes
