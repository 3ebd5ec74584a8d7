"""Triton SiLU-and-mul: ``x = [gate | up]`` (..., 2 * I) -> ``silu(gate) * up`` (..., I).

Reference: :func:`pdserve.kernels.torch_ops.silu_and_mul_torch`. Like torch, ``silu(gate)`` is
rounded to the input dtype before the product, which is rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._launch import FLOAT_DTYPES, check_last_dim_contiguous, check_tensor, next_pow2


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x last dim must be even (gate | up), got shape {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)  # (rows, 2 * inter)
    check_last_dim_contiguous("x", x2)
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows and inter:
        block = min(next_pow2(inter), 1024)
        o2 = out.view(rows, inter)  # (rows, inter)
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
            x2, o2, x2.stride(0), o2.stride(0), inter, BLOCK=block, num_warps=4,
        )
    return out
