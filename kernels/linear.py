"""Dense layers, ``y = x W^T (+ b)``, with the weight packed once for the CPU's GEMM.

On the CPU in float32 a linear layer runs through oneDNN with its weight reordered once, at
load, into oneDNN's blocked layout (what PyTorch's inductor does for CPU linears when it
freezes a model): the GEMM then reads the weight in the order its kernel consumes it instead
of re-packing it on every call, which is what a decode step (a few rows against every weight)
spends most of its time on. Anywhere else (CUDA, other dtypes, no oneDNN) the weight is not
packed and ``F.linear`` runs. A decode step's few rows (up to ``cpu_panel_gemm.MAX_ROWS``) read
the packed weight through pdserve's C kernel (:mod:`pdserve.kernels.cpu_panel_gemm`) where it
builds, the layout checks out and the CPU has AVX-512 (elsewhere oneDNN's kernel is faster).
:func:`linear` is the one entry; ``F.linear`` over the unpacked weight is its reference (the
packed GEMMs sum in other orders: the same to fp32 rounding).

A packed weight is an opaque oneDNN tensor: no storage torch can see (no ``data_ptr``;
``torch.ops.mkldnn.data_ptr`` gives its buffer to the C kernel); count its bytes as elements x
element size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_panel_gemm

# oneDNN picks a slower kernel for fewer rows than this (a decode step of 1-3 requests);
# padded with zero rows, each real row's sums are the same bit for bit (docs/cpu-speed.md).
MIN_PACKED_ROWS = 4


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (out, in) runs faster packed: float32 on a CPU with oneDNN."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and torch.backends.mkldnn.is_available())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (out, in) reordered into oneDNN's layout for :func:`linear`."""
    if not can_pack(weight):
        raise ValueError(f"only a 2-D float32 CPU weight packs, got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}")
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    cpu_panel_gemm.record_layout(weight, packed)
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """(T, in) -> (T, out); through ``packed`` (from :func:`pack_weight`) when given."""
    if packed is None:
        return F.linear(x, weight, bias)
    if cpu_panel_gemm.takes(x, packed) and cpu_panel_gemm.beats_onednn():
        return cpu_panel_gemm.panel_linear(x, packed, bias)
    rows = x.shape[0]
    if rows < MIN_PACKED_ROWS:  # the same sums, a faster kernel: pad with zero rows
        x = torch.cat([x, x.new_zeros(MIN_PACKED_ROWS - rows, x.shape[1])])
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
