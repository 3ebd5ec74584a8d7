"""Triton rotary position embedding (rotate-half, the Llama/Hugging Face convention).

Reference: :func:`pdserve.kernels.torch_ops.rotary_torch`. ``cos_sin_cache`` (max_pos, head_dim)
holds ``[cos | sin]`` per position, so any frequency scaling (llama3, linear, ...) lives in how
the model builds the cache; the kernel only rotates. Computes in fp32, returns new q and k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._launch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_last_dim_contiguous,
    check_tensor,
    next_pow2,
)


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, token, stride_t, stride_h, stride_ot, stride_oh, num_heads,
                  cos, sin, offs_d, d_mask, half, BLOCK_H: tl.constexpr):
    """Rotate every head of one token: (H, D/2) halves against (D/2,) cos/sin."""
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < num_heads) & d_mask[None, :]
    src = src_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    ty = dst_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos[None, :] - x2 * sin[None, :]).to(ty), mask=mask)
    tl.store(dst + half, (x2 * cos[None, :] + x1 * sin[None, :]).to(ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cache_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_oqt, stride_oqh, stride_okt, stride_okh,
    stride_cache, num_heads, num_kv_heads, half, max_pos,
    BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    in_cache = offs_d < tl.where((pos >= 0) & (pos < max_pos), half, 0)
    cos = tl.load(cache_ptr + pos * stride_cache + offs_d, mask=in_cache, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + half + offs_d, mask=in_cache, other=0.0)
    cos, sin = cos.to(tl.float32), sin.to(tl.float32)
    d_mask = offs_d < half
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_oqt, stride_oqh,
                  num_heads, cos, sin, offs_d, d_mask, half, BLOCK_H=BLOCK_H)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, stride_okt, stride_okh,
                  num_kv_heads, cos, sin, offs_d, d_mask, half, BLOCK_H=BLOCK_KH)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
           cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (T, H, D), k: (T, KH, D), positions: (T,), cos_sin_cache: (max_pos, D).
    Returns rotated copies of q and k. A position outside the cache rotates by zero."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
    device = q.device
    if head_dim % 2:
        raise ValueError(f"q head_dim must be even, got {head_dim}")
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=device,
                 shape=(num_tokens, None, head_dim))
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=device,
                 shape=(num_tokens,))
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES, device=device,
                 shape=(None, head_dim))
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(name, t)
    if not positions.is_contiguous():
        raise ValueError("positions must be contiguous")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_sin_cache.stride(0), num_heads, k.shape[1], half, cos_sin_cache.shape[0],
        BLOCK_H=next_pow2(num_heads), BLOCK_KH=next_pow2(k.shape[1]),
        BLOCK_HALF=next_pow2(half), num_warps=4,
    )
    return q_out, k_out
