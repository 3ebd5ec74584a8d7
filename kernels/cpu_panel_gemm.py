"""A decode step's few rows against a packed weight, through the C kernel
(``cpu_panel_gemm.c``) that streams oneDNN's packed layout once instead of calling oneDNN.

oneDNN's float32 GEMM keeps a packed weight in panels of 64 output columns; reading those
panels row by row, a few input rows are multiplied against the weight at close to the speed
memory delivers it, where oneDNN's kernel for so few rows is built for many. That holds where
the CPU has AVX-512 (:func:`beats_onednn`); elsewhere the rows stay with oneDNN. The layout is
oneDNN's choice, not a documented contract, so :func:`record_layout` checks it on the first
weight of every shape that :func:`~pdserve.kernels.linear.pack_weight` packs, and only the
shapes it confirmed come here (:func:`takes`); the rest stay with oneDNN.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels import native_build

# Rows up to this many go through the kernel; from here on oneDNN's blocked GEMM is as fast
# (it reuses each weight panel across more rows than the kernel's registers hold).
MAX_ROWS = 16
# below this much work (rows x weight elements) a call runs on one thread
# (native_build.threads says why)
PARALLEL_MIN_WORK = 1 << 22
PANEL, K_BLOCK = 64, 16  # the layout's panel width and the padding of its k rows

# (out, in) -> a float32 weight of that shape packs into the panels
_confirmed: dict[tuple[int, int], bool] = {}


@functools.cache
def _library():
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return native_build.bind("cpu_panel_gemm", {
        "panel_gemm_f32": (i32, [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i32]),
        "panel_layout_matches": (i32, [ptr, i64, i64, ptr, i64]),
        "panel_gemm_rows_in_registers": (i32, [])})


def available() -> bool:
    """Whether the C kernel is built and loaded on this machine (builds it on first call)."""
    return _library() is not None


@functools.cache
def beats_onednn() -> bool:
    """Whether :func:`~pdserve.kernels.linear.linear` sends a decode step's rows here: where
    the kernel's accumulators for a block of rows stay in vector registers (AVX-512). Without
    AVX-512 they spill on every step of the sum and oneDNN's own kernel is the faster one
    (docs/cpu-speed.md), so the rows stay with oneDNN; the kernel still builds and is tested."""
    lib = _library()
    return lib is not None and bool(lib.panel_gemm_rows_in_registers())


def record_layout(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether ``packed`` (oneDNN's reorder of ``weight``, (out, in)) is in the panel layout:
    never for a weight other than float32; checked once per shape (oneDNN picks the layout by
    shape and CPU) and remembered."""
    if weight.dtype != torch.float32:
        return False
    shape = tuple(weight.shape)
    if shape not in _confirmed:
        lib = _library()
        w = weight.detach().contiguous()
        _confirmed[shape] = lib is not None and bool(lib.panel_layout_matches(
            w.data_ptr(), shape[0], shape[1], torch.ops.mkldnn.data_ptr(packed),
            torch.ops.mkldnn._nbytes(packed)))
    return _confirmed[shape]


def takes(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether :func:`panel_linear` serves ``x`` (rows, in) against ``packed``."""
    return (0 < x.shape[0] <= MAX_ROWS and x.dtype == torch.float32 and x.dim() == 2
            and packed.dtype == torch.float32 and _confirmed.get(tuple(packed.shape), False))


def panel_linear(x: torch.Tensor, packed: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ bias)`` for ``x`` (rows, in) float32 against ``packed``, W (out, in);
    sums run over ``in`` in order, so each row's result does not depend on the others."""
    if not takes(x, packed):
        raise ValueError(f"the panel GEMM takes 1-{MAX_ROWS} float32 rows against a weight "
                         f"whose layout record_layout confirmed, got {tuple(x.shape)} "
                         f"{x.dtype} against {tuple(packed.shape)}")
    out_features, in_features = packed.shape
    if x.shape[1] != in_features:
        raise ValueError(f"x has {x.shape[1]} features, the weight takes {in_features}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    rows = x.shape[0]
    y = torch.empty(rows, out_features, dtype=torch.float32)
    k_rows = -(-in_features // K_BLOCK) * K_BLOCK
    threads = native_build.threads(rows * out_features * in_features, PARALLEL_MIN_WORK)
    code = _library().panel_gemm_f32(
        x.data_ptr(), x.stride(0), torch.ops.mkldnn.data_ptr(packed), k_rows,
        None if bias is None else bias.data_ptr(), y.data_ptr(), out_features, rows,
        out_features, in_features, threads)
    if code:
        raise ValueError(f"the panel GEMM refused {tuple(x.shape)} x {tuple(packed.shape)}")
    return y
