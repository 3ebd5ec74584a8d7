"""Triton paged prefill attention against paged_attention_torch on packed variable-length batches:
fresh prompts, chunks whose earlier tokens are already cached (chunked prefill, prefix-cache
hits), one-token decodes mixed in, sliding windows, int8 pools; poisoned pools and outputs."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.torch_attention import paged_attention_torch
from pdserve.testing.paged_batches import TOLERANCE, random_paged_batch, relative_error

pytestmark = pytest.mark.triton


def _run(batch, scale, window):
    from pdserve.kernels.prefill_attention import prefill_attention

    return prefill_attention(batch.query, batch.cache, batch.cu_seqlens_q, batch.context_lens,
                             batch.block_tables, scale, window,
                             max_query_len=batch.max_query_len)


def _check(batch, scale, window):
    out = _run(batch, scale, window)
    ref = paged_attention_torch(batch.query, batch.cache, batch.cu_seqlens_q, batch.context_lens,
                                batch.block_tables, scale, window)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "unwritten or poisoned output"
    err = relative_error(out, ref)
    assert err < TOLERANCE[out.dtype], f"relative error {err:.2e}"


def _random_lens(gen, block_size):
    """A fresh prompt, a chunk after a cached prefix, a one-token decode, and one random."""
    ctx = torch.randint(block_size + 1, 45, (4,), generator=gen).tolist()
    ctx[1] = max(ctx[1], 20)
    q = [ctx[0], int(torch.randint(2, ctx[1], (1,), generator=gen)), 1,
         int(torch.randint(1, ctx[3] + 1, (1,), generator=gen))]
    return ctx, q


@pytest.mark.parametrize("dtype,group,head_dim,quantized,window,block_size", [
    (torch.float32, 1, 64, False, None, 16),
    (torch.bfloat16, 4, 128, False, None, 4),
    (torch.float32, 8, 64, True, None, 8),
    (torch.bfloat16, 1, 64, True, 5, 4),
    (torch.float32, 4, 128, False, 16, 16),
    (torch.float16, 4, 64, False, 17, 8),
    (torch.float32, 1, 64, False, 1, 4),
])
def test_prefill_matches_reference(gen, dtype, group, head_dim, quantized, window, block_size):
    kv_heads = 1 if group >= 4 else 2
    context_lens, q_lens = _random_lens(gen, block_size)
    batch = random_paged_batch(context_lens, q_lens, group * kv_heads, kv_heads, head_dim,
                               block_size, dtype, gen, quantized=quantized)
    _check(batch, head_dim ** -0.5, window)


def test_single_token_prompt_and_exact_tile_edges(gen):
    """A one-token prompt; queries and contexts on and next to the 16-wide tile edges."""
    batch = random_paged_batch([1, 16, 33, 32], [1, 16, 17, 15], 2, 2, 64, 16,
                               torch.float32, gen)
    _check(batch, 0.125, None)
    _check(batch, 0.125, 16)


def test_chunked_prefill_equals_whole_prompt(gen):
    """Running a prompt in two chunks gives the rows the whole-prompt call gives."""
    whole = random_paged_batch([37], [37], 4, 2, 64, 8, torch.float32, gen)
    full = _run(whole, 0.125, 9)
    second = dict(vars(whole))
    second.update(query=whole.query[20:], cu_seqlens_q=torch.tensor([0, 17], dtype=torch.int32),
                  max_query_len=17)
    first = dict(vars(whole))
    first.update(query=whole.query[:20], cu_seqlens_q=torch.tensor([0, 20], dtype=torch.int32),
                 context_lens=torch.tensor([20], dtype=torch.int32), max_query_len=20)
    chunks = torch.cat([_run(type(whole)(**first), 0.125, 9),
                        _run(type(whole)(**second), 0.125, 9)])
    torch.testing.assert_close(chunks, full, rtol=1e-5, atol=1e-6)


def test_sequence_without_queries_is_skipped(gen):
    batch = random_paged_batch([12, 9, 30], [3, 0, 30], 2, 1, 64, 4, torch.float32, gen)
    _check(batch, 0.125, None)


def _inputs(gen):
    batch = random_paged_batch([9, 3], [2, 3], 4, 2, 64, 4, torch.float32, gen)
    return dict(query=batch.query, cache=batch.cache, cu_seqlens_q=batch.cu_seqlens_q,
                context_lens=batch.context_lens, block_tables=batch.block_tables, scale=0.1)


@pytest.mark.parametrize("field,change", [
    ("query", lambda a: a.update(query=a["query"][:, :, :32])),
    ("query", lambda a: a.update(query=a["query"][:, :3])),
    ("cu_seqlens_q", lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][:2])),
    ("block_tables", lambda a: a.update(block_tables=a["block_tables"].float())),
    ("cache", lambda a: a.update(query=a["query"].half())),
])
def test_prefill_rejects_bad_input(gen, field, change):
    from pdserve.kernels.prefill_attention import prefill_attention

    args = _inputs(gen)
    change(args)
    with pytest.raises(ValueError, match=field):
        prefill_attention(**args)


@pytest.mark.parametrize("trial", range(4))
def test_prefill_random_configuration(gen, trial):
    """A configuration drawn fresh each run: dtype, GQA ratio, head_dim (incl. not a power of
    2), block size, window, int8, query/context lengths, whether max_query_len is given."""
    from pdserve.kernels.prefill_attention import prefill_attention

    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]
    dtype = pick([torch.float32, torch.bfloat16, torch.float16])
    group, head_dim = pick([1, 2, 4, 8]), pick([64, 128, 96])
    kv_heads, block_size = pick([1, 2]), pick([1, 4, 8, 16])
    window, quantized = pick([None, None, 1, 3, 16, 21]), bool(pick([False, True]))
    context_lens = torch.randint(1, 50, (3,), generator=gen).tolist()
    q_lens = [int(torch.randint(1, c + 1, (1,), generator=gen)) for c in context_lens]
    print(dict(dtype=dtype, group=group, head_dim=head_dim, kv_heads=kv_heads, window=window,
               block_size=block_size, int8=quantized, ctx=context_lens, q=q_lens))
    batch = random_paged_batch(context_lens, q_lens, group * kv_heads, kv_heads, head_dim,
                               block_size, dtype, gen, quantized=quantized)
    args = (batch.query, batch.cache, batch.cu_seqlens_q, batch.context_lens,
            batch.block_tables, 0.1, window)
    out = prefill_attention(*args, max_query_len=pick([None, batch.max_query_len]))
    ref = paged_attention_torch(*args)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype,dynamic,window", [
    (torch.float32, "kv", None), (torch.bfloat16, "v", 5), (torch.float32, "k", 16),
])
def test_prefill_with_dynamic_token_scales(gen, dtype, dynamic, window):
    """int8 pools whose K and/or V carry per-token scales (poisoned where unwritten)."""
    context_lens, q_lens = _random_lens(gen, 8)
    batch = random_paged_batch(context_lens, q_lens, 4, 2, 64, 8, dtype, gen, quantized=True,
                               dynamic=dynamic)
    _check(batch, 0.125, window)
