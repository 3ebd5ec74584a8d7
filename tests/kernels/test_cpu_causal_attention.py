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


def _on_two_threads(monkeypatch, attend):
    """attend() split over two threads however small its work."""
    monkeypatch.setattr(cpu_causal_attention, "PARALLEL_MIN_WORK", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return attend()
    finally:
        torch.set_num_threads(before)


def test_several_threads_give_the_same_result(gen, monkeypatch):
    q, k, v = _inputs(gen, 1, 70, 6, 2, 64)
    alone = cpu_causal_attention.causal_attention_cpu(q, k, v, 0.125)
    assert torch.equal(_on_two_threads(
        monkeypatch, lambda: cpu_causal_attention.causal_attention_cpu(q, k, v, 0.125)), alone)


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


bf16_native = pytest.mark.skipif(
    not cpu_causal_attention.bf16_native(),
    reason="this CPU has no AMX tiles for the bf16 kernel (torch's SDPA serves bf16 prompts)")


def _packed_bf16(gen, n, heads, kv_heads, head_dim, magnitude=1.0):
    """q (n, heads, hd), k and v (n, kv_heads, hd) in bf16 as the model passes them: views of
    one packed projection's rows, not contiguous."""
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(n, width, generator=gen) * magnitude).bfloat16()
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    return (q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim),
            v.view(n, kv_heads, head_dim))


def _plain_prompt(q, k, v, scale):
    """_plain for one whole prompt in the (T, heads, hd) layout, from q, k, v's bf16 values."""
    out = _plain(q.double().transpose(0, 1)[None], k.double()[None], v.double()[None], scale)
    return out[0].transpose(0, 1).float()


@bf16_native
@pytest.mark.parametrize("n,heads,kv_heads,head_dim", [
    (256, 9, 3, 64),  # SmolLM2's shape
    (1, 2, 2, 32),  # one query
    (31, 4, 2, 64),  # one tile of queries short of a block
    (32, 4, 2, 64),  # exactly one block
    (33, 4, 1, 128),  # one past a block, all heads on one kv head
    (100, 8, 8, 256),  # the widest head it takes
])
def test_bf16_prompts_match_plain_arithmetic(gen, n, heads, kv_heads, head_dim):
    q, k, v = _packed_bf16(gen, n, heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    got = cpu_causal_attention.causal_attention_bf16_cpu(q, k, v, scale)
    assert got.shape == (n, heads, head_dim) and got.dtype == torch.bfloat16
    want = _plain_prompt(q, k, v, scale)
    assert relative_error(got.float(), want) < TOLERANCE[torch.bfloat16]
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    # as close to the exact result as torch's own bf16 kernel, to within bf16 rounding
    assert relative_error(got.float(), want) < 2 * relative_error(sdpa.float(), want) + 4e-3


@bf16_native
def test_bf16_softmax_holds_for_large_scores(gen):
    """Scores in the thousands (softmax close to one-hot) stay finite and right: each row's
    largest score is taken out before the exponential."""
    q, k, v = _packed_bf16(gen, 70, 4, 2, 64, magnitude=30.0)
    got = cpu_causal_attention.causal_attention_bf16_cpu(q, k, v, 0.125)
    assert torch.isfinite(got.float()).all()
    assert relative_error(got.float(), _plain_prompt(q, k, v, 0.125)) < TOLERANCE[torch.bfloat16]


@bf16_native
@pytest.mark.parametrize("head_dim", [64, 128, 256])  # one pass over the keys; two; four
def test_bf16_rows_whose_largest_score_comes_late(gen, head_dim):
    """The kernel keeps each row's running maximum and scales the sums made so far down when
    a later block of keys scores far higher: keys that every query favours more and more the
    later they come (ten blocks of 32 keys, scores rising by thousands) give the exact result,
    for a head of one pass over the keys and for wider ones, whose later passes replay the
    first one's rescalings."""
    n, heads = 330, 2
    q, k, v = _packed_bf16(gen, n, heads, 1, head_dim)
    q[:, :, 0] = 8.0  # every query leans on dimension 0, where keys grow with position
    k[:, :, 0] = torch.linspace(0.0, 400.0, n).bfloat16()[:, None]
    scale = head_dim ** -0.5
    got = cpu_causal_attention.causal_attention_bf16_cpu(q, k, v, scale)
    assert relative_error(got.float(), _plain_prompt(q, k, v, scale)) < TOLERANCE[torch.bfloat16]


@bf16_native
def test_bf16_is_causal_and_threads_agree(gen, monkeypatch):
    q, k, v = _packed_bf16(gen, 90, 6, 2, 64)
    alone = cpu_causal_attention.causal_attention_bf16_cpu(q, k, v, 0.125)
    k2, v2 = k.clone(), v.clone()
    k2[-1], v2[-1] = 100.0, -100.0
    later = cpu_causal_attention.causal_attention_bf16_cpu(q, k2, v2, 0.125)
    assert torch.equal(later[:-1], alone[:-1]) and not torch.equal(later[-1], alone[-1])
    assert torch.equal(_on_two_threads(
        monkeypatch, lambda: cpu_causal_attention.causal_attention_bf16_cpu(q, k, v, 0.125)),
        alone)


def test_bf16_refuses_what_it_does_not_take(gen):
    for head_dim, scale in ((48, 0.1), (288, 0.1), (64, 0.0), (64, -0.5)):
        q, k, v = _packed_bf16(gen, 5, 2, 1, head_dim)
        assert not cpu_causal_attention.takes_bf16(q, k, v, scale)
        with pytest.raises(ValueError, match="multiple of 32"):
            cpu_causal_attention.causal_attention_bf16_cpu(q, k, v, scale)
    q, k, v = _packed_bf16(gen, 5, 2, 1, 64)
    assert not cpu_causal_attention.takes_bf16(q.float(), k.float(), v.float(), 0.1)
    if cpu_causal_attention.takes_bf16(q, k, v, 0.1):
        q3, k3, v3 = _packed_bf16(gen, 5, 3, 2, 64)
        with pytest.raises(ValueError, match="kv_heads dividing heads"):
            cpu_causal_attention.causal_attention_bf16_cpu(q3, k3, v3, 0.1)


@pytest.mark.parametrize("head_dim", [64, 80])
def test_bf16_prompts_go_where_they_are_taken(gen, monkeypatch, head_dim):
    """The dispatcher sends a bf16 prompt to the AMX kernel where it takes it (head_dim 64 on
    an AMX CPU), to torch's bf16 SDPA elsewhere (head_dim 80, or no AMX); both agree."""
    q, k, v = _packed_bf16(gen, 40, 4, 2, head_dim)
    calls = []
    real = cpu_causal_attention.causal_attention_bf16_cpu
    monkeypatch.setattr(cpu_causal_attention, "causal_attention_bf16_cpu",
                        lambda *args: calls.append(args[0].shape) or real(*args))
    got = dispatch.prompt_attention(q, k, v, 0.125, backend="native")
    taken = cpu_causal_attention.takes_bf16(q, k, v, 0.125)
    assert bool(calls) == taken == (head_dim == 64 and cpu_causal_attention.bf16_native())
    assert relative_error(got.float(), _plain_prompt(q, k, v, 0.125)) < TOLERANCE[torch.bfloat16]
