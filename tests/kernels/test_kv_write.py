"""Triton KV write against write_kv_torch: float and int8 pools, poisoned destinations."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.kv_layout import TOKEN_SCALE_DTYPE, KVCacheLayer
from pdserve.kernels.torch_ops import dequantize, quantize_int8, write_kv_torch
from pdserve.testing.paged_batches import poison_, random_scales

pytestmark = pytest.mark.triton


def _pool(dtype, quantized, num_blocks, block_size, kv_heads, head_dim, gen):
    kv = poison_(torch.empty(2, num_blocks, block_size, kv_heads, head_dim,
                             dtype=torch.int8 if quantized else dtype))
    if not quantized:
        return KVCacheLayer(kv)
    return KVCacheLayer(kv, random_scales(kv_heads, head_dim, gen),
                        random_scales(kv_heads, head_dim, gen))


def _clone(cache: KVCacheLayer) -> KVCacheLayer:
    return KVCacheLayer(cache.kv.clone(), cache.k_scale, cache.v_scale)


@pytest.mark.parametrize("dtype,quantized,head_dim", [
    (torch.float32, False, 64), (torch.bfloat16, False, 128), (torch.float16, False, 64),
    (torch.float32, True, 128), (torch.bfloat16, True, 64),
])
def test_write_kv_matches_reference(gen, dtype, quantized, head_dim):
    from pdserve.kernels.kv_write import write_kv

    kv_heads, block_size, num_blocks, num_tokens = 2, 4, 6, 11
    cache = _pool(dtype, quantized, num_blocks, block_size, kv_heads, head_dim, gen)
    expected = _clone(cache)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    # Keys as a strided view of a fused qkv projection, as the model produces them.
    qkv = 2.0 * torch.randn(num_tokens, 3, kv_heads, head_dim, generator=gen).to(dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    write_kv(key, value, cache, slots)
    write_kv_torch(key, value, expected, slots)
    if quantized:  # integers: exact, poison (-128) untouched outside the slots
        assert torch.equal(cache.kv, expected.kv)
    else:
        assert torch.equal(cache.kv.isnan(), expected.kv.isnan())
        assert torch.equal(cache.kv.nan_to_num(), expected.kv.nan_to_num())


def test_int8_rounding_ties_and_clamp():
    """Ties round to even and out-of-range values clamp, exactly like quantize_int8."""
    from pdserve.kernels.kv_write import write_kv

    head_dim = 16
    scale = torch.full((1, head_dim), 0.5)
    # x / 0.5 lands on .5 ties (0.5, 1.5, 2.5, -0.5, -2.5), exact integers and out of range.
    row = torch.tensor([0.25, 0.75, 1.25, -0.25, -1.25, 3.0, 100.0, -100.0,
                        63.25, -63.75, 0.0, 0.2, 0.3, -0.2, 1e9, -1e9])
    key = row.view(1, 1, head_dim)
    kv = poison_(torch.empty(2, 1, 1, 1, head_dim, dtype=torch.int8))
    cache = KVCacheLayer(kv, scale, scale)
    write_kv(key, -key, cache, torch.tensor([0]))
    assert torch.equal(cache.kv[0, 0, 0], quantize_int8(key, scale)[0])
    assert torch.equal(cache.kv[1, 0, 0], quantize_int8(-key, scale)[0])


def test_negative_slot_is_skipped(gen):
    from pdserve.kernels.kv_write import write_kv

    cache = _pool(torch.float32, False, 2, 4, 1, 16, gen)
    key = torch.randn(2, 1, 16, generator=gen)
    write_kv(key, key, cache, torch.tensor([3, -1]))
    flat = cache.k.reshape(-1, 16)
    assert torch.equal(flat[3], key[0, 0])
    assert flat[torch.arange(8) != 3].isnan().all()


@pytest.mark.parametrize("field,bad", [
    ("key", lambda k, v, s: (k[:, :1], v, s)),
    ("value", lambda k, v, s: (k, v.double(), s)),
    ("slot_mapping", lambda k, v, s: (k, v, s[:1])),
    ("slot_mapping", lambda k, v, s: (k, v, s.float())),
])
def test_write_kv_rejects_bad_input(gen, field, bad):
    from pdserve.kernels.kv_write import write_kv

    cache = _pool(torch.float32, False, 2, 4, 2, 16, gen)
    key = torch.randn(3, 2, 16, generator=gen)
    k, v, slots = bad(key, key.clone(), torch.arange(3))
    with pytest.raises(ValueError, match=field):
        write_kv(k, v, cache, slots)


@pytest.mark.parametrize("dtype,dynamic,head_dim", [
    (torch.float32, "kv", 64), (torch.bfloat16, "v", 128), (torch.float16, "k", 64),
])
def test_write_kv_dynamic_token_scales_bit_exact(gen, dtype, dynamic, head_dim):
    """Per-token scales: int8 values and fp16 scales equal the reference bit for bit, the
    unwritten slots keep their poison, and dequantizing recovers x to half a step."""
    from pdserve.kernels.kv_write import write_kv

    kv_heads, block_size, num_blocks, num_tokens = 3, 4, 5, 9
    base = _pool(dtype, True, num_blocks, block_size, kv_heads, head_dim, gen)
    scales = [poison_(torch.empty(num_blocks, block_size, kv_heads, dtype=TOKEN_SCALE_DTYPE))
              if half in dynamic else None for half in "kv"]
    cache = KVCacheLayer(base.kv, base.k_scale, base.v_scale, *scales)
    expected = KVCacheLayer(cache.kv.clone(), cache.k_scale, cache.v_scale,
                            *[None if t is None else t.clone() for t in scales])
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    key = (3.0 * torch.randn(num_tokens, kv_heads, head_dim, generator=gen)).to(dtype)
    key[0, 0] = 0.0  # an all-zero row gets the smallest scale, not a division by zero
    value = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    write_kv(key, value, cache, slots)
    write_kv_torch(key, value, expected, slots)
    assert torch.equal(cache.kv, expected.kv)
    for got, want in zip(cache.token_scales, expected.token_scales, strict=True):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
        assert int(got.isnan().logical_not().sum()) == num_tokens * kv_heads
    if cache.k_token_scale is not None:  # nothing saturates: within half a step everywhere
        k_t = cache.k_token_scale.reshape(-1, kv_heads)[slots]
        back = dequantize(cache.k.reshape(-1, kv_heads, head_dim)[slots], cache.k_scale,
                          torch.float32, k_t)
        step = cache.k_scale * k_t.float()[..., None]
        assert bool(((back - key.float()).abs() <= step * 0.501 + 1e-6).all())


def test_a_token_scale_never_overflows_to_inf(gen):
    """A value far beyond what its channel scale foresaw (a channel calibrated at ~0) would
    need a token scale past float16's range: it saturates at the largest finite scale instead
    of becoming inf (whose product with a 0 would be NaN), in the kernel and the reference."""
    from pdserve.kernels.kv_layout import MAX_TOKEN_SCALE
    from pdserve.kernels.kv_write import write_kv

    kv_heads, head_dim, block_size, num_blocks = 2, 16, 4, 2
    kv = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=torch.int8)
    tiny = torch.full((kv_heads, head_dim), 1e-8)
    caches = [KVCacheLayer(kv.clone(), tiny, tiny,
                           *(torch.zeros(num_blocks, block_size, kv_heads,
                                         dtype=TOKEN_SCALE_DTYPE) for _ in "kv"))
              for _ in range(2)]
    key = torch.randn(3, kv_heads, head_dim, generator=gen)  # / 1e-8: ~1e8, scale ~1e6
    slots = torch.tensor([0, 5, 6])
    write_kv(key, key.clone(), caches[0], slots)
    write_kv_torch(key, key.clone(), caches[1], slots)
    for cache in caches:
        for scales in cache.token_scales:
            assert bool(torch.isfinite(scales.float()).all())
            assert float(scales.float().max()) == MAX_TOKEN_SCALE
        back = dequantize(cache.k.reshape(-1, kv_heads, head_dim)[slots], cache.k_scale,
                          torch.float32, cache.k_token_scale.reshape(-1, kv_heads)[slots])
        assert bool(torch.isfinite(back).all())
    assert torch.equal(caches[0].kv, caches[1].kv)
