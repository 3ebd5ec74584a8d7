"""RMSNorm (with the residual add before it), SiLU-and-mul and RoPE on the CPU through the C
kernels (``cpu_pointwise.c``), each one pass over the activations where torch takes several.
float32 or bfloat16 (computed in float32, rounded to bf16 where the torch path rounds);
:func:`takes` says which calls they serve, and the dispatcher (the ``native`` backend) sends
the rest down the torch path, which is their reference. And a step's K/V rows copied into
their pool slots in one call (:func:`write_kv_cpu`, where ``write_kv_torch`` takes two
``index_copy_`` and their dispatch a layer).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels import native_build

# below this many elements a call runs on one thread
# (native_build.threads says why)
PARALLEL_MIN_WORK = 1 << 15
DTYPES = (torch.float32, torch.bfloat16)  # what the kernels read and write


@functools.cache
def _library():
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return native_build.bind("cpu_pointwise", {
        "silu_and_mul": (None, [ptr, i64, i64, i64, ptr, i32, i32]),
        "add_rms_norm": (None, [ptr, ptr, ptr, ptr, ctypes.c_float, i64, i64, ptr, i32, i32]),
        "rotary": (None, [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, i32, i32]),
        "write_kv_rows": (i32, [ptr, i64, ptr, i64, i64, i64, ptr, i64, ptr, ptr, i32])})


def available() -> bool:
    """Whether the C kernels are built and loaded on this machine (builds them on first call)."""
    return _library() is not None


def takes(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether these (the activations, and the weight or residual where given) are what the C
    kernels serve: CPU tensors, all float32 or all bfloat16, the kernels built."""
    return x.dtype in DTYPES and all(
        t is None or (t.device.type == "cpu" and t.dtype == x.dtype) for t in (x, *others)
    ) and available()


def _is_bf16(x: torch.Tensor) -> int:
    return int(x.dtype == torch.bfloat16)


def _threads(elements: int) -> int:
    return native_build.threads(elements, PARALLEL_MIN_WORK)


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2 * I) = [gate | up] -> silu(gate) * up, (..., I); see ``silu_and_mul_torch``."""
    if not takes(x) or x.shape[-1] % 2:
        raise ValueError("silu_and_mul_cpu takes a float32 or bfloat16 CPU tensor of even "
                         f"width, got {tuple(x.shape)} {x.dtype} on {x.device}")
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype)
    if out.numel():
        _library().silu_and_mul(rows.data_ptr(), rows.stride(0), rows.shape[0], inter,
                                out.data_ptr(), _is_bf16(x), _threads(out.numel()))
    return out


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """RMSNorm over the last dimension; with ``residual``: returns (norm(x + r), x + r). The
    contract of ``rms_norm_torch`` for float32 or bfloat16 tensors."""
    if not takes(x, weight, residual) or weight.shape != x.shape[-1:] or (
            residual is not None and residual.shape != x.shape):
        raise ValueError("rms_norm_cpu takes float32 or bfloat16 CPU tensors (one dtype), a "
                         "weight as wide as x's last "
                         f"dimension and a residual shaped as x; got x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}")
    hidden = x.shape[-1]
    xs = x.contiguous()
    w = weight.contiguous()
    rs = None if residual is None else residual.contiguous()
    total = None if residual is None else torch.empty_like(xs)
    out = torch.empty_like(xs)
    if out.numel():
        _library().add_rms_norm(
            xs.data_ptr(), None if rs is None else rs.data_ptr(),
            None if total is None else total.data_ptr(), w.data_ptr(), eps,
            xs.numel() // hidden, hidden, out.data_ptr(), _is_bf16(xs), _threads(xs.numel()))
    return out if residual is None else (out, total)


def rotary_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x (T, heads, D), float32 or bfloat16, with ``rope_table_torch``'s
    float32 (cos, sin), each (T, 1, D): ``x * cos + (x2, x1) * sin`` into a new contiguous
    (T, heads, D) of x's dtype, the bits of ``rotary_torch``'s."""
    tokens, heads, dim = x.shape
    if not takes(x) or not takes(cos, sin) or cos.dtype != torch.float32 or dim % 2 or (
            cos.numel() != tokens * dim or sin.numel() != tokens * dim):
        raise ValueError("rotary_cpu takes CPU tensors, x (T, heads, D) float32 or bfloat16 with "
                         "D even and (T, 1, D) float32 cos and sin; got x "
                         f"{tuple(x.shape)} {x.dtype}, cos {tuple(cos.shape)} {cos.dtype}")
    if x.stride(2) != 1:
        x = x.contiguous()
    cos, sin = cos.reshape(tokens, dim).contiguous(), sin.reshape(tokens, dim).contiguous()
    out = torch.empty(tokens, heads, dim, dtype=x.dtype)
    if out.numel():
        _library().rotary(x.data_ptr(), x.stride(0), x.stride(1), tokens, heads, dim,
                          cos.data_ptr(), sin.data_ptr(), out.data_ptr(), _is_bf16(x),
                          _threads(out.numel()))
    return out


def _rows_whole(t: torch.Tensor) -> bool:
    """Whether each row of ``t`` (rows, heads, head_dim) is one run of memory."""
    return t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2])


def takes_kv(key: torch.Tensor, value: torch.Tensor, k_rows: torch.Tensor,
             v_rows: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Whether :func:`write_kv_cpu` serves these: CPU tensors, key and value of the pool's
    dtype and shape per row, each row one run of memory (views of a packed projection are),
    the pools contiguous, int64 slots, the kernels built."""
    tensors = (key, value, k_rows, v_rows, slot_mapping)
    return (all(t.device.type == "cpu" for t in tensors) and slot_mapping.dtype == torch.int64
            and key.dtype == value.dtype == k_rows.dtype == v_rows.dtype
            and key.shape == value.shape and key.shape[1:] == k_rows.shape[1:]
            and k_rows.shape == v_rows.shape and k_rows.is_contiguous()
            and v_rows.is_contiguous() and _rows_whole(key) and _rows_whole(value)
            and available())


def write_kv_cpu(key: torch.Tensor, value: torch.Tensor, k_rows: torch.Tensor,
                 v_rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Row i of ``key`` and ``value`` (T, kv_heads, hd) into row ``slot_mapping[i]`` of
    ``k_rows`` and ``v_rows`` (num_slots, kv_heads, hd): ``write_kv_torch``'s copies for an
    unquantized pool of the rows' dtype. IndexError, the pool untouched, for a slot outside
    it."""
    if not takes_kv(key, value, k_rows, v_rows, slot_mapping) or len(slot_mapping) != len(key):
        raise ValueError("write_kv_cpu takes CPU key and value (T, kv_heads, hd) of the pools' "
                         "dtype, each row one run of memory, contiguous pools and T int64 "
                         f"slots; got key {tuple(key.shape)} {key.dtype}, pool "
                         f"{tuple(k_rows.shape)} {k_rows.dtype}, slots "
                         f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if not len(key):
        return
    slots = slot_mapping.contiguous()
    element = key.element_size()
    row_bytes = key.shape[1] * key.shape[2] * element
    code = _library().write_kv_rows(
        key.data_ptr(), key.stride(0) * element, value.data_ptr(), value.stride(0) * element,
        len(key), row_bytes, slots.data_ptr(), len(k_rows), k_rows.data_ptr(),
        v_rows.data_ptr(), _threads(key.numel()))
    if code:
        raise IndexError(f"a slot of {slot_mapping.tolist()[:8]}... lies outside the pool of "
                         f"{len(k_rows)} slots")
