"""Torch reference implementations of every kernel: the CPU serving path and the oracle the
Triton kernels are tested against. No Python loops over sequences or blocks."""

from __future__ import annotations

import threading

import torch

from pdserve.kernels.kv_layout import MIN_TOKEN_SCALE, TOKEN_SCALE_DTYPE, KVCacheLayer


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` without the call when it already is (a no-op ``to`` still costs a
    dispatch, several per layer on a small-batch CPU forward)."""
    return x if x.dtype == dtype else x.to(dtype)


def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(..., kv_heads, head_dim) -> int8 with per-(head, channel) ``scale``."""
    return torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8)


def quantize_int8_dynamic(x: torch.Tensor,
                          scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, kv_heads, head_dim) -> (int8, token scales (T, kv_heads) float16): per channel by
    ``scale``, then per (token, head) so the largest channel maps to 127 (see kv_layout)."""
    y = x.float() / scale
    token_scale = (y.abs().amax(-1) / 127.0).clamp_(min=MIN_TOKEN_SCALE).to(TOKEN_SCALE_DTYPE)
    return quantize_int8(y, token_scale.float()[..., None]), token_scale


def dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
               token_scale: torch.Tensor | None = None) -> torch.Tensor:
    """int8 ``x`` (..., kv_heads, head_dim) times its channel (and token) scales."""
    if scale is None:
        return as_dtype(x, dtype)
    out = x.float() * scale
    if token_scale is not None:  # (..., kv_heads)
        out = out * token_scale.float()[..., None]
    return out.to(dtype)


def _quantize_into(x: torch.Tensor, scale: torch.Tensor, token_scale: torch.Tensor | None,
                   slot_mapping: torch.Tensor) -> torch.Tensor:
    """int8 of ``x``; a dynamic half also scatters its token scales into ``token_scale``."""
    if token_scale is None:
        return quantize_int8(x, scale)
    q, t = quantize_int8_dynamic(x, scale)
    token_scale.view(-1, token_scale.shape[-1]).index_copy_(0, slot_mapping, t)
    return q


def write_kv_ref(key: torch.Tensor, value: torch.Tensor, cache: KVCacheLayer,
                 slot_mapping: torch.Tensor) -> None:
    """Scatter ``key``/``value`` (num_tokens, kv_heads, head_dim) into ``slot_mapping`` slots."""
    k_flat, v_flat = cache.slot_rows()  # (num_slots, kv_heads, head_dim) each
    if cache.is_quantized:
        key = _quantize_into(key, cache.k_scale, cache.k_token_scale, slot_mapping)
        value = _quantize_into(value, cache.v_scale, cache.v_token_scale, slot_mapping)
    k_flat.index_copy_(0, slot_mapping, as_dtype(key, k_flat.dtype))
    v_flat.index_copy_(0, slot_mapping, as_dtype(value, v_flat.dtype))


def _context_slots(block_tables: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                   max_ctx: int, block_size: int) -> torch.Tensor:
    """(S, ctx) cache slot of each sequence's context positions 0 .. max_ctx - 1.

    Only positions in ``[lo, hi)`` (per sequence, the keys some query may see) are read; the
    others repeat the nearest of those, since slots past a sequence's end or behind block table
    padding may hold anything, NaN included, and 0 * NaN would leak through the softmax.
    """
    pos = torch.arange(max_ctx, device=block_tables.device)[None, :]
    pos = torch.minimum(torch.maximum(pos, lo[:, None]), hi[:, None] - 1).clamp_(min=0)
    return block_tables.long().gather(1, pos // block_size) * block_size + pos % block_size


def _gather_context(cache: KVCacheLayer, slots: torch.Tensor):
    """Each sequence's K and V at ``slots`` (S, ctx): (S, ctx, kv_heads, hd) fp32."""
    flat = slots.view(-1)

    def rows(table: torch.Tensor) -> torch.Tensor:  # (num_slots, *row) -> (S, ctx, *row)
        # a row gather (index_select): the same values as pool[slots], 1-4x faster on CPU
        return table.index_select(0, flat).view(*slots.shape, *table.shape[1:])

    k_t, v_t = (None if t is None else rows(t.view(-1, t.shape[-1]))  # (S, ctx, kv_heads)
                for t in (cache.k_token_scale, cache.v_token_scale))
    k_rows, v_rows = cache.slot_rows()
    return (dequantize(rows(k_rows), cache.k_scale, torch.float32, k_t),
            dequantize(rows(v_rows), cache.v_scale, torch.float32, v_t))


class _DecodePlan:
    """The slots and the additive visibility mask of one decode batch, shared by every layer of
    a step.

    Every layer of a forward passes the same ``block_tables`` and ``context_lens`` tensors, so
    the plan is computed once per step. It is reused only for those very tensor objects at the
    same version (``_version`` counts in-place writes, as CUDA-graph-style static buffers do;
    inference tensors count none, so theirs is never reused); holding them keeps their ids from
    being reused. One plan per thread (workers' engine loops
    share a process in tests and the local launcher).
    """

    _local = threading.local()

    @classmethod
    def of(cls, block_tables: torch.Tensor, context_lens: torch.Tensor,
           sliding_window: int | None, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots (S, ctx), additive mask (S, 1, 1, ctx))."""
        # inference tensors track no version: their plans are never reused
        reusable = not (block_tables.is_inference() or context_lens.is_inference())
        key = ((block_tables._version, context_lens._version, sliding_window, block_size)
               if reusable else None)
        held = getattr(cls._local, "plan", None)
        if (reusable and held is not None and held[0] is block_tables
                and held[1] is context_lens and held[2] == key):
            return held[3]
        plan = cls._build(block_tables, context_lens, sliding_window, block_size)
        cls._local.plan = (block_tables, context_lens, key, plan) if reusable else None
        return plan

    @staticmethod
    def _build(block_tables: torch.Tensor, context_lens: torch.Tensor,
               sliding_window: int | None, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan in few ops (it runs once per step): positions clamped into each sequence's
        visible keys (see :func:`_context_slots`), their slots, and the additive mask."""
        pos = torch.arange(int(context_lens.max()), device=context_lens.device)  # (ctx,)
        last = context_lens[:, None].long() - 1  # (S, 1): the query's position
        visible = pos <= last  # (S, ctx)
        clamped = torch.minimum(pos, last)
        if sliding_window is not None:
            first = last - sliding_window + 1
            visible &= pos >= first
            clamped = torch.maximum(clamped, first)
        # int32 tables gather as they are; the arithmetic then widens to int64
        slots = block_tables.gather(1, clamped // bs) * bs + clamped % bs
        mask = torch.where(visible, 0.0, -torch.inf)[:, None, None]  # (S, 1, 1, ctx)
        return slots, mask


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
            scale: float) -> torch.Tensor:
    """fp32 GQA attention. q: (S, heads, Q, hd); k, v: (S, ctx, kv_heads, hd);
    visible: (S, Q, ctx). Returns (S, heads, Q, hd); rows that see nothing are undefined."""
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible[:, None], scale=scale,
        enable_gqa=True)


def _visible(q_pos: torch.Tensor, max_ctx: int, sliding_window: int | None) -> torch.Tensor:
    """(S, Q) query positions -> (S, Q, ctx) bool: key k visible iff k <= p (and k > p - w)."""
    k_pos = torch.arange(max_ctx, device=q_pos.device)
    visible = k_pos[None, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        visible &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    return visible


def _padded_attention(query: torch.Tensor, cache: KVCacheLayer, q_lens: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                      sliding_window: int | None) -> torch.Tensor:
    """Attention of packed queries (tokens, heads, hd) whose sequences have ``q_lens``,
    computed on a (num_seqs, max_q) padding. Returns fp32 (tokens, heads, hd)."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = context_lens.shape[0]
    device = query.device
    max_q = int(q_lens.max())
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)
    starts = torch.cumsum(q_lens, 0) - q_lens
    local = torch.arange(num_tokens, device=device) - starts[seq_of_token]
    q = query.new_zeros(num_seqs, max_q, num_heads, head_dim, dtype=torch.float32)
    q[seq_of_token, local] = query.float()

    q_pos = (context_lens.long() - q_lens)[:, None] + torch.arange(max_q, device=device)
    q_pos = torch.where(torch.arange(max_q, device=device)[None, :] < q_lens[:, None], q_pos, -1)
    max_ctx = int(context_lens.max())
    visible = _visible(q_pos, max_ctx, sliding_window)  # (S, max_q, ctx); padding sees nothing
    first = context_lens.long() - q_lens  # first query position per sequence
    lo = first - sliding_window + 1 if sliding_window is not None else torch.zeros_like(first)
    k, v = _gather_context(cache, _context_slots(block_tables, lo, context_lens.long(), max_ctx,
                                                 cache.block_size))
    out = _attend(q.transpose(1, 2), k, v, visible, scale)  # (S, heads, max_q, hd)
    return out.transpose(1, 2)[seq_of_token, local]


def paged_attention_ref(query: torch.Tensor, cache: KVCacheLayer, cu_seqlens_q: torch.Tensor,
                        context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                        sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of packed variable-length queries over their paged contexts.

    query: (num_tokens, num_heads, head_dim), sequences packed by ``cu_seqlens_q`` (num_seqs+1).
    Sequence ``s``'s queries are the last ``q_len`` positions of its ``context_lens[s]`` tokens,
    whose K/V are already in the cache. A query at position ``p`` sees keys ``k`` with
    ``k <= p`` and, with a window ``w``, ``k > p - w``. Returns (num_tokens, num_heads, head_dim).

    Sequences with one query (decodes in a mixed batch) take the decode path, so a long
    prefill chunk does not pad every decode in the batch to its length.
    """
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    if query.shape[0] == 0:
        return query.new_empty(query.shape)
    single = q_lens == 1
    if bool(single.all()):
        return paged_decode_attention_ref(query, cache, block_tables, context_lens, scale,
                                          sliding_window)
    if not bool(single.any()):
        return _padded_attention(query, cache, q_lens, context_lens, block_tables, scale,
                                 sliding_window).to(query.dtype)
    token_single = torch.repeat_interleave(single, q_lens)  # (num_tokens,)
    out = torch.empty_like(query)
    out[token_single] = paged_decode_attention_ref(
        query[token_single], cache, block_tables[single], context_lens[single], scale,
        sliding_window)
    multi = ~single
    out[~token_single] = _padded_attention(
        query[~token_single], cache, q_lens[multi], context_lens[multi], block_tables[multi],
        scale, sliding_window).to(query.dtype)
    return out


def paged_decode_attention_ref(query: torch.Tensor, cache: KVCacheLayer, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None) -> torch.Tensor:
    """One query token per sequence (its last position). query: (num_seqs, num_heads, head_dim)."""
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return query.new_empty(query.shape)
    slots, mask = _DecodePlan.of(block_tables, context_lens, sliding_window, cache.block_size)
    k, v = _gather_context(cache, slots)
    q = query.float()[:, :, None]  # (S, heads, 1, hd)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True)
    return as_dtype(out[:, :, 0], query.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """RMSNorm in fp32 (as Hugging Face does). With ``residual``: returns (norm(x + r), x + r).

    fp32 is torch's fused ``rms_norm``, Hugging Face's formula to the bit. Other dtypes round
    the normalised row to ``x.dtype`` before the weight, as Hugging Face does; there
    ``(h * h).sum(-1) / n`` is its ``h.pow(2).mean(-1)`` to the bit (torch squares by one
    multiply, and its CPU mean is that sum divided by n) in two ops fewer."""
    if residual is not None:
        x = x + residual
        residual = x
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        out = torch.nn.functional.rms_norm(x, weight.shape, weight, eps)
    else:
        h = x.float()
        h = h * torch.rsqrt((h * h).sum(-1, keepdim=True) / h.shape[-1] + eps)
        out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def rope_table_ref(positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of ``positions`` as (T, 1, D) fp32 across the whole head: ``(cos, cos)`` and
    ``(-sin, sin)``, what :func:`rotary_ref` multiplies by. A model computes it once per
    forward for every layer."""
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # (T, D/2) each
    return torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None]


def rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE. q: (T, H, D), k: (T, KH, D), cos_sin_cache: (max_pos, D) = [cos | sin];
    ``table``: :func:`rope_table_ref` of these positions, when the caller already has it.

    ``x * (cos, cos) + (x2, x1) * (-sin, sin)`` is ``(x1 cos - x2 sin, x2 cos + x1 sin)`` to
    the bit: negation is exact, commutes with the product, and ``a - b`` is ``a + (-b)``."""
    cos, sin = table if table is not None else rope_table_ref(positions, cos_sin_cache)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rotary_packed_ref(qk: torch.Tensor, num_heads: int, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor,
                      table: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_ref` of q and k packed as ``qk`` (T, heads + kv_heads, D), as they lie
    side by side in a fused qkv projection: one rotation for both (the same bits, half the
    ops); returns (q, k) as views of the rotated buffer."""
    cos, sin = table if table is not None else rope_table_ref(positions, cos_sin_cache)
    rotated = _rotate(qk, cos, sin)
    return rotated[:, :num_heads], rotated[:, num_heads:]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()  # (x2, x1) is x rolled by half a head: one op for chunk and cat
    return as_dtype(xf * cos + xf.roll(x.shape[-1] // 2, -1) * sin, x.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: (T, 2 * I) = [gate | up] -> silu(gate) * up, (T, I)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def pack_blocks_ref(caches: list[KVCacheLayer], block_ids: torch.Tensor) -> torch.Tensor:
    """Gather ``block_ids`` of every layer in ``caches`` into one contiguous buffer:
    (num_layers, 2, num_ids, block_size, kv_heads, head_dim)."""
    first = caches[0].kv
    num_ids = block_ids.numel()
    out = torch.empty((len(caches), 2, num_ids, *first.shape[2:]), dtype=first.dtype,
                      device=first.device)
    for layer, cache in enumerate(caches):
        for half in range(2):  # K, V: gather whole blocks as rows, straight into the buffer
            # (num_blocks, block_size * kv_heads * head_dim) -> (num_ids, same)
            torch.index_select(cache.kv[half].view(cache.num_blocks, -1), 0, block_ids,
                               out=out[layer, half].view(num_ids, -1))
    return out


def unpack_blocks_ref(buffer: torch.Tensor, caches: list[KVCacheLayer],
                      block_ids: torch.Tensor) -> None:
    """Scatter a :func:`pack_blocks_ref` buffer into ``block_ids`` of every layer in ``caches``."""
    for layer, cache in enumerate(caches):
        cache.kv.index_copy_(1, block_ids, buffer[layer])


def pack_token_scales(caches: list[KVCacheLayer], block_ids: torch.Tensor) -> torch.Tensor:
    """The dynamic token scales of ``block_ids`` in every layer: (num_layers, num_halves,
    num_ids, block_size, kv_heads) float16 (halves: K then V, those the pool has). Plain torch
    gathers: also the CUDA path (the scales are ~3 % of the blocks' bytes)."""
    return torch.stack([torch.stack([t.index_select(0, block_ids) for t in c.token_scales])
                        for c in caches])


def unpack_token_scales(buffer: torch.Tensor, caches: list[KVCacheLayer],
                        block_ids: torch.Tensor) -> None:
    """Scatter a :func:`pack_token_scales` buffer into ``block_ids`` of every layer."""
    for layer, cache in enumerate(caches):
        for half, t in enumerate(cache.token_scales):
            t.index_copy_(0, block_ids, buffer[layer, half])
