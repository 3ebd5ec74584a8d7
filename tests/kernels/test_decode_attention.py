"""Triton paged decode attention against paged_decode_attention_torch on random paged batches.

Pools are shuffled and every slot outside a context is poison (NaN, or -128 for int8), and the
output allocation is poisoned too, so a read past a context or an unwritten row fails.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.torch_attention import paged_decode_attention_torch
from pdserve.testing.paged_batches import TOLERANCE, random_paged_batch, relative_error

pytestmark = pytest.mark.triton


def _lens(gen, n, high, must=()):
    extra = torch.randint(2, high + 1, (n - len(must),), generator=gen).tolist()
    return list(must) + extra


def _check(batch, scale, window, num_splits=None):
    from pdserve.kernels.decode_attention import decode_attention

    out = decode_attention(batch.query, batch.cache, batch.block_tables, batch.context_lens,
                           scale, window, max_context_len=batch.max_context_len,
                           num_splits=num_splits)
    ref = paged_decode_attention_torch(batch.query, batch.cache, batch.block_tables,
                                       batch.context_lens, scale, window)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "unwritten or poisoned output"
    err = relative_error(out, ref)
    assert err < TOLERANCE[out.dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype,group,head_dim,quantized,window,num_splits,block_size", [
    (torch.float32, 1, 64, False, None, None, 16),
    (torch.bfloat16, 4, 128, False, None, 3, 4),
    (torch.float32, 8, 64, True, None, 4, 16),
    (torch.bfloat16, 1, 64, True, 7, 2, 4),
    (torch.float32, 4, 128, False, 16, 3, 16),
    (torch.float16, 4, 64, False, None, None, 8),
    (torch.bfloat16, 8, 128, True, None, None, 16),
    (torch.float32, 4, 64, False, 33, 2, 8),
])
def test_decode_matches_reference(gen, dtype, group, head_dim, quantized, window, num_splits,
                                  block_size):
    kv_heads = 1 if group == 8 else 2
    must = [1, block_size + 1] if window is None else [1, window, window + 1]
    context_lens = _lens(gen, 4, 70, must)
    batch = random_paged_batch(context_lens, [1] * len(context_lens), group * kv_heads,
                               kv_heads, head_dim, block_size, dtype, gen, quantized=quantized)
    _check(batch, head_dim ** -0.5, window, num_splits)


def test_split_k_with_empty_splits(gen):
    """Five splits over the longest context; the one-token sequence leaves four empty."""
    batch = random_paged_batch([1, 80, 47], [1, 1, 1], 4, 2, 64, 16, torch.float32, gen)
    _check(batch, 0.125, None, num_splits=5)


def test_window_larger_than_context_and_window_one(gen):
    batch = random_paged_batch([5, 40], [1, 1], 2, 2, 64, 4, torch.float32, gen)
    _check(batch, 0.125, 64)
    _check(batch, 0.125, 1, num_splits=2)


def test_split_heuristic_grows_with_length_and_fills_the_device():
    from pdserve.kernels.decode_attention import MAX_SPLITS, choose_num_splits

    cpu = torch.device("cpu")
    assert choose_num_splits(1, 1, 100, cpu) == 1  # too short to split
    long = choose_num_splits(1, 1, 1 << 20, cpu)
    assert 1 < long <= MAX_SPLITS
    assert choose_num_splits(256, 8, 1 << 20, cpu) == 1  # the batch already fills the device


def _inputs(gen):
    batch = random_paged_batch([9, 3], [1, 1], 4, 2, 64, 4, torch.float32, gen)
    return dict(query=batch.query, cache=batch.cache, block_tables=batch.block_tables,
                context_lens=batch.context_lens, scale=0.1, sliding_window=None)


@pytest.mark.parametrize("field,change", [
    ("query", lambda a: a.update(query=a["query"][:, :3])),
    ("query", lambda a: a.update(query=a["query"].double())),
    ("block_tables", lambda a: a.update(block_tables=a["block_tables"][:1])),
    ("context_lens", lambda a: a.update(context_lens=a["context_lens"].float())),
    ("sliding_window", lambda a: a.update(sliding_window=0)),
    ("max_context_len", lambda a: a.update(max_context_len=10_000)),
])
def test_decode_rejects_bad_input(gen, field, change):
    from pdserve.kernels.decode_attention import decode_attention

    args = _inputs(gen)
    change(args)
    with pytest.raises(ValueError, match=field):
        decode_attention(**args)


@pytest.mark.parametrize("trial", range(4))
def test_decode_random_configuration(gen, trial):
    """A configuration drawn fresh each run: dtype, GQA ratio, head_dim (incl. not a power of
    2), block size, window, int8, splits, and whether max_context_len is given."""
    from pdserve.kernels.decode_attention import decode_attention

    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]
    dtype = pick([torch.float32, torch.bfloat16, torch.float16])
    group, head_dim = pick([1, 2, 4, 8]), pick([64, 128, 80])
    kv_heads, block_size = pick([1, 2]), pick([1, 4, 8, 16])
    window, num_splits = pick([None, None, 1, 3, 16, 40]), pick([None, 1, 2, 3, 7])
    quantized = bool(pick([False, True]))
    context_lens = _lens(gen, 3, 90, [1])
    print(dict(dtype=dtype, group=group, head_dim=head_dim, kv_heads=kv_heads, window=window,
               block_size=block_size, splits=num_splits, int8=quantized, ctx=context_lens))
    batch = random_paged_batch(context_lens, [1] * 3, group * kv_heads, kv_heads, head_dim,
                               block_size, dtype, gen, quantized=quantized)
    args = (batch.query, batch.cache, batch.block_tables, batch.context_lens, 0.1, window)
    out = decode_attention(*args, max_context_len=pick([None, batch.max_context_len]),
                           num_splits=num_splits)
    ref = paged_decode_attention_torch(*args)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype,dynamic,window,num_splits", [
    (torch.float32, "kv", None, 3), (torch.bfloat16, "v", 7, 2), (torch.float32, "k", None, None),
])
def test_decode_with_dynamic_token_scales(gen, dtype, dynamic, window, num_splits):
    """int8 pools whose K and/or V carry per-token scales (poisoned where unwritten)."""
    context_lens = _lens(gen, 4, 70, [1, 17])
    batch = random_paged_batch(context_lens, [1] * 4, 8, 2, 64, 8, dtype, gen, quantized=True,
                               dynamic=dynamic)
    _check(batch, 0.125, window, num_splits)
