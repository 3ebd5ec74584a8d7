"""Triton paged decode attention: split-K flash-decoding over a paged KV pool.

Reference: :func:`pdserve.kernels.torch_attention.paged_decode_attention_torch`. Each sequence
brings one query token (its last position ``context_len - 1``). Pass 1 runs one program per
(sequence, kv head, split): the ``group`` query heads sharing that kv head are the rows of one
``tl.dot``, and the split's slice of the visible keys (the whole context, or its last
``sliding_window`` tokens) is streamed tile by tile through the block table with an online
softmax. With one split pass 1 writes the output directly; otherwise it writes per-split
normalised partials and their log-sum-exp, and pass 2 (one program per (sequence, head))
merges them. The number of splits grows with the longest visible context until the grid
covers the GPU a few times over.
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
    num_sms,
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

MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost outweighs the parallelism it adds
MAX_SPLITS = 64  # bounds the partial buffers and the merge


@triton.jit
def _decode_split_kernel(
    q_ptr, kv_ptr, k_scale_ptr, v_scale_ptr, kt_ptr, vt_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_cache_kv, stride_cache_slot, stride_cache_h, stride_bt,
    qk_scale, group, head_dim, block_size, window, split_size, num_splits, ctx_bucket,
    QUANTIZED: tl.constexpr, K_DYNAMIC: tl.constexpr, V_DYNAMIC: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Pass 1: the ``group`` query heads of one kv head against one split of the context.

    ``ctx_bucket`` (0, 1, 2: split up to 256, 2048, longer) only keys the autotuner's cache."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(ctx - window, 0)
    lo = start + split * split_size
    hi = tl.minimum(lo + split_size, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < group
    d_mask = offs_d < head_dim
    heads = kv_head * group + offs_g
    q = _load_query(q_ptr, seq * stride_qs + heads * stride_qh, g_mask, offs_d, d_mask,
                    qk_scale, k_scale_ptr, kv_head, head_dim,
                    QUANTIZED=QUANTIZED, DOT_FP32=DOT_FP32)  # (G, D)

    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt
    k_head_ptr = kv_ptr + kv_head.to(tl.int64) * stride_cache_h
    num_kv_heads = tl.num_programs(1)
    for n0 in tl.range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < hi
        slots = _token_slots(bt_row, pos, valid, block_size)
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_head_ptr, stride_cache_kv, slots, stride_cache_slot, offs_d,
            valid[:, None] & d_mask[None, :], valid[None, :], valid, kt_ptr + kv_head,
            vt_ptr + kv_head, num_kv_heads, APPLY_MASK=True, PRECISION=PRECISION,
            K_DYNAMIC=K_DYNAMIC, V_DYNAMIC=V_DYNAMIC)
    out = _finish(acc, l_i, v_scale_ptr, kv_head, offs_d, d_mask, head_dim, QUANTIZED=QUANTIZED)

    store_mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE_SPLIT:
        ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        row = (seq * tl.num_programs(1) * group + heads) * num_splits + split  # (G,)
        tl.store(part_out_ptr + row[:, None] * head_dim + offs_d[None, :], out, mask=store_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_os, stride_oh, num_heads, num_splits, head_dim,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Pass 2: merge one (sequence, head)'s split partials by their log-sum-exp weights."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    rows = (seq * num_heads + head) * num_splits + offs_s  # (S,)
    lse = tl.load(part_lse_ptr + rows, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # (S,); empty splits weigh 0
    mask = s_mask[:, None] & (offs_d[None, :] < head_dim)
    parts = tl.load(part_out_ptr + rows[:, None] * head_dim + offs_d[None, :], mask=mask, other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)  # (D,)
    ptrs = out_ptr + seq * stride_os + head * stride_oh + offs_d
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


def choose_num_splits(num_seqs: int, num_kv_heads: int, visible_len: int,
                      device: torch.device) -> int:
    """Splits per sequence: enough programs for ~8 per SM (so the last wave is a small part of
    the work), never a split under ``MIN_SPLIT_TOKENS`` keys."""
    by_length = triton.cdiv(max(visible_len, 1), MIN_SPLIT_TOKENS)
    by_occupancy = triton.cdiv(8 * num_sms(device), max(num_seqs * num_kv_heads, 1))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


# (BLOCK_N, num_warps, num_stages) the GPU autotuner picks from, per shape bucket.
_GPU_CONFIGS = [(64, 4, 2), (64, 4, 3), (32, 4, 3), (128, 8, 2), (64, 8, 3), (32, 2, 4)]


@functools.cache
def _tuned_kernel():
    configs = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
               for n, w, s in _GPU_CONFIGS]
    key = ["head_dim", "group", "block_size", "ctx_bucket", "QUANTIZED", "K_DYNAMIC",
           "V_DYNAMIC", "SINGLE_SPLIT", "DOT_FP32"]
    return triton.autotune(configs=configs, key=key)(_decode_split_kernel)


def _kernel_and_meta():
    """The pass-1 kernel and the launch meta it still needs (a tiny fixed tile under the
    interpreter; autotuned on a GPU)."""
    if interpreting():
        return _decode_split_kernel, dict(BLOCK_N=16, num_warps=4)
    return _tuned_kernel(), {}


def _check_inputs(query, cache, block_tables, context_lens, sliding_window):
    device = query.device
    check_cache("cache", cache, device)
    _, _, block_size, num_kv_heads, head_dim = cache.kv.shape
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES, device=device,
                 shape=(None, None, head_dim))
    check_last_dim_contiguous("query", query)
    num_seqs, num_heads, _ = query.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads "
                         f"({num_kv_heads})")
    if not cache.is_quantized and cache.kv.dtype != query.dtype:
        raise ValueError(f"cache.kv dtype {cache.kv.dtype} must match query dtype {query.dtype}")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=device,
                 shape=(num_seqs, None))
    check_last_dim_contiguous("block_tables", block_tables)
    check_tensor("context_lens", context_lens, ndim=1, dtypes=INDEX_DTYPES, device=device,
                 shape=(num_seqs,))
    if not context_lens.is_contiguous():
        raise ValueError("context_lens must be contiguous")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")


def decode_attention(query: torch.Tensor, cache: KVCacheLayer, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                     max_context_len: int | None = None,
                     num_splits: int | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    query: (num_seqs, num_heads, head_dim); block_tables: (num_seqs, max_blocks);
    context_lens: (num_seqs,) tokens in cache including the query's own. ``max_context_len``
    saves a device sync when given; ``num_splits`` overrides the split heuristic (tests).
    Returns (num_seqs, num_heads, head_dim) in the query dtype.
    """
    _check_inputs(query, cache, block_tables, context_lens, sliding_window)
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = cache.kv.shape[2], cache.kv.shape[3]
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    if max_context_len > block_tables.shape[1] * block_size:
        raise ValueError(f"max_context_len {max_context_len} exceeds block_tables capacity "
                         f"{block_tables.shape[1]} x {block_size}")
    visible = max_context_len if sliding_window is None else min(max_context_len, sliding_window)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, visible, query.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    split_size = triton.cdiv(triton.cdiv(max(visible, 1), num_splits), 16) * 16
    num_splits = triton.cdiv(max(visible, 1), split_size)  # drop splits that would be empty

    group = num_heads // num_kv_heads
    single = num_splits == 1
    part_out = part_lse = out  # placeholders when pass 1 writes the output directly
    if not single:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim,
                               dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                               device=query.device)
    dot_fp32 = dot_in_fp32(query.dtype)
    scales = (cache.k_scale, cache.v_scale) if cache.is_quantized else (cache.kv, cache.kv)
    token_scales = [cache.kv if t is None else t for t in (cache.k_token_scale,
                                                           cache.v_token_scale)]
    kernel, meta = _kernel_and_meta()
    kernel[(num_seqs, num_kv_heads, num_splits)](
        query, cache.kv, scales[0], scales[1], *token_scales, block_tables, context_lens,
        out, part_out, part_lse,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        cache.kv.stride(0), cache.kv.stride(2), cache.kv.stride(3), block_tables.stride(0),
        scale * LOG2E, group, head_dim, block_size, sliding_window or 0, split_size, num_splits,
        int(split_size > 256) + int(split_size > 2048),
        QUANTIZED=cache.is_quantized, K_DYNAMIC=cache.k_token_scale is not None,
        V_DYNAMIC=cache.v_token_scale is not None, HAS_WINDOW=sliding_window is not None,
        SINGLE_SPLIT=single, DOT_FP32=dot_fp32, PRECISION=dot_precision(dot_fp32),
        BLOCK_G=max(16, next_pow2(group)), BLOCK_D=next_pow2(head_dim), **meta,
    )
    if not single:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_heads, num_splits,
            head_dim, BLOCK_S=next_pow2(num_splits), BLOCK_D=next_pow2(head_dim), num_warps=4,
        )
    return out
