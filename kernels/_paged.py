"""Triton building blocks shared by the paged attention kernels (decode and prefill).

Scores are kept in log2 units: the launcher folds ``scale * log2(e)`` (and, for an int8 pool,
the per-channel key scale) into the query, so the softmax uses ``exp2``. Values of an int8
pool are accumulated as integers times probabilities; the caller multiplies the per-channel
value scale in once at the end. Dynamic per-token scales (``K_DYNAMIC`` / ``V_DYNAMIC``)
multiply a key's score column after the dot (exact), and dequantize a value tile's rows before
the dot (real values, whatever the dtype's range).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _token_slots(bt_row_ptr, pos, valid, block_size):
    """Pool slots (int64) holding positions ``pos`` of one sequence.

    ``bt_row_ptr`` points at the sequence's block table row; ``valid`` masks positions that
    must not be looked up (their slot is 0 and must be masked by the caller's loads). A slot's
    element offset is ``slot * stride_slot``; its token scale sits at ``slot * kv_heads``.
    """
    block = tl.load(bt_row_ptr + pos // block_size, mask=valid, other=0).to(tl.int64)
    return block * block_size + (pos % block_size)


@triton.jit
def _attend_tile(q, acc, m_i, l_i, k_head_ptr, stride_cache_kv, slots, stride_slot, offs_d,
                 kv_mask, score_mask, tok_mask, kt_head_ptr, vt_head_ptr, num_kv_heads,
                 APPLY_MASK: tl.constexpr, PRECISION: tl.constexpr,
                 K_DYNAMIC: tl.constexpr, V_DYNAMIC: tl.constexpr):
    """One online-softmax step of ``q`` (M, D) against one tile of N paged keys/values.

    ``k_head_ptr`` points at the keys of this kv head; values sit ``stride_cache_kv`` further.
    ``slots`` (N,) are the rows' pool slots, ``kv_mask`` (N, D) guards the loads and
    ``score_mask`` (M, N) the scores when ``APPLY_MASK``; ``tok_mask`` (N,) guards the token
    scale loads. ``kt_head_ptr`` / ``vt_head_ptr``
    point at this kv head's token scales (read when ``K_DYNAMIC`` / ``V_DYNAMIC``).
    Returns the new (acc, m_i, l_i).
    """
    ptrs = k_head_ptr + (slots * stride_slot)[:, None] + offs_d[None, :]  # (N, D)
    k = tl.load(ptrs, mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (M, N), log2 units
    if K_DYNAMIC:
        k_t = tl.load(kt_head_ptr + slots * num_kv_heads, mask=tok_mask, other=0.0)
        s = s * k_t.to(tl.float32)[None, :]
    if APPLY_MASK:
        s = tl.where(score_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(ptrs + stride_cache_kv, mask=kv_mask, other=0.0)
    if V_DYNAMIC:
        v_t = tl.load(vt_head_ptr + slots * num_kv_heads, mask=tok_mask, other=0.0)
        v = v.to(tl.float32) * v_t.to(tl.float32)[:, None]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _load_query(q_ptr, row_off, row_mask, offs_d, d_mask, qk_scale, k_scale_ptr, kv_head,
                head_dim, QUANTIZED: tl.constexpr, DOT_FP32: tl.constexpr):
    """Load query rows (M, D), fold in ``qk_scale`` (and the int8 key scale), cast for tl.dot."""
    q = tl.load(q_ptr + row_off[:, None] + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(tl.float32) * qk_scale
    if QUANTIZED:
        k_scale = tl.load(k_scale_ptr + kv_head * head_dim + offs_d, mask=d_mask, other=0.0)
        q = q * k_scale[None, :]
    if not DOT_FP32:
        q = q.to(q_ptr.dtype.element_ty)
    return q


@triton.jit
def _finish(acc, l_i, v_scale_ptr, kv_head, offs_d, d_mask, head_dim, QUANTIZED: tl.constexpr):
    """Normalise the accumulator (rows that saw nothing give 0) and apply the int8 value scale."""
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if QUANTIZED:
        v_scale = tl.load(v_scale_ptr + kv_head * head_dim + offs_d, mask=d_mask, other=0.0)
        out = out * v_scale[None, :]
    return out


def dot_precision(dot_fp32: bool) -> str:
    """``tl.dot`` input precision: exact fp32 products when computing in fp32."""
    return "ieee" if dot_fp32 else "tf32"
