"""Dense layers, ``y = x W^T (+ b)``, with the weight packed once for the CPU's GEMM.

On the CPU in float32, and in bfloat16 where oneDNN has bf16 kernels for this CPU (AVX-512,
AVX512-BF16 or AMX; :func:`bf16_native`), a linear layer runs through oneDNN with its weight
reordered once, at load, into oneDNN's blocked layout (what PyTorch's inductor does for CPU
linears when it freezes a model): the GEMM then reads the weight in the order its kernel
consumes it instead of re-packing it on every call, which is what a decode step (a few rows
against every weight) spends most of its time on. Anywhere else (CUDA, float16, bf16 without
the CPU's support, no oneDNN) the weight is not packed and ``F.linear`` runs. A decode
step's few rows (up to ``cpu_panel_gemm.MAX_ROWS``) read the packed weight through pdserve's C
kernel (:mod:`pdserve.kernels.cpu_panel_gemm`) where it builds, the layout checks out and the
CPU has what makes it the faster one: AVX-512 in float32, AMX in bf16 (elsewhere oneDNN's
kernel is faster, and the rows stay with it).
:func:`linear` is the one entry; ``F.linear`` over the unpacked weight is its reference (the
packed GEMMs sum in other orders: the same to the dtype's rounding).

A packed weight is an opaque oneDNN tensor: no storage torch can see (no ``data_ptr``;
``torch.ops.mkldnn.data_ptr`` gives its buffer to the C kernel); count its bytes as elements x
element size.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_panel_gemm

# Rows a packed GEMM call pads up to, by dtype. float32: oneDNN picks a slower kernel for
# fewer than four rows (a decode step of 1-3 requests); padded with zero rows, each real row's
# sums are the same bit for bit. bfloat16: no padding; oneDNN's bf16 kernel is as fast at one
# row and gives each row the same sums from 1 to 32 rows (docs/cpu-speed.md).
MIN_PACKED_ROWS = {torch.float32: 4, torch.bfloat16: 1}


def min_packed_rows(dtype: torch.dtype) -> int:
    """The rows :func:`linear` pads a packed call of ``dtype`` up to."""
    return MIN_PACKED_ROWS.get(dtype, 1)


@functools.cache
def bf16_native() -> bool:
    """Whether oneDNN runs bfloat16 GEMMs on this CPU's own bf16 instructions (AVX512-BF16,
    AMX, or AVX512 with oneDNN's conversions); without it torch emulates bf16 in float32."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (out, in) runs faster packed: float32 on a CPU with oneDNN, or
    bfloat16 where oneDNN has bf16 kernels for this CPU (:func:`bf16_native`)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and bf16_native())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (out, in) reordered into oneDNN's layout for :func:`linear`."""
    if not can_pack(weight):
        raise ValueError(f"only a 2-D float32 (or, with oneDNN's bf16 kernels, bfloat16) CPU "
                         f"weight packs, got {tuple(weight.shape)} {weight.dtype} on "
                         f"{weight.device}")
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    cpu_panel_gemm.record_layout(weight, packed)
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """(T, in) -> (T, out); through ``packed`` (from :func:`pack_weight`) when given."""
    if packed is None:
        return F.linear(x, weight, bias)
    if cpu_panel_gemm.takes(x, packed) and cpu_panel_gemm.beats_onednn(x.dtype):
        return cpu_panel_gemm.panel_linear(x, packed, bias)
    rows, pad_to = x.shape[0], min_packed_rows(x.dtype)
    if rows < pad_to:  # the same sums, a faster kernel: pad with zero rows
        x = torch.cat([x, x.new_zeros(pad_to - rows, x.shape[1])])
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
