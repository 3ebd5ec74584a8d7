"""Triton RMSNorm with an optional fused residual add.

Reference: :func:`pdserve.kernels.torch_ops.rms_norm_torch`. One program per row: with a
residual, ``x + residual`` is rounded to the input dtype (and stored as the new residual), the
norm is computed in fp32, cast back to the input dtype, then multiplied by the weight in the
dtype torch's type promotion gives ``weight * x``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._launch import FLOAT_DTYPES, check_last_dim_contiguous, check_tensor, next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / hidden + eps)
    normed = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded like torch
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # The fp32 product of two 16-bit floats is exact, so one rounding matches torch's product.
    out = (normed * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm over the last dim of ``x`` (..., hidden). Returns ``out``, or
    ``(out, x + residual)`` when ``residual`` is given."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have at least one dim")
    hidden = x.shape[-1]
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device, shape=(hidden,))
    check_last_dim_contiguous("weight", weight)
    x2 = x.reshape(-1, hidden)  # (rows, hidden)
    check_last_dim_contiguous("x", x2)
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    residual_out = r2 = None
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), device=x.device, shape=x.shape)
        r2 = residual.reshape(-1, hidden)  # (rows, hidden)
        check_last_dim_contiguous("residual", r2)
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows and hidden:
        block = next_pow2(hidden)
        ro = residual_out.view(-1, hidden) if residual_out is not None else out.view(-1, hidden)
        _rms_norm_kernel[(rows,)](
            x2, r2 if r2 is not None else x2, weight, out, ro,
            x2.stride(0), r2.stride(0) if r2 is not None else 0, hidden, ro.stride(0),
            hidden, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )
    return out if residual is None else (out, residual_out)
