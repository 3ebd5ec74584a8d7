"""The torch references (the CPU serving path and the Triton oracle) against naive
per-sequence, per-token loops built on dense scaled_dot_product_attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import torch_attention
from pdserve.kernels import torch_ops as ref
from pdserve.kernels.kv_layout import KVCacheLayer
from pdserve.testing.paged_batches import TOLERANCE, random_paged_batch, relative_error


def _naive_context(cache: KVCacheLayer, table: torch.Tensor, ctx: int):
    """One sequence's dequantised K and V, token by token: (ctx, kv_heads, head_dim) fp32."""
    bs = cache.block_size
    rows = [cache.kv[:, int(table[p // bs]), p % bs] for p in range(ctx)]  # (2, kvh, hd) each
    kv = torch.stack(rows, dim=1).float()  # (2, ctx, kv_heads, head_dim)
    if cache.is_quantized:
        return kv[0] * cache.k_scale, kv[1] * cache.v_scale
    return kv[0], kv[1]


def _naive_attention(query, cache, cu_seqlens_q, context_lens, block_tables, scale, window):
    num_heads = query.shape[1]
    outs = []
    for s in range(context_lens.shape[0]):
        q = query[int(cu_seqlens_q[s]):int(cu_seqlens_q[s + 1])].float()  # (q_len, H, hd)
        ctx, q_len = int(context_lens[s]), q.shape[0]
        k, v = _naive_context(cache, block_tables[s], ctx)
        group = num_heads // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (ctx, H, hd)
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), attn_mask=mask, scale=scale)
        outs.append(out.transpose(0, 1))  # (q_len, H, hd)
    return torch.cat(outs).to(query.dtype)


@pytest.fixture(params=["grouped when it pays", "always grouped"])
def split_cost(request, monkeypatch) -> int:
    """The padded work a group must save: the default, or 0 (every length group alone)."""
    if request.param == "always grouped":
        monkeypatch.setattr(torch_attention, "SPLIT_COST", 0)
    return torch_attention.SPLIT_COST


def _groups(batch) -> list[list[int]]:
    lens = batch.context_lens.tolist()
    return torch_attention.length_groups(lens, [1] * len(lens), 64)


@pytest.mark.parametrize("dtype,quantized,group,window", [
    (torch.float32, False, 1, None), (torch.float32, True, 4, 6),
    (torch.bfloat16, False, 8, None), (torch.float32, False, 4, 1),
])
def test_paged_attention_ref_matches_naive(gen, dtype, quantized, group, window, split_cost):
    # A fresh prompt, a chunk after a cached prefix, decodes (the split path), an empty one.
    batch = random_paged_batch([23, 30, 1, 17, 9], [23, 11, 1, 1, 0], group * 2 if group < 8
                               else 8, 2 if group < 8 else 1, 64, 4, dtype, gen,
                               quantized=quantized)
    args = (batch.query, batch.cache, batch.cu_seqlens_q, batch.context_lens,
            batch.block_tables, 0.125, window)
    out, want = torch_attention.paged_attention_torch(*args), _naive_attention(*args)
    assert torch.isfinite(out).all()  # slots past each context are NaN and must not leak
    assert relative_error(out, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("context_len,q_len,window", [(45, 45, None), (45, 45, 9), (60, 13, None)])
def test_one_sequence_alone_matches_naive(gen, context_len, q_len, window):
    """One prompt (whole, or a chunk after its cached prefix) takes no padding."""
    batch = random_paged_batch([context_len], [q_len], 6, 2, 32, 8, torch.float32, gen)
    args = (batch.query, batch.cache, batch.cu_seqlens_q, batch.context_lens,
            batch.block_tables, 0.2, window)
    out, want = torch_attention.paged_attention_torch(*args), _naive_attention(*args)
    assert out.shape == want.shape
    assert relative_error(out, want) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("window,chunk", [(None, 32), (7, 32), (None, 5)])
def test_prompts_of_spread_lengths_match_naive(gen, window, chunk, split_cost, monkeypatch):
    """Whole prompts of 2 to 70 tokens fall in several length groups, each padded alone
    (without a window they take the causal path, ``chunk`` queries at a time), beside a chunk
    after a cached prefix and two decodes (with chunks of 5, masks made per call)."""
    monkeypatch.setattr(torch_attention, "CAUSAL_CHUNK", chunk)
    if chunk == 5:
        monkeypatch.setattr(torch_attention, "CACHED_MASKS_MAX_Q", 0)
    batch = random_paged_batch([70, 2, 33, 9, 41, 5, 64, 17, 1, 30],
                               [70, 2, 33, 9, 41, 5, 20, 17, 1, 1], 4, 2, 32, 8,
                               torch.float32, gen)
    assert split_cost or len(_groups(batch)) == 4
    args = (batch.query, batch.cache, batch.cu_seqlens_q, batch.context_lens,
            batch.block_tables, 0.2, window)
    out, want = torch_attention.paged_attention_torch(*args), _naive_attention(*args)
    assert torch.isfinite(out).all()
    assert relative_error(out, want) < TOLERANCE[torch.float32]


def test_length_groups_bound_the_padding_when_that_pays():
    lengths = [1000, 100, 600, 490, 500, 30]
    groups = torch_attention.length_groups(lengths, [1] * 6, 4096)
    assert groups == [[0, 2, 4], [3], [1], [5]]  # each at least half its longest
    assert torch_attention.length_groups([8, 8, 5], [1] * 3, 4096) == [[0, 1, 2]]
    # splitting saves 400 padded keys: worth it at 4096 wide heads, not at 64
    assert torch_attention.length_groups([500, 100], [1, 1], 4096) == [[0], [1]]
    assert torch_attention.length_groups([500, 100], [1, 1], 64) == [[0, 1]]


@pytest.mark.parametrize("window", [None, 5])
def test_decode_ref_matches_naive(gen, window, split_cost):
    """Contexts of 1 to 37 tokens: padded to the longest, or each length group alone."""
    batch = random_paged_batch([1, 5, 37, 16, 33, 2], [1] * 6, 8, 2, 128, 16, torch.float32,
                               gen)
    assert split_cost or len(_groups(batch)) == 4
    out = torch_attention.paged_decode_attention_torch(batch.query, batch.cache, batch.block_tables,
                                                   batch.context_lens, 0.1, window)
    want = _naive_attention(batch.query, batch.cache, batch.cu_seqlens_q, batch.context_lens,
                            batch.block_tables, 0.1, window)
    assert relative_error(out, want) < TOLERANCE[torch.float32]


def test_fresh_prompt_matches_causal_sdpa(gen):
    batch = random_paged_batch([19], [19], 4, 4, 64, 8, torch.float32, gen)
    out = torch_attention.paged_attention_torch(batch.query, batch.cache, batch.cu_seqlens_q,
                                            batch.context_lens, batch.block_tables, 0.125)
    k, v = _naive_context(batch.cache, batch.block_tables[0], 19)
    want = F.scaled_dot_product_attention(batch.query.transpose(0, 1), k.transpose(0, 1),
                                          v.transpose(0, 1), is_causal=True, scale=0.125)
    assert relative_error(out, want.transpose(0, 1)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("quantized", [False, True])
def test_write_kv_ref_matches_per_token_loop(gen, quantized):
    batch = random_paged_batch([6, 9], [6, 9], 2, 2, 64, 4, torch.float32, gen,
                               quantized=quantized)
    key = torch.randn(15, 2, 64, generator=gen)
    value = torch.randn(15, 2, 64, generator=gen)
    expected = batch.cache.kv.clone()
    for i, slot in enumerate(batch.slot_mapping.tolist()):
        b, o = divmod(slot, batch.cache.block_size)
        for which, x, scale in ((0, key, batch.cache.k_scale), (1, value, batch.cache.v_scale)):
            expected[which, b, o] = ref.quantize_int8(x[i], scale) if quantized else x[i]
    ref.write_kv_torch(key, value, batch.cache, batch.slot_mapping)
    assert torch.equal(batch.cache.kv.nan_to_num(), expected.nan_to_num())


def test_quantize_int8_rounds_half_to_even_and_clamps():
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, 200.0, -200.0, 0.49]])
    got = ref.quantize_int8(x, torch.ones_like(x))
    assert got.tolist() == [[0, 2, 2, 0, -2, 127, -127, 0]]


def test_pack_unpack_ref_match_loops(gen):
    caches = [KVCacheLayer(torch.randn(2, 5, 4, 2, 8, generator=gen)) for _ in range(3)]
    ids = torch.tensor([3, 0, 4])
    buffer = ref.pack_blocks_torch(caches, ids)
    for layer, cache in enumerate(caches):
        for j, b in enumerate(ids.tolist()):
            assert torch.equal(buffer[layer, :, j], cache.kv[:, b])
    dst = [KVCacheLayer(torch.zeros(2, 5, 4, 2, 8)) for _ in range(3)]
    ref.unpack_blocks_torch(buffer, dst, torch.tensor([1, 2, 0]))
    for layer in range(3):
        for j, b in enumerate([1, 2, 0]):
            assert torch.equal(dst[layer].kv[:, b], buffer[layer, :, j])
        assert (dst[layer].kv[:, 3:] == 0).all()


def test_rms_norm_ref_formula(gen):
    x = torch.randn(3, 16, generator=gen)
    w = torch.randn(16, generator=gen)
    r = torch.randn(3, 16, generator=gen)
    out, resid = ref.rms_norm_torch(x, w, 1e-5, r)
    h = x + r
    want = w * h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(resid, h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [16, 64, 896, 4096])
def test_rms_norm_ref_is_hugging_faces_formula_to_the_bit(gen, size, dtype):
    """fp32 takes torch's fused ``rms_norm``; other dtypes round the normalised row first."""
    x = (torch.randn(7, size, generator=gen) * 3).to(dtype)
    w = torch.randn(size, generator=gen).to(dtype)
    h = x.float()
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(ref.rms_norm_torch(x, w, 1e-6), want)
    r = torch.randn(7, size, generator=gen).to(dtype)
    out, resid = ref.rms_norm_torch(x, w, 1e-6, r)
    assert torch.equal(resid, x + r) and torch.equal(out, ref.rms_norm_torch(x + r, w, 1e-6))


def test_rotary_ref_is_a_complex_rotation(gen):
    """Rotate-half RoPE is multiplication of (x1 + i x2) by e^{i theta}."""
    q, k = torch.randn(4, 2, 8, generator=gen), torch.randn(4, 1, 8, generator=gen)
    theta = torch.rand(10, 4, generator=gen) * 6
    cache = torch.cat([theta.cos(), theta.sin()], -1)
    pos = torch.tensor([0, 9, 3, 3])
    rq, rk = ref.rotary_torch(q, k, pos, cache)
    for x, rx in ((q, rq), (k, rk)):
        z = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones(4, 1, 4),
                                                                theta[pos][:, None])
        torch.testing.assert_close(rx, torch.cat([z.real, z.imag], -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_ref_is_the_two_term_formula_to_the_bit(gen, dtype):
    """``x * cos + (-x2, x1) * sin`` (one table per forward) equals Hugging Face's
    ``(x1 cos - x2 sin, x2 cos + x1 sin)`` exactly, with the table or without."""
    q, k = (torch.randn(5, h, 8, generator=gen).to(dtype) for h in (4, 2))
    theta = torch.rand(12, 4, generator=gen) * 6
    cache = torch.cat([theta.cos(), theta.sin()], -1)
    pos = torch.tensor([0, 11, 3, 3, 7])
    table = ref.rope_table_torch(pos, cache)
    cos, sin = cache[pos].chunk(2, -1)
    cos, sin = cos[:, None], sin[:, None]
    for x, with_table, without in zip((q, k), ref.rotary_torch(q, k, pos, cache, table),
                                      ref.rotary_torch(q, k, pos, cache), strict=True):
        x1, x2 = x.float().chunk(2, -1)
        want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(dtype)
        assert torch.equal(with_table, want) and torch.equal(without, want)


def test_silu_and_mul_ref_formula(gen):
    x = torch.randn(3, 10, generator=gen)
    torch.testing.assert_close(ref.silu_and_mul_torch(x), x[:, :5] * torch.sigmoid(x[:, :5])
                               * x[:, 5:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_packed_ref_is_rotary_ref_to_the_bit(gen, dtype):
    """q and k rotated as one packed tensor (the model's fused qkv) equal them rotated apart."""
    qkv = torch.randn(5, 4 + 2 * 2, 8, generator=gen).to(dtype)
    qk, q, k = qkv[:, :6], qkv[:, :4], qkv[:, 4:6]  # strided views, as the model has them
    theta = torch.rand(12, 4, generator=gen) * 6
    cache = torch.cat([theta.cos(), theta.sin()], -1)
    pos = torch.tensor([0, 11, 3, 3, 7])
    table = ref.rope_table_torch(pos, cache)
    want_q, want_k = ref.rotary_torch(q, k, pos, cache, table)
    got_q, got_k = ref.rotary_packed_torch(qk, 4, pos, cache, table)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)

