"""Triton paged prefill attention over packed variable-length queries.

Reference: :func:`pdserve.kernels.torch_attention.paged_attention_torch`. Queries are packed
``cu_seqlens`` style; sequence ``s``'s ``q_len`` queries are the LAST positions of its
``context_lens[s]`` tokens, whose K/V are already in the paged pool, so a chunk of a long prompt
or a prompt whose prefix came from the prefix cache attends to everything before it.

One program per (query tile, sequence, head); tiles past a sequence's length exit at once and
the longest (last) tiles are scheduled first. The key range of a tile is cut to what any of its
rows can see (causal, and the sliding window); inside it, tiles that every row sees fully run
without masks, the edges with masks. A query at position ``p`` sees keys ``k`` with ``k <= p``
and, with a window ``w``, ``k > p - w``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.kernels._launch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_cache,
    check_last_dim_contiguous,
    check_tensor,
    dot_in_fp32,
    interpreting,
    next_pow2,
)
from pdserve.kernels._paged import (
    LOG2E,
    _attend_tile,
    _finish,
    _load_query,
    _token_slots,
    dot_precision,
)
from pdserve.kernels.kv_layout import KVCacheLayer


@triton.jit
def _masked_range(acc, m_i, l_i, q, lo, hi, q_pos, bt_row, k_head_ptr, offs_d, d_mask,
                  stride_cache_kv, stride_cache_slot, block_size, window, kt_head_ptr,
                  vt_head_ptr, num_kv_heads, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
                  K_DYNAMIC: tl.constexpr, V_DYNAMIC: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles [lo, hi) with the causal / window / length mask applied per score."""
    for n0 in tl.range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = (pos < hi) & (pos >= 0)
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        slots = _token_slots(bt_row, pos, valid, block_size)
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_head_ptr, stride_cache_kv, slots,
                                     stride_cache_slot, offs_d, valid[:, None] & d_mask[None, :],
                                     visible, valid, kt_head_ptr, vt_head_ptr, num_kv_heads,
                                     APPLY_MASK=True, PRECISION=PRECISION,
                                     K_DYNAMIC=K_DYNAMIC, V_DYNAMIC=V_DYNAMIC)
    return acc, m_i, l_i


