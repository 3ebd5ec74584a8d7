"""Every kernel but paged attention (``torch_attention``) in plain torch: the path the CPU
serves with, and the oracle the Triton kernels are tested against. No Python loops over
sequences or blocks."""

from __future__ import annotations

import torch

from pdserve.kernels.kv_layout import (
    MAX_TOKEN_SCALE,
    MIN_TOKEN_SCALE,
    TOKEN_SCALE_DTYPE,
    KVCacheLayer,
)


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
    token_scale = (y.abs().amax(-1) / 127.0).clamp_(MIN_TOKEN_SCALE, MAX_TOKEN_SCALE) \
        .to(TOKEN_SCALE_DTYPE)
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


def write_kv_torch(key: torch.Tensor, value: torch.Tensor, cache: KVCacheLayer,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter ``key``/``value`` (num_tokens, kv_heads, head_dim) into ``slot_mapping`` slots."""
    k_flat, v_flat = cache.slot_rows()  # (num_slots, kv_heads, head_dim) each
    if cache.is_quantized:
        key = _quantize_into(key, cache.k_scale, cache.k_token_scale, slot_mapping)
        value = _quantize_into(value, cache.v_scale, cache.v_token_scale, slot_mapping)
    k_flat.index_copy_(0, slot_mapping, as_dtype(key, k_flat.dtype))
    v_flat.index_copy_(0, slot_mapping, as_dtype(value, v_flat.dtype))


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
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


def rope_table_torch(positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of ``positions`` as (T, 1, D) fp32 across the whole head: ``(cos, cos)`` and
    ``(-sin, sin)``, what :func:`rotary_torch` multiplies by. A model computes it once per
    forward for every layer."""
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # (T, D/2) each
    return torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None]


def rotary_torch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE. q: (T, H, D), k: (T, KH, D), cos_sin_cache: (max_pos, D) = [cos | sin];
    ``table``: :func:`rope_table_torch` of these positions, when the caller already has it.

    ``x * (cos, cos) + (x2, x1) * (-sin, sin)`` is ``(x1 cos - x2 sin, x2 cos + x1 sin)`` to
    the bit: negation is exact, commutes with the product, and ``a - b`` is ``a + (-b)``."""
    cos, sin = table if table is not None else rope_table_torch(positions, cos_sin_cache)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rotary_packed_torch(qk: torch.Tensor, num_heads: int, positions: torch.Tensor,
                        cos_sin_cache: torch.Tensor,
                        table: tuple[torch.Tensor, torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_torch` of q and k packed as ``qk`` (T, heads + kv_heads, D), as they lie
    side by side in a fused qkv projection: one rotation for both (the same bits, half the
    ops); returns (q, k) as views of the rotated buffer."""
    cos, sin = table if table is not None else rope_table_torch(positions, cos_sin_cache)
    rotated = _rotate(qk, cos, sin)
    return rotated[:, :num_heads], rotated[:, num_heads:]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()  # (x2, x1) is x rolled by half a head: one op for chunk and cat
    return as_dtype(xf * cos + xf.roll(x.shape[-1] // 2, -1) * sin, x.dtype)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """x: (T, 2 * I) = [gate | up] -> silu(gate) * up, (T, I)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def pack_blocks_torch(caches: list[KVCacheLayer], block_ids: torch.Tensor) -> torch.Tensor:
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


def unpack_blocks_torch(buffer: torch.Tensor, caches: list[KVCacheLayer],
                        block_ids: torch.Tensor) -> None:
    """Scatter a :func:`pack_blocks_torch` buffer into ``block_ids`` of every layer of ``caches``.
    """
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
