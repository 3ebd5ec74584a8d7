"""A whole prompt attends from its own q, k and v (``kernels.prompt_attention``), not from its
K/V read back out of the paged pool, where the pool holds them as they are."""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.models.attention import Attention, AttentionMetadata
from pdserve.testing.paged_batches import TOLERANCE, random_paged_batch, relative_error

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 64, 4
BACKENDS = ["torch", pytest.param("native", marks=pytest.mark.skipif(
    not kernels.cpu_decode_attention.available(), reason="no C compiler"))]


def _prompt(gen: torch.Generator, n: int, quantized: bool = False):
    """A prompt of n tokens: its queries, its fresh K and V, a pool holding them (written
    as the engine writes) and the step's metadata."""
    batch = random_paged_batch([n], [n], HEADS, KV_HEADS, HEAD_DIM, BLOCK, torch.float32, gen,
                               quantized=quantized)
    k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    meta = AttentionMetadata(
        slot_mapping=batch.slot_mapping, cu_seqlens_q=batch.cu_seqlens_q,
        context_lens=batch.context_lens, block_tables=batch.block_tables, max_query_len=n,
        max_context_len=n)
    return batch, k, v, meta


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_attention_equals_the_paged_path(gen, backend):
    batch, k, v, meta = _prompt(gen, 37)
    kernels.write_kv(k, v, batch.cache, batch.slot_mapping)
    want = kernels.paged_attention(batch.query, batch.cache, batch.cu_seqlens_q,
                                   batch.context_lens, batch.block_tables, 0.125,
                                   backend=backend)
    got = kernels.prompt_attention(batch.query, k, v, 0.125, backend=backend)
    assert got.shape == want.shape
    assert relative_error(got, want) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("window, quantized, from_pool", [
    (None, False, False),  # float pool: k and v as stored, no read-back
    (8, False, True),  # a window: the paged path's mask
    (None, True, True),  # int8 pool: the prompt attends over what the pool keeps
])
def test_attention_reads_the_pool_back_only_where_it_must(gen, monkeypatch, window, quantized,
                                                          from_pool):
    batch, k, v, meta = _prompt(gen, 21, quantized)
    paged = kernels.paged_attention
    calls = []
    monkeypatch.setattr(kernels, "paged_attention",
                        lambda *args, **kw: calls.append(1) or paged(*args, **kw))
    layer = Attention(HEADS, KV_HEADS, HEAD_DIM, 0.125, sliding_window=window)
    got = layer.forward(batch.query, k, v, batch.cache, meta)
    assert calls == ([1] if from_pool else [])
    want = paged(batch.query, batch.cache, batch.cu_seqlens_q, batch.context_lens,
                 batch.block_tables, 0.125, window)
    assert relative_error(got, want) < TOLERANCE[torch.float32]


@pytest.mark.skipif(not kernels.cpu_decode_attention.available(), reason="no C compiler")
@pytest.mark.parametrize("n", [1, 37, 300])
def test_a_bf16_prompt_on_the_native_path_matches_float32_to_bf16_rounding(gen, n):
    """bf16 prompts take a bf16 attention kernel (the C one on AMX where the CPU has it, else
    torch's; not the C float32 one on copies): the float32 result rounded to bf16, within
    bf16's error, grouped heads included."""
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    want = kernels.prompt_attention(q, k, v, 0.125, backend="torch")
    got = kernels.prompt_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.125,
                                   backend="native")
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert relative_error(got.float(), want) < TOLERANCE[torch.bfloat16]
    # causal: a later key changes no earlier query's output
    k2, v2 = k.clone(), v.clone()
    k2[-1], v2[-1] = 100.0, 100.0
    again = kernels.prompt_attention(q.bfloat16(), k2.bfloat16(), v2.bfloat16(), 0.125,
                                     backend="native")
    assert torch.equal(again[:-1], got[:-1])


def _step(gen, context_lens, q_lens, dtype, backend):
    """A step's batch of sequences (``q_lens`` new tokens each after ``context_lens`` minus
    them in the pool), the K/V of its new tokens and its metadata."""
    batch = random_paged_batch(context_lens, q_lens, HEADS, KV_HEADS, HEAD_DIM, BLOCK, dtype,
                               gen)
    k, v = (torch.randn(sum(q_lens), KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
            for _ in range(2))
    meta = AttentionMetadata(
        slot_mapping=batch.slot_mapping, cu_seqlens_q=batch.cu_seqlens_q,
        context_lens=batch.context_lens, block_tables=batch.block_tables,
        max_query_len=max(q_lens), max_context_len=max(context_lens), backend=backend)
    return batch, k, v, meta


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_lens, q_lens, prompts, rest", [
    # whole prompts only: each attends from its own K/V, nothing is read back
    ([5, 17, 9], [5, 17, 9], [(0, 5), (5, 22), (22, 31)], None),
    # a decode, a whole prompt, a prompt after a cached prefix, a whole prompt: the decode and
    # the prefixed prompt's rows (0; 18-25) attend over the pool, as a batch of their own
    ([13, 17, 17, 5], [1, 17, 8, 5], [(1, 18), (26, 31)], [0, *range(18, 26)]),
    # decodes around a whole prompt: the rest is decode only
    ([30, 6, 3], [1, 6, 1], [(1, 7)], [0, 7]),
])
def test_whole_prompts_attend_from_their_own_k_and_v_the_rest_over_the_pool(
        gen, monkeypatch, backend, dtype, context_lens, q_lens, prompts, rest):
    batch, k, v, meta = _step(gen, context_lens, q_lens, dtype, backend)
    split = meta.whole_prompts
    assert split.bounds == prompts
    assert (split.rest_rows is None if rest is None else split.rest_rows.tolist() == rest)
    paged, decode = kernels.paged_attention, kernels.paged_decode_attention
    calls = []
    monkeypatch.setattr(kernels, "paged_attention",
                        lambda q, *args, **kw: calls.append(len(q)) or paged(q, *args, **kw))
    monkeypatch.setattr(kernels, "paged_decode_attention",
                        lambda q, *args, **kw: calls.append(len(q)) or decode(q, *args, **kw))
    layer = Attention(HEADS, KV_HEADS, HEAD_DIM, 0.125)
    got = layer.forward(batch.query, k, v, batch.cache, meta)
    assert calls == ([] if rest is None else [len(rest)])
    want = paged(batch.query, batch.cache, batch.cu_seqlens_q, batch.context_lens,
                 batch.block_tables, 0.125, backend=backend)
    assert got.shape == want.shape and got.dtype == dtype
    assert relative_error(got, want) < TOLERANCE[dtype]


def test_a_step_without_a_whole_prompt_has_none(gen):
    # decodes and a prompt after a cached prefix: every row reads the pool
    _, _, _, meta = _step(gen, [13, 17], [1, 8], torch.float32, "auto")
    assert meta.whole_prompts is None
    _, _, _, meta = _step(gen, [9], [4], torch.float32, "auto")
    assert meta.whole_prompts is None