@triton.jit
def _key_ranges(first_pos, last_pos, window, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key ranges of a query tile spanning positions [first_pos, last_pos]: keys some row sees
    are [lo, hi) and keys every row sees are [full_lo, full_hi), with lo <= full_lo <= full_hi
    <= hi (the last two only when the run is not empty) and tile-aligned inner bounds."""
    hi = last_pos + 1
    full_hi = ((first_pos + 1) // BLOCK_N) * BLOCK_N  # all positions are >= 0: floor division
    lo = first_pos * 0  # scalar tensors in both branches: a jit function's return is typed
    full_lo = first_pos * 0
    if HAS_WINDOW:
        lo = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
    return lo, full_lo, tl.maximum(full_hi, full_lo), hi


@triton.jit
def _prefill_kernel(
    q_ptr, kv_ptr, k_scale_ptr, v_scale_ptr, kt_ptr, vt_ptr, cu_seqlens_ptr, context_lens_ptr,
    block_tables_ptr, out_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cache_kv, stride_cache_slot, stride_cache_h, stride_bt,
    qk_scale, group, head_dim, block_size, window, q_bucket, num_kv_heads,
    QUANTIZED: tl.constexpr, K_DYNAMIC: tl.constexpr, V_DYNAMIC: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # q_bucket (0, 1, 2: longest query run up to 64, 512, longer) only keys the autotuner.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # longest (last) tiles first
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int32) - q_start
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
    kv_head = head // group

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = offs_m < q_len
    d_mask = offs_d < head_dim
    q_pos = ctx - q_len + offs_m  # (M,) absolute positions of this tile's queries
    tokens = (q_start + offs_m).to(tl.int64)
    q = _load_query(q_ptr, tokens * stride_qt + head * stride_qh, row_mask, offs_d, d_mask,
                    qk_scale, k_scale_ptr, kv_head, head_dim,
                    QUANTIZED=QUANTIZED, DOT_FP32=DOT_FP32)  # (M, D)

    lo, full_lo, full_hi, hi = _key_ranges(
        ctx - q_len + tile * BLOCK_M, ctx - q_len + tl.minimum(tile * BLOCK_M + BLOCK_M, q_len) - 1,
        window, HAS_WINDOW=HAS_WINDOW, BLOCK_N=BLOCK_N)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt
    k_head_ptr = kv_ptr + kv_head.to(tl.int64) * stride_cache_h
    kt_head_ptr = kt_ptr + kv_head
    vt_head_ptr = vt_ptr + kv_head
    kv_mask = d_mask[None, :]
    for n0 in tl.range(full_lo, full_hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        in_run = pos < full_hi
        slots = _token_slots(bt_row, pos, in_run, block_size)
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_head_ptr, stride_cache_kv, slots,
                                     stride_cache_slot, offs_d, kv_mask, kv_mask, in_run,
                                     kt_head_ptr, vt_head_ptr, num_kv_heads,
                                     APPLY_MASK=False, PRECISION=PRECISION,
                                     K_DYNAMIC=K_DYNAMIC, V_DYNAMIC=V_DYNAMIC)
    # The masked edges: before the fully visible run (window) and after it (diagonal).
    acc, m_i, l_i = _masked_range(
        acc, m_i, l_i, q, lo, tl.minimum(full_lo, hi), q_pos, bt_row, k_head_ptr,
        offs_d, d_mask, stride_cache_kv, stride_cache_slot, block_size, window,
        kt_head_ptr, vt_head_ptr, num_kv_heads, HAS_WINDOW=HAS_WINDOW, PRECISION=PRECISION,
        K_DYNAMIC=K_DYNAMIC, V_DYNAMIC=V_DYNAMIC, BLOCK_N=BLOCK_N)
    acc, m_i, l_i = _masked_range(
        acc, m_i, l_i, q, tl.maximum(full_hi, lo), hi, q_pos, bt_row, k_head_ptr,
        offs_d, d_mask, stride_cache_kv, stride_cache_slot, block_size, window,
        kt_head_ptr, vt_head_ptr, num_kv_heads, HAS_WINDOW=HAS_WINDOW, PRECISION=PRECISION,
        K_DYNAMIC=K_DYNAMIC, V_DYNAMIC=V_DYNAMIC, BLOCK_N=BLOCK_N)

    out = _finish(acc, l_i, v_scale_ptr, kv_head, offs_d, d_mask, head_dim, QUANTIZED=QUANTIZED)
    ptrs = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def _check_inputs(query, cache, cu_seqlens_q, context_lens, block_tables, sliding_window):
    device = query.device
    check_cache("cache", cache, device)
    _, _, _, num_kv_heads, head_dim = cache.kv.shape
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES, device=device,
                 shape=(None, None, head_dim))
    check_last_dim_contiguous("query", query)
    num_heads = query.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads "
                         f"({num_kv_heads})")
    if not cache.is_quantized and cache.kv.dtype != query.dtype:
        raise ValueError(f"cache.kv dtype {cache.kv.dtype} must match query dtype {query.dtype}")
    check_tensor("context_lens", context_lens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    num_seqs = context_lens.shape[0]
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=INDEX_DTYPES, device=device,
                 shape=(num_seqs + 1,))
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("context_lens", context_lens)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=device,
                 shape=(num_seqs, None))
    check_last_dim_contiguous("block_tables", block_tables)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if num_seqs > 65535:
        raise ValueError(f"context_lens: at most 65535 sequences per call, got {num_seqs}")


# (BLOCK_M, BLOCK_N, num_warps, num_stages) the GPU autotuner picks from, per shape bucket.
_GPU_CONFIGS = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3),
                (128, 128, 8, 2), (64, 32, 4, 2)]


@functools.cache
def _tuned_kernel():
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
               for m, n, w, s in _GPU_CONFIGS]
    key = ["head_dim", "group", "q_bucket", "QUANTIZED", "K_DYNAMIC", "V_DYNAMIC", "HAS_WINDOW",
           "DOT_FP32"]
    return triton.autotune(configs=configs, key=key)(_prefill_kernel)


def _kernel_and_meta():
    """The kernel to launch and the launch meta it still needs (tiles are tiny and fixed under
    the interpreter; autotuned on a GPU)."""
    if interpreting():
        return _prefill_kernel, dict(BLOCK_M=16, BLOCK_N=16, num_warps=4)
    return _tuned_kernel(), {}


def prefill_attention(query: torch.Tensor, cache: KVCacheLayer, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                      sliding_window: int | None = None,
                      max_query_len: int | None = None) -> torch.Tensor:
    """Causal attention of packed queries (num_tokens, num_heads, head_dim) over paged context.

    ``cu_seqlens_q`` (num_seqs + 1,) packs the sequences; ``context_lens`` (num_seqs,) counts
    each sequence's tokens in the cache including this step's; ``block_tables`` is
    (num_seqs, max_blocks). ``max_query_len`` saves a device sync when given.
    Returns (num_tokens, num_heads, head_dim) in the query dtype.
    """
    _check_inputs(query, cache, cu_seqlens_q, context_lens, block_tables, sliding_window)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = context_lens.shape[0]
    block_size, num_kv_heads = cache.kv.shape[2], cache.kv.shape[3]
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_query_len < 1:
        return out
    kernel, meta = _kernel_and_meta()
    grid = lambda m: (triton.cdiv(max_query_len, m["BLOCK_M"]), num_seqs, num_heads)
    dot_fp32 = dot_in_fp32(query.dtype)
    scales = (cache.k_scale, cache.v_scale) if cache.is_quantized else (cache.kv, cache.kv)
    token_scales = [cache.kv if t is None else t for t in (cache.k_token_scale,
                                                           cache.v_token_scale)]
    kernel[grid](
        query, cache.kv, scales[0], scales[1], *token_scales, cu_seqlens_q, context_lens,
        block_tables, out,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        cache.kv.stride(0), cache.kv.stride(2), cache.kv.stride(3), block_tables.stride(0),
        scale * LOG2E, num_heads // num_kv_heads, head_dim, block_size, sliding_window or 0,
        int(max_query_len > 64) + int(max_query_len > 512), num_kv_heads,
        QUANTIZED=cache.is_quantized, K_DYNAMIC=cache.k_token_scale is not None,
        V_DYNAMIC=cache.v_token_scale is not None, HAS_WINDOW=sliding_window is not None,
        DOT_FP32=dot_fp32, PRECISION=dot_precision(dot_fp32), BLOCK_D=next_pow2(head_dim),
        **meta,
    )
    return out
