"""Paged decode attention on the CPU through the C kernel (``cpu_decode_attention.c``), which
reads each sequence's K and V in the pool instead of gathering them first as the torch path
does. float32 and bfloat16 pools (a bf16 pool read in place and widened to float32, the query
and the sums in float32, the output rounded to the query's dtype, as the torch path does);
:func:`takes` says which calls it serves, and the dispatcher sends the rest (int8 or float16
pools) down the torch path.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels import native_build
from pdserve.kernels.kv_layout import KVCacheLayer

# below this much work (context tokens x heads x head_dim) a call runs on one thread
# (native_build.threads says why)
PARALLEL_MIN_WORK = 1 << 20

POOL_DTYPES = (torch.float32, torch.bfloat16)  # what the kernel reads in place
_ERRORS = {-1: "a shape the kernel does not take", -2: "out of memory",
           -3: "a block table entry outside the pool, or a context longer than its table"}


@functools.cache
def _kernel():
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib = native_build.bind("cpu_decode_attention", {"paged_decode_attention": (
        i32, [ptr, ptr, ptr, i32, ptr, ctypes.c_int64, ptr, ptr, i32, i32, i32, i32, i32, i32,
              ctypes.c_float, i32, i32])})
    return None if lib is None else lib.paged_decode_attention


def available() -> bool:
    """Whether the C kernel is built and loaded on this machine (builds it on first call)."""
    return _kernel() is not None


def takes(query: torch.Tensor, cache: KVCacheLayer) -> bool:
    """Whether :func:`paged_decode_attention_cpu` serves this query and pool: float32 or
    bfloat16, both on the CPU, the pool contiguous."""
    return (query.device.type == "cpu" and query.dtype in POOL_DTYPES
            and cache.kv.dtype in POOL_DTYPES and cache.kv.is_contiguous())


def paged_decode_attention_cpu(query: torch.Tensor, cache: KVCacheLayer,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """One query per sequence (its last position) against its paged context; the same
    contract as :func:`~pdserve.kernels.torch_attention.paged_decode_attention_torch`.
    query: (num_seqs, num_heads, head_dim) float32 or bfloat16 on a float32 or bfloat16 pool
    (:func:`takes`); the output in the query's dtype."""
    fn = _kernel()
    if fn is None or not takes(query, cache):
        raise ValueError("the C decode attention needs float32 or bfloat16 CPU tensors and the "
                         "built kernel (kernels.cpu_decode_attention.available())")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    num_seqs, num_heads, head_dim = query.shape
    q = query.to(torch.float32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out.to(query.dtype)
    code = fn(q.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(),
              int(cache.kv.dtype == torch.bfloat16), tables.data_ptr(),
              tables.stride(0), lens.data_ptr(), out.data_ptr(), num_seqs, num_heads,
              cache.kv.shape[3], head_dim, cache.block_size, cache.num_blocks, scale,
              sliding_window or 0, native_build.threads(int(lens.sum()) * num_heads * head_dim,
                                   PARALLEL_MIN_WORK))
    if code:
        raise ValueError(f"C decode attention refused the batch: {_ERRORS.get(code, code)}")
    return out.to(query.dtype)

