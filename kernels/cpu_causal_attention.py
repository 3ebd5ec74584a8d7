"""Prompts attending to themselves (causal, no window) on the CPU through the C kernels
(``cpu_causal_attention.c``): float32 prompts, whole or a chunk after a cached prefix
(:func:`causal_attention_cpu`; the torch path ``_causal_sdpa_in_chunks`` is its reference and
takes what :func:`takes` refuses), and whole bf16 prompts on AMX's tiles
(:func:`causal_attention_bf16_cpu`, where :func:`takes_bf16`; torch's bf16 SDPA elsewhere).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels import native_build

MAX_HEAD_DIM = 512
MAX_HEAD_DIM_BF16 = 256  # and a multiple of 32 (the tiles take 32 dimensions at a time)
# below this much work (query-key pairs x heads x head_dim) a call runs on one thread
# (native_build.threads says why)
PARALLEL_MIN_WORK = 1 << 22


@functools.cache
def _kernel():
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib = native_build.bind("cpu_causal_attention", {
        "causal_attention_f32": (i32, [ptr, i64, i64, i64, ptr, ptr, ptr, i32, i32, i32, i32,
                                       i32, i32, ctypes.c_float, i32]),
        "causal_attention_bf16": (i32, [ptr, i64, i64, ptr, ptr, i64, i64, ptr, i32, i32, i32,
                                        i32, ctypes.c_float, i32]),
        "causal_attention_bf16_native": (i32, [])})
    return lib


def available() -> bool:
    """Whether the C kernel is built and loaded on this machine (builds it on first call)."""
    return _kernel() is not None


@functools.cache
def bf16_native() -> bool:
    """Whether the bf16 kernel runs here: built for a CPU with AMX, whose tiles Linux grants
    this process."""
    lib = _kernel()
    return lib is not None and bool(lib.causal_attention_bf16_native())


def takes_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> bool:
    """Whether :func:`causal_attention_bf16_cpu` serves this prompt: bf16 CPU tensors, a head_dim
    that is a multiple of 32 up to MAX_HEAD_DIM_BF16, a positive scale, and a CPU whose AMX
    tiles this process may use."""
    head_dim = q.shape[-1]
    return (all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in (q, k, v))
            and head_dim % 32 == 0 and head_dim <= MAX_HEAD_DIM_BF16 and scale > 0
            and bf16_native())


def causal_attention_bf16_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """One whole bf16 prompt attending to itself: q (T, heads, hd), k and v (T, kv_heads, hd)
    (views of a packed projection are read in place); returns (T, heads, hd) bf16. Products on
    AMX, softmax in float32, its weights rounded to bf16 before they weigh the values (as
    torch's bf16 attention does), so results agree with it to bf16 rounding."""
    if not takes_bf16(q, k, v, scale):
        raise ValueError("the C bf16 causal attention takes bf16 CPU tensors with head_dim a "
                         f"multiple of 32 up to {MAX_HEAD_DIM_BF16}, a positive scale, and a "
                         "CPU with AMX (takes_bf16())")
    n, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if k.shape != (n, kv_heads, head_dim) or v.shape != k.shape or heads % kv_heads:
        raise ValueError(f"k and v must be (T, kv_heads, hd) alike, kv_heads dividing heads; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1 or k.stride() != v.stride():  # the kernel takes one stride for both
        k, v = k.contiguous(), v.contiguous()
    out = torch.empty(n, heads, head_dim, dtype=torch.bfloat16)
    work = n * (n // 2 + 1) * heads * head_dim
    code = _kernel().causal_attention_bf16(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), k.stride(0),
        k.stride(1), out.data_ptr(), n, heads, kv_heads, head_dim, scale,
        native_build.threads(work, PARALLEL_MIN_WORK))
    if code:
        raise ValueError(f"the C bf16 causal attention refused {tuple(q.shape)}: code {code}")
    return out


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`causal_attention_cpu` serves these (the shapes it is given)."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (q, k, v))
            and q.shape[-1] <= MAX_HEAD_DIM and available())


def causal_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """The contract of ``_causal_sdpa_in_chunks``: q (S, heads, Q, hd) at positions K-Q..K-1,
    k and v (S, K, kv_heads, hd) with K >= Q; returns (S, heads, Q, hd) (a view of a
    (S, Q, heads, hd) tensor)."""
    if not takes(q, k, v):
        raise ValueError("the C causal attention takes float32 CPU tensors with head_dim <= "
                         f"{MAX_HEAD_DIM} and the built kernel (available())")
    seqs, heads, n, head_dim = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    if (k.shape != (seqs, keys, kv_heads, head_dim) or keys < n or v.shape != k.shape
            or heads % kv_heads):
        raise ValueError(f"k and v must be (S, K >= Q, kv_heads, hd) with kv_heads dividing "
                         f"heads; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    k, v = k.contiguous(), v.contiguous()
    out = torch.empty(seqs, n, heads, head_dim, dtype=torch.float32)
    work = seqs * n * (keys - n // 2) * heads * head_dim
    code = _kernel().causal_attention_f32(
        q.data_ptr(), q.stride(0), q.stride(2), q.stride(1), k.data_ptr(), v.data_ptr(),
        out.data_ptr(), seqs, n, keys - n, heads, kv_heads, head_dim, scale,
        native_build.threads(work, PARALLEL_MIN_WORK))
    if code:
        raise ValueError(f"the C causal attention refused {tuple(q.shape)}: code {code}")
    return out.transpose(1, 2)
