"""Torch reference implementations of every kernel: the CPU serving path and the oracle the
Triton kernels are tested against. No Python loops over sequences or blocks."""

from __future__ import annotations

import torch

from pdserve.kernels.kv_layout import KVCacheLayer


def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(..., kv_heads, head_dim) -> int8 with per-(head, channel) ``scale``."""
    return torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8)


def dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def write_kv_ref(key: torch.Tensor, value: torch.Tensor, cache: KVCacheLayer,
                 slot_mapping: torch.Tensor) -> None:
    """Scatter ``key``/``value`` (num_tokens, kv_heads, head_dim) into ``slot_mapping`` slots."""
    k_flat = cache.k.view(-1, *cache.k.shape[2:])  # (num_slots, kv_heads, head_dim)
    v_flat = cache.v.view(-1, *cache.v.shape[2:])
    if cache.is_quantized:
        key, value = quantize_int8(key, cache.k_scale), quantize_int8(value, cache.v_scale)
    k_flat.index_copy_(0, slot_mapping, key.to(k_flat.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(v_flat.dtype))


def _gather_context(cache: KVCacheLayer, block_tables: torch.Tensor, max_context_len: int):
    """Gather each sequence's K and V: (num_seqs, max_context_len, kv_heads, head_dim) fp32."""
    block_size = cache.block_size
    num_blocks = -(-max_context_len // block_size)
    table = block_tables[:, :num_blocks].long()  # (num_seqs, num_blocks)
    k = cache.k[table].flatten(1, 2)[:, :max_context_len]  # (num_seqs, ctx, kv_heads, head_dim)
    v = cache.v[table].flatten(1, 2)[:, :max_context_len]
    return dequantize(k, cache.k_scale, torch.float32), dequantize(v, cache.v_scale, torch.float32)


def paged_attention_ref(query: torch.Tensor, cache: KVCacheLayer, cu_seqlens_q: torch.Tensor,
                        context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                        sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of packed variable-length queries over their paged contexts.

    query: (num_tokens, num_heads, head_dim), sequences packed by ``cu_seqlens_q`` (num_seqs+1).
    Sequence ``s``'s queries are the last ``q_len`` positions of its ``context_lens[s]`` tokens,
    whose K/V are already in the cache. A query at position ``p`` sees keys ``k`` with
    ``k <= p`` and, with a window ``w``, ``k > p - w``. Returns (num_tokens, num_heads, head_dim).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = context_lens.shape[0]
    num_kv_heads = cache.k.shape[2]
    group = num_heads // num_kv_heads
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    max_q = int(q_lens.max())
    max_ctx = int(context_lens.max())
    k, v = _gather_context(cache, block_tables, max_ctx)  # (S, ctx, kv_heads, head_dim)

    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=query.device), q_lens)
    local = torch.arange(num_tokens, device=query.device) - cu_seqlens_q[seq_of_token].long()
    q = query.new_zeros(num_seqs, max_q, num_heads, head_dim, dtype=torch.float32)
    q[seq_of_token, local] = query.float()
    q = q.view(num_seqs, max_q, num_kv_heads, group, head_dim)

    q_pos = (context_lens.long() - q_lens)[:, None] + torch.arange(max_q, device=query.device)
    k_pos = torch.arange(max_ctx, device=query.device)
    visible = k_pos[None, None, :] <= q_pos[:, :, None]  # (S, max_q, ctx)
    if sliding_window is not None:
        visible &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window

    scores = torch.einsum("sqhgd,skhd->shgqk", q, k) * scale  # (S, kv_heads, group, max_q, ctx)
    scores.masked_fill_(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    out = torch.einsum("shgqk,skhd->sqhgd", probs, v)  # (S, max_q, kv_heads, group, head_dim)
    out = out.reshape(num_seqs, max_q, num_heads, head_dim)
    return out[seq_of_token, local].to(query.dtype)


def paged_decode_attention_ref(query: torch.Tensor, cache: KVCacheLayer, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None) -> torch.Tensor:
    """One query token per sequence (its last position). query: (num_seqs, num_heads, head_dim)."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = cache.k.shape[2]
    group = num_heads // num_kv_heads
    max_ctx = int(context_lens.max())
    k, v = _gather_context(cache, block_tables, max_ctx)  # (S, ctx, kv_heads, head_dim)
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    k_pos = torch.arange(max_ctx, device=query.device)
    last = context_lens.long()[:, None] - 1
    visible = k_pos[None, :] <= last  # (S, ctx)
    if sliding_window is not None:
        visible &= k_pos[None, :] > last - sliding_window
    scores = torch.einsum("shgd,skhd->shgk", q, k) * scale  # (S, kv_heads, group, ctx)
    scores.masked_fill_(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("shgk,skhd->shgd", probs, v)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """RMSNorm in fp32 (as Hugging Face does). With ``residual``: returns (norm(x + r), x + r)."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE. q: (T, H, D), k: (T, KH, D), cos_sin_cache: (max_pos, D) = [cos | sin]."""
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # (T, D/2) each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: (T, 2 * I) = [gate | up] -> silu(gate) * up, (T, I)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def pack_blocks_ref(caches: list[KVCacheLayer], block_ids: torch.Tensor) -> torch.Tensor:
    """Gather ``block_ids`` of every layer in ``caches`` into one contiguous buffer:
    (num_layers, 2, num_ids, block_size, kv_heads, head_dim)."""
    return torch.stack([c.kv.index_select(1, block_ids) for c in caches])


def unpack_blocks_ref(buffer: torch.Tensor, caches: list[KVCacheLayer],
                      block_ids: torch.Tensor) -> None:
    """Scatter a :func:`pack_blocks_ref` buffer into ``block_ids`` of every layer in ``caches``."""
    for layer, cache in enumerate(caches):
        cache.kv.index_copy_(1, block_ids, buffer[layer])
