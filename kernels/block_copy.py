"""Triton block pack/unpack: gather a request's KV blocks of several layers into one contiguous
buffer (the KV transfer payload) and scatter such a buffer into other block ids.

References: :func:`pdserve.kernels.torch_ops.pack_blocks_torch` / ``unpack_blocks_torch``. The
buffer is (num_layers, 2, num_ids, block_size, kv_heads, head_dim) in the pool dtype; block
``b`` of a layer is the contiguous pair ``kv[:, b]``, so each (layer, k|v, id) is one flat copy.
Scales of an int8 pool are not part of the buffer: sender and receiver must share them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._launch import (
    INDEX_DTYPES,
    check_cache,
    check_contiguous,
    check_tensor,
    interpreting,
    next_pow2,
)
from pdserve.kernels.kv_layout import KVCacheLayer


@triton.jit
def _block_copy_kernel(
    kv_ptr, buf_ptr, block_ids_ptr, stride_cache_kv, stride_cache_block, num_ids, block_numel,
    PACK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (i, kv, chunk): copies ``BLOCK`` elements of block ``block_ids[i]``'s K or V
    between the pool and slot ``(kv, i)`` of one layer's slice of the buffer."""
    i = tl.program_id(0)
    which = tl.program_id(1)
    chunk = tl.program_id(2)
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    pool = kv_ptr + which * stride_cache_kv + block * stride_cache_block + offs
    buf = buf_ptr + (which * num_ids + i).to(tl.int64) * block_numel + offs
    if PACK:
        tl.store(buf, tl.load(pool, mask=mask), mask=mask)
    else:
        tl.store(pool, tl.load(buf, mask=mask), mask=mask)


def _check_caches(caches: list[KVCacheLayer], block_ids: torch.Tensor) -> None:
    if not caches:
        raise ValueError("caches must hold at least one layer")
    device = block_ids.device
    check_tensor("block_ids", block_ids, ndim=1, dtypes=INDEX_DTYPES)
    if not block_ids.is_contiguous():
        raise ValueError("block_ids must be contiguous")
    first = caches[0].kv
    for layer, cache in enumerate(caches):
        check_cache(f"caches[{layer}]", cache, device)
        if cache.kv.shape != first.shape or cache.kv.dtype != first.dtype:
            raise ValueError(f"caches[{layer}].kv is {tuple(cache.kv.shape)} {cache.kv.dtype}, "
                             f"caches[0].kv is {tuple(first.shape)} {first.dtype}")


def _launch(buffer: torch.Tensor, caches: list[KVCacheLayer], block_ids: torch.Tensor,
            pack: bool) -> None:
    num_ids = block_ids.shape[0]
    if num_ids == 0:
        return
    block_numel = caches[0].kv[0, 0].numel()
    block = min(next_pow2(block_numel), 1024 if interpreting() else 4096)
    grid = (num_ids, 2, triton.cdiv(block_numel, block))
    for layer, cache in enumerate(caches):
        _block_copy_kernel[grid](
            cache.kv, buffer[layer], block_ids, cache.kv.stride(0), cache.kv.stride(1), num_ids,
            block_numel, PACK=pack, BLOCK=block, num_warps=4,
        )


def pack_blocks(caches: list[KVCacheLayer], block_ids: torch.Tensor) -> torch.Tensor:
    """Gather ``block_ids`` of every layer: (num_layers, 2, num_ids, block_size, kv_heads,
    head_dim) in the pool dtype."""
    _check_caches(caches, block_ids)
    shape = caches[0].kv.shape
    buffer = torch.empty(len(caches), 2, block_ids.shape[0], *shape[2:],
                         dtype=caches[0].kv.dtype, device=block_ids.device)
    _launch(buffer, caches, block_ids, pack=True)
    return buffer


def unpack_blocks(buffer: torch.Tensor, caches: list[KVCacheLayer],
                  block_ids: torch.Tensor) -> None:
    """Scatter a :func:`pack_blocks` buffer into ``block_ids`` of every layer in ``caches``."""
    _check_caches(caches, block_ids)
    kv = caches[0].kv
    check_tensor("buffer", buffer, ndim=6, dtypes=(kv.dtype,), device=block_ids.device,
                 shape=(len(caches), 2, block_ids.shape[0], *kv.shape[2:]))
    check_contiguous("buffer", buffer)
    _launch(buffer, caches, block_ids, pack=False)
