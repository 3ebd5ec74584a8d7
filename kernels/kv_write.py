"""Triton KV cache write: scatter this step's K/V into their slots of the paged pool.

Reference: :func:`pdserve.kernels.torch_ops.write_kv_torch`. When the pool is int8 the values are
quantised on write exactly like :func:`~pdserve.kernels.torch_ops.quantize_int8`:
``round_half_even(clamp(x / scale, -127, 127))``; a half with dynamic token scales
(``k_token_scale`` / ``v_token_scale``) first divides by the channel scale, takes each head's
``fp16(max(absmax / 127, 2**-14))`` as its token scale, stores it and quantises by it, like
:func:`~pdserve.kernels.torch_ops.quantize_int8_dynamic` (bit for bit). A negative slot is
skipped (a padding token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._launch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_cache,
    check_last_dim_contiguous,
    check_tensor,
    next_pow2,
)
from pdserve.kernels.kv_layout import MAX_TOKEN_SCALE, MIN_TOKEN_SCALE, KVCacheLayer

# Adding then subtracting 1.5 * 2**23 rounds an fp32 of magnitude < 2**22 to the nearest
# integer, ties to even (what torch.round does), with no libdevice call.
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _quantize(x, scale):
    """fp32 ``x`` -> round_half_even(clamp(x / scale, -127, 127)) as int8."""
    y = tl.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    y = (y + _ROUND_MAGIC) - _ROUND_MAGIC
    return y.to(tl.int8)


@triton.jit
def _quantize_half(x, scale, ts_ptr, slot, num_kv_heads, offs_h, h_mask, mask,
                   DYNAMIC: tl.constexpr, MIN_SCALE: tl.constexpr, MAX_SCALE: tl.constexpr):
    """int8 of one token's (H, D) ``x``; with ``DYNAMIC`` also stores its per-head scales."""
    if DYNAMIC:
        y = tl.div_rn(x, scale)
        absmax = tl.max(tl.where(mask, tl.abs(y), 0.0), 1)  # (H,)
        t = tl.minimum(tl.maximum(tl.div_rn(absmax, 127.0), MIN_SCALE), MAX_SCALE)
        t = t.to(tl.float16)
        tl.store(ts_ptr + slot * num_kv_heads + offs_h, t, mask=h_mask)
        return _quantize(y, t.to(tl.float32)[:, None])
    return _quantize(x, scale)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, kv_ptr, k_scale_ptr, v_scale_ptr, kt_ptr, vt_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_kv, stride_cache_slot, stride_cache_h,
    num_kv_heads, head_dim,
    QUANTIZED: tl.constexpr, K_DYNAMIC: tl.constexpr, V_DYNAMIC: tl.constexpr,
    MIN_SCALE: tl.constexpr, MAX_SCALE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per token: copies its (kv_heads, head_dim) K and V into its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = tl.where(slot >= 0, num_kv_heads, 0)  # a negative slot writes nothing
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < head_dim)
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                mask=mask, other=0.0)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=mask, other=0.0)
    dst = kv_ptr + slot * stride_cache_slot + offs_h[:, None] * stride_cache_h + offs_d[None, :]
    if QUANTIZED:
        scale_offs = offs_h[:, None] * head_dim + offs_d[None, :]
        k_scale = tl.load(k_scale_ptr + scale_offs, mask=mask, other=1.0)
        v_scale = tl.load(v_scale_ptr + scale_offs, mask=mask, other=1.0)
        h_mask = offs_h < heads
        k_q = _quantize_half(k.to(tl.float32), k_scale, kt_ptr, slot, num_kv_heads, offs_h,
                             h_mask, mask, DYNAMIC=K_DYNAMIC, MIN_SCALE=MIN_SCALE,
                             MAX_SCALE=MAX_SCALE)
        v_q = _quantize_half(v.to(tl.float32), v_scale, vt_ptr, slot, num_kv_heads, offs_h,
                             h_mask, mask, DYNAMIC=V_DYNAMIC, MIN_SCALE=MIN_SCALE,
                             MAX_SCALE=MAX_SCALE)
        tl.store(dst, k_q, mask=mask)
        tl.store(dst + stride_cache_kv, v_q, mask=mask)
    else:
        tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_cache_kv, v.to(kv_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, cache: KVCacheLayer,
             slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` (num_tokens, kv_heads, head_dim) into ``slot_mapping`` slots."""
    device = key.device
    check_cache("cache", cache, device)
    _, _, _, num_kv_heads, head_dim = cache.kv.shape
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES, device=device,
                 shape=(None, num_kv_heads, head_dim))
    num_tokens = key.shape[0]
    check_tensor("value", value, ndim=3, dtypes=(key.dtype,), device=device,
                 shape=(num_tokens, num_kv_heads, head_dim))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=device,
                 shape=(num_tokens,))
    check_last_dim_contiguous("key", key)
    check_last_dim_contiguous("value", value)
    if slot_mapping.stride(0) != 1 and num_tokens > 1:
        raise ValueError("slot_mapping must be contiguous")
    if num_tokens == 0:
        return
    dummy = cache.kv  # stands in for the scale pointers when the cache is not quantised
    _write_kv_kernel[(num_tokens,)](
        key, value, cache.kv,
        cache.k_scale if cache.is_quantized else dummy,
        cache.v_scale if cache.is_quantized else dummy,
        dummy if cache.k_token_scale is None else cache.k_token_scale,
        dummy if cache.v_token_scale is None else cache.v_token_scale,
        slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cache.kv.stride(0), cache.kv.stride(2), cache.kv.stride(3),
        num_kv_heads, head_dim,
        QUANTIZED=cache.is_quantized, K_DYNAMIC=cache.k_token_scale is not None,
        V_DYNAMIC=cache.v_token_scale is not None, MIN_SCALE=MIN_TOKEN_SCALE,
        MAX_SCALE=MAX_TOKEN_SCALE,
        BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim),
        num_warps=4,
    )
