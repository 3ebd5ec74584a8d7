"""Triton batched LoRA deltas: ``out[t] += b[s] @ (a[s] @ x[t])`` for every row ``t`` whose
slot ``s`` is not -1, each row gathering its own adapter (punica's "bgmv" design), so one
launch serves a step that mixes adapters and base-model rows.

Reference: :func:`pdserve.kernels.lora.lora_delta_gather`, computed the same way: float32
products and sums, the delta rounded to ``out``'s dtype and then added (what its
``index_add_`` does). Rows of slot -1 read nothing and write nothing.

Two kernels, not one fused:

1. shrink, one program per row: ``x[t] @ a[s].T`` -> (rank,) float32 into a (T, rank)
   buffer, streaming ``in`` tile by tile;
2. expand, one program per (row, tile of ``out``): ``b[s][tile] @ shrunk[t]`` added into
   ``out[t][tile]``.

A fused kernel tiled over ``out`` would have to redo the shrink in every tile, reading
``x[t]`` and all of ``a[s]`` once per tile of ``out``, to save one launch and a (T, rank)
float32 buffer of a few KB; untiled, one program per row would walk all of ``b[s]`` alone and
leave the GPU idle at decode's few rows. Split in two, every byte of ``x``, ``a`` and ``b`` a
row needs is read once, and the expand has ``T x out / BLOCK_N`` programs to spread. Both
contract with ``tl.sum`` over a broadcast product, not ``tl.dot``: one row is far below
``tl.dot``'s 16-row minimum, and the work is bound by reading the adapter weights, not by
arithmetic.

``token_slots`` values must lie in [-1, slots): checking them would cost a device sync per
layer, so they are trusted (:class:`pdserve.kernels.lora.LoraBatch` builds them once per step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._launch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_last_dim_contiguous,
    check_tensor,
    interpreting,
    next_pow2,
)

TILE_ELEMENTS = 4096  # one program's (rank, in) or (out, rank) tile of weights, in elements
INTERPRET_BLOCK = 16  # the tile side under the interpreter: tiny tests still cross tiles


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slots_ptr, shrunk_ptr,
    stride_xt, stride_as, stride_ar, stride_st,
    in_features, rank,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program per row: ``shrunk[t] = a[s] @ x[t]`` in float32 (nothing for slot -1)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    ranks = tl.where(slot >= 0, rank, 0)  # a base-model row reads and writes nothing
    k_end = tl.where(slot >= 0, in_features, 0)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_mask = offs_r < ranks
    a_rows = a_ptr + slot * stride_as + offs_r[:, None] * stride_ar  # (R, 1)
    acc = tl.zeros((BLOCK_R,), tl.float32)
    for k0 in tl.range(0, k_end, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < in_features
        xk = tl.load(x_ptr + t * stride_xt + k, mask=k_mask, other=0.0).to(tl.float32)  # (K,)
        ak = tl.load(a_rows + k[None, :], mask=r_mask[:, None] & k_mask[None, :],
                     other=0.0).to(tl.float32)  # (R, K)
        acc += tl.sum(ak * xk[None, :], 1)
    tl.store(shrunk_ptr + t * stride_st + offs_r, acc, mask=r_mask)


@triton.jit
def _expand_kernel(
    shrunk_ptr, b_ptr, slots_ptr, out_ptr,
    stride_st, stride_bs, stride_bo, stride_ot,
    out_features, rank,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (row, tile of ``out``): ``out[t][tile] += b[s][tile] @ shrunk[t]``."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    n_mask = offs_n < tl.where(slot >= 0, out_features, 0)  # a base-model row writes nothing
    r_mask = offs_r < tl.where(slot >= 0, rank, 0)
    shrunk = tl.load(shrunk_ptr + t * stride_st + offs_r, mask=r_mask, other=0.0)  # (R,)
    bt = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bo + offs_r[None, :],
                 mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)  # (N, R)
    delta = tl.sum(bt * shrunk[None, :], 1)  # (N,)
    out_ty = out_ptr.dtype.element_ty
    ptrs = out_ptr + t * stride_ot + offs_n
    old = tl.load(ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (old + delta.to(out_ty).to(tl.float32)).to(out_ty), mask=n_mask)


def _check_inputs(out, x, a, b, token_slots) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    device = x.device
    num_tokens, in_features = x.shape
    check_tensor("out", out, ndim=2, dtypes=FLOAT_DTYPES, device=device,
                 shape=(num_tokens, None))
    check_tensor("a", a, ndim=3, dtypes=FLOAT_DTYPES, device=device,
                 shape=(None, None, in_features))
    num_slots, rank, _ = a.shape
    check_tensor("b", b, ndim=3, dtypes=FLOAT_DTYPES, device=device,
                 shape=(num_slots, out.shape[1], rank))
    check_tensor("token_slots", token_slots, ndim=1, dtypes=INDEX_DTYPES, device=device,
                 shape=(num_tokens,))
    for name, t in (("out", out), ("x", x), ("a", a), ("b", b)):
        check_last_dim_contiguous(name, t)
    if num_tokens > 1 and token_slots.stride(0) != 1:
        raise ValueError("token_slots must be contiguous")


def _blocks(rank: int, in_features: int, out_features: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_K, BLOCK_N): every rank row in one tile, ``in`` and ``out`` tiled so a
    program's weight tile stays near ``TILE_ELEMENTS``."""
    block_r = next_pow2(rank)
    if interpreting():
        return block_r, INTERPRET_BLOCK, INTERPRET_BLOCK
    side = max(16, TILE_ELEMENTS // block_r)
    return block_r, min(side, next_pow2(in_features)), min(side, next_pow2(out_features))


def lora_delta_triton(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      token_slots: torch.Tensor) -> None:
    """Add ``b[s] @ (a[s] @ x[t])`` into ``out[t]`` in place for each row ``t`` of slot
    ``s = token_slots[t] >= 0``.

    out: (T, out) the layer's output; x: (T, in) its input;
    a: (slots, rank, in); b: (slots, out, rank), the scaling folded in; token_slots: (T,)
    int32/int64, -1 for a base-model row. Float tensors may mix fp32, fp16 and bf16.
    """
    _check_inputs(out, x, a, b, token_slots)
    num_tokens, in_features = x.shape
    out_features, rank = b.shape[1], b.shape[2]
    if num_tokens == 0 or rank == 0 or out_features == 0:
        return
    shrunk = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    block_r, block_k, block_n = _blocks(rank, in_features, out_features)
    _shrink_kernel[(num_tokens,)](
        x, a, token_slots, shrunk,
        x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0),
        in_features, rank,
        BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4,
    )
    _expand_kernel[(num_tokens, triton.cdiv(out_features, block_n))](
        shrunk, b, token_slots, out,
        shrunk.stride(0), b.stride(0), b.stride(1), out.stride(0),
        out_features, rank,
        BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4,
    )
