"""The paged KV cache layout every kernel and every worker agrees on.

One tensor per layer::

    kv: (2, num_blocks, block_size, num_kv_heads, head_dim)    # [0] = keys, [1] = values

A token at position ``p`` of a sequence with block table ``bt`` lives at slot
``bt[p // block_size] * block_size + p % block_size``; ``slot_mapping`` tensors carry
those flat slot numbers. When the cache is int8, ``k_scale`` / ``v_scale`` hold one float32
scale per (kv head, channel): ``real = int8 * scale``. Block ``b`` of a layer is the
contiguous pair ``kv[:, b]``, which is what pack/unpack move between workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCacheLayer:
    """One layer's paged KV pool (see the module docstring for the layout)."""

    kv: torch.Tensor  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    k_scale: torch.Tensor | None = None  # (num_kv_heads, head_dim) float32, iff kv is int8
    v_scale: torch.Tensor | None = None  # (num_kv_heads, head_dim) float32, iff kv is int8

    def __post_init__(self) -> None:
        if self.kv.dim() != 5 or self.kv.shape[0] != 2:
            raise ValueError("kv must be (2, blocks, block_size, kv_heads, head_dim), "
                             f"got {tuple(self.kv.shape)}")
        quantized = self.kv.dtype == torch.int8
        if quantized != (self.k_scale is not None and self.v_scale is not None):
            raise ValueError("k_scale and v_scale must be given exactly when kv is int8")

    @property
    def k(self) -> torch.Tensor:  # (num_blocks, block_size, num_kv_heads, head_dim)
        return self.kv[0]

    @property
    def v(self) -> torch.Tensor:  # (num_blocks, block_size, num_kv_heads, head_dim)
        return self.kv[1]

    @property
    def is_quantized(self) -> bool:
        return self.kv.dtype == torch.int8

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[1]

    @property
    def block_size(self) -> int:
        return self.kv.shape[2]

    @property
    def bytes_per_block(self) -> int:
        return self.kv[:, 0].numel() * self.kv.element_size()
