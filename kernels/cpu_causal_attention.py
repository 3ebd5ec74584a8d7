"""Prompts attending to themselves (causal, no window; whole, or a chunk after its cached
prefix) on the CPU through the C kernel (``cpu_causal_attention.c``). float32; :func:`takes`
says which calls it serves, and the torch path (``_causal_sdpa_in_chunks``, its reference)
takes the rest.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels import native_build

MAX_HEAD_DIM = 512
# below this much work (query-key pairs x heads x head_dim) a call runs on one thread
# (native_build.threads says why)
PARALLEL_MIN_WORK = 1 << 22


@functools.cache
def _kernel():
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib = native_build.bind("cpu_causal_attention", {"causal_attention_f32": (
        i32, [ptr, i64, i64, i64, ptr, ptr, ptr, i32, i32, i32, i32, i32, i32, ctypes.c_float,
              i32])})
    return None if lib is None else lib.causal_attention_f32


def available() -> bool:
    """Whether the C kernel is built and loaded on this machine (builds it on first call)."""
    return _kernel() is not None


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
    code = _kernel()(q.data_ptr(), q.stride(0), q.stride(2), q.stride(1), k.data_ptr(),
                     v.data_ptr(), out.data_ptr(), seqs, n, keys - n, heads, kv_heads, head_dim,
                     scale, native_build.threads(work, PARALLEL_MIN_WORK))
    if code:
        raise ValueError(f"the C causal attention refused {tuple(q.shape)}: code {code}")
    return out.transpose(1, 2)
