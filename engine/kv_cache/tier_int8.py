"""int8 storage of a float pool's blocks in the KV tiers (``EngineConfig.kv_offload_int8``).

A block saved below the pool is quantised as an int8 pool would have written it (the
``kv_int8_scales`` scheme, its channel scales calibrated and the scheme checked against the
model dtype at start-up, as for an int8 pool: ``engine/parts.py``), and its payload is what that
int8 pool's block would be: K and V of every layer as int8, then the token scales. Loading
dequantises it into the float pool. A float32 block takes about a quarter of its bytes (a
bfloat16 one about half), so a tier of the same size holds about 3.9x (1.9x) the blocks at
head dimension 64; a prefix loaded from it is no longer bit-exact with recomputing it
(docs/kv-tiers.md).

The conversion goes through a small int8 layout of as many blocks as one save or load moves
(``staging``), written and read by the same reference functions as an int8 pool
(:func:`~pdserve.kernels.torch_ops.write_kv_torch`, :func:`~pdserve.kernels.torch_ops.dequantize`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.kernels import KVCacheLayer
from pdserve.kernels.torch_ops import dequantize, write_kv_torch


class Int8TierStorage:
    """Quantises a float pool's blocks into an int8 layout and back."""

    def __init__(self, staging: Callable[[int], list[KVCacheLayer]], description: str):
        self.staging = staging  # num_blocks -> zeroed int8 layers with the checked scales
        self.description = description  # the scheme and its start-up check (the ledger shows it)

    def quantize(self, caches: list[KVCacheLayer], block_ids: list[int]) -> list[KVCacheLayer]:
        """An int8 layout whose block ``i`` holds ``caches``' block ``block_ids[i]``."""
        staged = self.staging(len(block_ids))
        index = torch.tensor(block_ids, dtype=torch.int64, device=caches[0].kv.device)
        for pool, int8 in zip(caches, staged, strict=True):
            kv = pool.kv.index_select(1, index)  # (2, blocks, block_size, kv_heads, head_dim)
            k, v = kv.flatten(1, 2)  # (blocks * block_size, kv_heads, head_dim) each
            slots = torch.arange(k.shape[0], device=k.device)
            write_kv_torch(k, v, int8, slots)
        return staged

    def dequantize_into(self, staged: list[KVCacheLayer], caches: list[KVCacheLayer],
                        block_ids: list[int]) -> None:
        """Write ``staged``'s block ``i`` (an int8 layout) into ``caches``' ``block_ids[i]``."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=caches[0].kv.device)
        for pool, int8 in zip(caches, staged, strict=True):
            for half, scale, token_scale in ((0, int8.k_scale, int8.k_token_scale),
                                             (1, int8.v_scale, int8.v_token_scale)):
                real = dequantize(int8.kv[half], scale, pool.kv.dtype, token_scale)
                pool.kv[half].index_copy_(0, index, real)  # (blocks, block_size, heads, dim)
