"""A decode step's few rows against a packed weight, through the C kernels
(``cpu_panel_gemm.c``, ``native_panel.h``) that stream oneDNN's packed layout once instead of
calling oneDNN.

oneDNN keeps a packed float32 weight in panels of 64 output columns, a bfloat16 one in panels
of 32 columns with the input dimension in pairs (AMX's tile layout); reading those panels in
order, a few input rows are multiplied against the weight at close to the speed memory
delivers it, where oneDNN's kernel for so few rows is built for many. That holds where the CPU
has AVX-512, and for bfloat16 AMX (:func:`beats_onednn`); elsewhere the rows stay with oneDNN.
The layout is oneDNN's choice, not a documented contract, so :func:`record_layout`
checks it on the first weight of every shape and dtype that
:func:`~pdserve.kernels.linear.pack_weight` packs, and only the shapes it confirmed come here
(:func:`takes`); the rest stay with oneDNN.
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
PANEL = {torch.float32: 64, torch.bfloat16: 32}  # the layout's panel width by dtype

# (out, in, dtype) -> a weight of that shape and dtype packs into the panels
_confirmed: dict[tuple[int, int, torch.dtype], bool] = {}


@functools.cache
def _library():
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return native_build.bind("cpu_panel_gemm", {
        "panel_gemm_f32": (i32, [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i32]),
        "panel_gemm_bf16": (i32, [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i32]),
        "panel_layout_matches": (i32, [ptr, i64, i64, ptr, i64]),
        "panel_layout_matches_bf16": (i32, [ptr, i64, i64, ptr, i64]),
        "panel_gemm_rows_in_registers": (i32, []),
        "panel_gemm_bf16_native": (i32, [])})


def available() -> bool:
    """Whether the C kernel is built and loaded on this machine (builds it on first call)."""
    return _library() is not None


@functools.cache
def beats_onednn(dtype: torch.dtype = torch.float32) -> bool:
    """Whether :func:`~pdserve.kernels.linear.linear` sends a decode step's rows of ``dtype``
    here. float32: where the kernel's accumulators for a block of rows stay in vector
    registers (AVX-512); without it they spill on every step of the sum and oneDNN's own
    kernel is the faster one (docs/cpu-speed.md), so the rows stay with oneDNN (the kernel
    still builds and is tested). bfloat16: where the kernel runs on AMX's tiles (the CPU has
    them and Linux grants them to this process); elsewhere it refuses."""
    lib = _library()
    if lib is None:
        return False
    if dtype == torch.bfloat16:
        return bool(lib.panel_gemm_bf16_native())
    return dtype == torch.float32 and bool(lib.panel_gemm_rows_in_registers())


def record_layout(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether ``packed`` (oneDNN's reorder of ``weight``, (out, in)) is in the panel layout of
    its dtype: never for a dtype other than float32 and bfloat16; checked once per shape and
    dtype (oneDNN picks the layout by shape and CPU) and remembered."""
    if weight.dtype not in PANEL:
        return False
    key = (*weight.shape, weight.dtype)
    if key not in _confirmed:
        lib = _library()
        check = None if lib is None else (lib.panel_layout_matches if weight.dtype == torch.float32
                                          else lib.panel_layout_matches_bf16)
        w = weight.detach().contiguous()
        _confirmed[key] = check is not None and bool(check(
            w.data_ptr(), key[0], key[1], torch.ops.mkldnn.data_ptr(packed),
            torch.ops.mkldnn._nbytes(packed)))
    return _confirmed[key]


def k_rows(packed: torch.Tensor) -> int:
    """The padded input rows of each panel of ``packed`` (a confirmed layout)."""
    out_features = packed.shape[0]
    panel = PANEL[packed.dtype]
    return torch.ops.mkldnn._nbytes(packed) // (packed.element_size() * panel
                                               * -(-out_features // panel))


def confirmed(packed: torch.Tensor) -> bool:
    """Whether :func:`record_layout` confirmed the panel layout for ``packed``'s shape and
    dtype."""
    return _confirmed.get((*packed.shape, packed.dtype), False)


def takes(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether :func:`panel_linear` serves ``x`` (rows, in) against ``packed``."""
    return (0 < x.shape[0] <= MAX_ROWS and x.dim() == 2 and x.dtype == packed.dtype
            and confirmed(packed))


def panel_linear(x: torch.Tensor, packed: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ bias)`` for ``x`` (rows, in) float32 or bfloat16 against ``packed``, W
    (out, in) of x's dtype; sums run over ``in`` in order, so each row's result does not
    depend on the others."""
    if not takes(x, packed):
        raise ValueError(f"the panel GEMM takes 1-{MAX_ROWS} rows of the weight's dtype against "
                         f"a weight whose layout record_layout confirmed, got {tuple(x.shape)} "
                         f"{x.dtype} against {tuple(packed.shape)} {packed.dtype}")
    out_features, in_features = packed.shape
    if x.shape[1] != in_features:
        raise ValueError(f"x has {x.shape[1]} features, the weight takes {in_features}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    rows = x.shape[0]
    y = torch.empty(rows, out_features, dtype=x.dtype)
    threads = native_build.threads(rows * out_features * in_features, PARALLEL_MIN_WORK)
    gemm = (_library().panel_gemm_f32 if x.dtype == torch.float32
            else _library().panel_gemm_bf16)
    code = gemm(x.data_ptr(), x.stride(0), torch.ops.mkldnn.data_ptr(packed), k_rows(packed),
                None if bias is None else bias.data_ptr(), y.data_ptr(), out_features, rows,
                out_features, in_features, threads)
    if code:
        raise ValueError(f"the panel GEMM refused {tuple(x.shape)} x {tuple(packed.shape)}")
    return y
