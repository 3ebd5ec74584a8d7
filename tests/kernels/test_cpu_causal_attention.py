"""The C causal attention of prompts (whole, or a chunk after a cached prefix) against its
reference, _causal_sdpa_in_chunks (torch's SDPA), and both against plain torch arithmetic,
on random inputs; and the routing that sends it what it takes."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_causal_attention, dispatch
from pdserve.kernels.torch_attention import _causal_sdpa_in_chunks
from pdserve.testing.paged_batches import TOLERANCE, random_paged_batch, relative_error

pytestmark = pytest.mark.skipif(not cpu_causal_attention.available(),
                                reason="no working C compiler on this machine")


def _inputs(gen, seqs, n, heads, kv_heads, head_dim, offset=0):
    """q as the caller passes it: (S, heads, n, hd), a transposed view of (S, n, heads, hd),
    at positions offset .. offset + n - 1; k, v (S, offset + n, kv_heads, hd)."""
    q = torch.randn(seqs, n, heads, head_dim, generator=gen).transpose(1, 2)
    k, v = (torch.randn(seqs, offset + n, kv_heads, head_dim, generator=gen) for _ in range(2))
    return q, k, v


def _plain(q, k, v, scale):
    """The causal rule in plain float64 arithmetic: query i (position K - Q + i) sees keys up
    to its position."""
    num_q, keys, group = q.shape[2], k.shape[1], q.shape[1] // k.shape[2]
    k, v = (t.double().repeat_interleave(group, 2).transpose(1, 2) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    visible = torch.arange(keys)[None, :] <= torch.arange(keys - num_q, keys)[:, None]
    return torch.softmax(scores.masked_fill(~visible, -torch.inf), -1) @ v


@pytest.mark.parametrize("seqs,n,heads,kv_heads,head_dim", [
    (1, 256, 9, 3, 64),  # SmolLM2's shape
    (1, 1, 2, 2, 16),  # one query
    (1, 5, 4, 2, 24),  # fewer queries than a block, head_dim with a tail
    (2, 37, 4, 1, 80),  # two padded sequences, all heads on one kv head
    (1, 100, 8, 8, 128),
    (1, 19, 2, 1, 512),  # the widest head it takes
])
def test_matches_the_reference(gen, seqs, n, heads, kv_heads, head_dim):
    q, k, v = _inputs(gen, seqs, n, heads, kv_heads, head_dim)
    got = cpu_causal_attention.causal_attention_cpu(q, k, v, head_dim ** -0.5)
    want = _causal_sdpa_in_chunks(q, k, v, head_dim ** -0.5)
    assert got.shape == want.shape == (seqs, heads, n, head_dim)
    assert relative_error(got, want) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("n,offset,heads,kv_heads,head_dim", [
    (256, 512, 9, 3, 64),  # SmolLM2's shape, a chunk after a 512-token prefix
    (1, 40, 4, 2, 16),  # one query after its prefix
    (7, 9, 4, 2, 24),  # a prefix ending inside a key block, head_dim with a tail
    (45, 3, 6, 1, 80),  # more queries than SDPA's chunk of 32
])
def test_a_chunk_after_its_prefix(gen, n, offset, heads, kv_heads, head_dim):
    q, k, v = _inputs(gen, 2, n, heads, kv_heads, head_dim, offset)
    want = _plain(q, k, v, 0.3)
    for attend in (cpu_causal_attention.causal_attention_cpu, _causal_sdpa_in_chunks):
        got = attend(q, k, v, 0.3)
        assert got.shape == (2, heads, n, head_dim)
        assert relative_error(got, want.float()) < TOLERANCE[torch.float32]


def test_several_threads_give_the_same_result(gen, monkeypatch):
    q, k, v = _inputs(gen, 1, 70, 6, 2, 64)
    alone = cpu_causal_attention.causal_attention_cpu(q, k, v, 0.125)
    monkeypatch.setattr(cpu_causal_attention, "PARALLEL_MIN_WORK", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(cpu_causal_attention.causal_attention_cpu(q, k, v, 0.125), alone)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("q_lens,prefix,window,through_kernel", [
    ([12, 7], False, None, True),  # whole prompts: the kernel
    ([12], True, None, True),  # one sequence's chunk after its cached prefix: the kernel
    ([12, 7], True, None, False),  # several after their prefixes (padded): SDPA with a mask
    ([12, 7], False, 4, False),  # a sliding window: SDPA with its mask
])
def test_native_paged_attention_sends_what_the_kernel_takes(gen, monkeypatch, q_lens, prefix,
                                                            window, through_kernel):
    context = [q + 5 if prefix else q for q in q_lens]
    batch = random_paged_batch(context, q_lens, 4, 2, 32, 4, torch.float32, gen)
    calls = []
    real = cpu_causal_attention.causal_attention_cpu
    monkeypatch.setattr(cpu_causal_attention, "causal_attention_cpu",
                        lambda *args: calls.append(args[0].shape) or real(*args))
    args = (batch.query, batch.cache, batch.cu_seqlens_q, batch.context_lens,
            batch.block_tables, 0.2, window)
    got = dispatch.paged_attention(*args, backend="native")
    want = dispatch.paged_attention(*args, backend="torch")
    assert relative_error(got, want) < TOLERANCE[torch.float32]
    assert bool(calls) == through_kernel


def test_refuses_what_it_does_not_take(gen):
    q, k, v = _inputs(gen, 1, 3, 2, 2, cpu_causal_attention.MAX_HEAD_DIM + 16)
    assert not cpu_causal_attention.takes(q, k, v)  # the dispatcher keeps SDPA for it
    with pytest.raises(ValueError, match="head_dim <= 512"):
        cpu_causal_attention.causal_attention_cpu(q, k, v, 0.1)
    q, k, v = _inputs(gen, 1, 3, 3, 2, 16)
    with pytest.raises(ValueError, match="kv_heads dividing heads"):
        cpu_causal_attention.causal_attention_cpu(q, k, v, 0.1)
