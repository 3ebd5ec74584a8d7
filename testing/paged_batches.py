"""Random paged-KV batches for kernel tests and benchmarks (torch only; never imports triton).

:func:`random_paged_batch` builds a pool whose blocks are handed out in random order, fills
each sequence's context through :func:`~pdserve.kernels.torch_ops.write_kv_torch` (so an int8
pool is quantised exactly as the engine would) and leaves every other slot POISONED: NaN for a
float pool, -128 (a value quantisation never produces) for int8. Block 0 is never allocated,
so a kernel that follows a block-table padding entry reads poison.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pdserve.kernels.kv_layout import TOKEN_SCALE_DTYPE, KVCacheLayer
from pdserve.kernels.torch_ops import write_kv_torch

INT8_POISON = -128


def new_seed() -> int:
    """A fresh 63-bit seed from the OS (tests print it so a failure can be replayed)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with a value no kernel should leave behind; returns ``t``."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t
    return t.fill_(INT8_POISON if t.dtype == torch.int8 else -1)


@dataclass
class PagedBatch:
    """One step's worth of paged attention inputs (shapes as the kernels take them)."""

    query: torch.Tensor  # (num_tokens, num_heads, head_dim): the last q_len positions per seq
    cache: KVCacheLayer  # pool holding every sequence's full context
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32, padded with 0 (a poisoned block)
    context_lens: torch.Tensor  # (num_seqs,) int32
    cu_seqlens_q: torch.Tensor  # (num_seqs + 1,) int32
    slot_mapping: torch.Tensor  # (num_tokens,) int64: slots of the query positions
    max_query_len: int  # longest q_len
    max_context_len: int  # longest context


def random_scales(num_kv_heads: int, head_dim: int, gen: torch.Generator) -> torch.Tensor:
    """Per-(head, channel) int8 scales for unit-normal data: max |x| ~ 4 maps near 127."""
    return torch.rand(num_kv_heads, head_dim, generator=gen, device=gen.device) * 0.02 + 0.025


def random_paged_batch(context_lens: list[int], q_lens: list[int], num_heads: int,
                       num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                       gen: torch.Generator, quantized: bool = False,
                       spare_blocks: int = 3, dynamic: str = "") -> PagedBatch:
    """Sequences with ``context_lens`` tokens in a shuffled pool; queries for the last
    ``q_lens`` positions of each (``q_len <= context_len``). Tensors live on ``gen.device``.
    ``dynamic`` ("k", "v", "kv") gives those halves of an int8 pool per-token scales (NaN
    where no token was written)."""
    if len(context_lens) != len(q_lens) or not context_lens:
        raise ValueError("q_lens must have one entry per context_lens entry (at least one)")
    if any(q > c for q, c in zip(q_lens, context_lens, strict=True)):
        raise ValueError("q_lens entries must not exceed their context_lens entries")
    device = gen.device
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    kv = poison_(torch.empty(2, num_blocks, block_size, num_kv_heads, head_dim,
                             dtype=torch.int8 if quantized else dtype, device=device))
    scales = (random_scales(num_kv_heads, head_dim, gen),
              random_scales(num_kv_heads, head_dim, gen)) if quantized else (None, None)
    token_scales = [poison_(torch.empty(num_blocks, block_size, num_kv_heads,
                                        dtype=TOKEN_SCALE_DTYPE, device=device))
                    if quantized and half in dynamic else None for half in "kv"]
    cache = KVCacheLayer(kv, *scales, *token_scales)

    # Block 0 is never handed out, so it stays poison behind every padding entry.
    order = torch.randperm(num_blocks - 1, generator=gen, device=device) + 1
    block_tables = torch.zeros(len(context_lens), max(blocks_per_seq), dtype=torch.int32,
                               device=device)
    slots, query_slots, used = [], [], 0
    for s, (ctx, q_len) in enumerate(zip(context_lens, q_lens, strict=True)):
        table = order[used:used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        block_tables[s, :table.shape[0]] = table.to(torch.int32)
        pos = torch.arange(ctx, device=device)
        seq_slots = table[pos // block_size] * block_size + pos % block_size  # (ctx,)
        slots.append(seq_slots)
        query_slots.append(seq_slots[ctx - q_len:])
    slot_mapping = torch.cat(slots)
    shape = (slot_mapping.shape[0], num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen, device=device).to(dtype)
    v = torch.randn(shape, generator=gen, device=device).to(dtype)
    write_kv_torch(k, v, cache, slot_mapping)

    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen, device=device).to(dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(torch.tensor(q_lens, device=device), 0)
    return PagedBatch(
        query=query, cache=cache, block_tables=block_tables,
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=cu, slot_mapping=torch.cat(query_slots),
        max_query_len=max(q_lens), max_context_len=max(context_lens),
    )


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| in fp32 (NaN anywhere in ``out`` gives NaN)."""
    out, ref = out.float(), ref.float()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


# Relative error allowed against the fp32 reference, by output dtype.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
