"""Triton block pack/unpack against pack_blocks_torch / unpack_blocks_torch."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.kv_layout import KVCacheLayer
from pdserve.kernels.torch_ops import pack_blocks_torch, unpack_blocks_torch
from pdserve.testing.paged_batches import poison_, random_scales

pytestmark = pytest.mark.triton


def _layers(gen, dtype, num_layers=3, num_blocks=7, shape=(4, 2, 64)):
    caches = []
    for _ in range(num_layers):
        if dtype == torch.int8:
            kv = torch.randint(-127, 128, (2, num_blocks, *shape), generator=gen,
                               dtype=torch.int8)
            caches.append(KVCacheLayer(kv, random_scales(shape[1], shape[2], gen),
                                       random_scales(shape[1], shape[2], gen)))
        else:
            caches.append(KVCacheLayer(torch.randn(2, num_blocks, *shape, generator=gen)
                                       .to(dtype)))
    return caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_pack_then_unpack_into_other_blocks(gen, dtype):
    from pdserve.kernels.block_copy import pack_blocks, unpack_blocks

    src = _layers(gen, dtype)
    ids = torch.randperm(7, generator=gen)[:4]
    buffer = pack_blocks(src, ids)
    assert torch.equal(buffer, pack_blocks_torch(src, ids))

    dst = _layers(gen, dtype)
    for cache in dst:
        poison_(cache.kv)
    expected = [KVCacheLayer(c.kv.clone(), c.k_scale, c.v_scale) for c in dst]
    other_ids = torch.randperm(7, generator=gen)[:4]
    unpack_blocks(buffer, dst, other_ids)
    unpack_blocks_torch(buffer, expected, other_ids)
    for got, want in zip(dst, expected, strict=True):
        assert torch.equal(got.kv.view(torch.uint8 if dtype == torch.int8 else torch.int16
                                       if dtype == torch.bfloat16 else torch.int32),
                           want.kv.view(torch.uint8 if dtype == torch.int8 else torch.int16
                                        if dtype == torch.bfloat16 else torch.int32))
    assert torch.equal(pack_blocks(dst, other_ids), buffer)


def test_block_larger_than_one_program_chunk(gen):
    """head_dim 128 x 8 heads x 4 slots = 4096 elements: several 1024-element chunks."""
    from pdserve.kernels.block_copy import pack_blocks

    src = _layers(gen, torch.float32, num_layers=1, num_blocks=3, shape=(4, 8, 128))
    ids = torch.tensor([2, 0], dtype=torch.int32)
    assert torch.equal(pack_blocks(src, ids), pack_blocks_torch(src, ids.long()))


def test_block_copy_rejects_bad_input(gen):
    from pdserve.kernels.block_copy import pack_blocks, unpack_blocks

    src = _layers(gen, torch.float32)
    ids = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="block_ids"):
        pack_blocks(src, ids.float())
    with pytest.raises(ValueError, match="caches"):
        pack_blocks([], ids)
    with pytest.raises(ValueError, match=r"caches\[1\]"):
        pack_blocks([src[0], _layers(gen, torch.bfloat16, 1)[0]], ids)
    with pytest.raises(ValueError, match="buffer"):
        unpack_blocks(torch.zeros(3, 2, 3, 4, 2, 64), src, ids)
