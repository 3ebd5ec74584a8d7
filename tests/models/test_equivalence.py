"""Our decoder against transformers' forward, fp32 on CPU, for every family in FAMILY_PARAMS.

Each test packs several sequences into one flat batch over a paged KV pool (block_size 4,
random block ids, pool pre-filled with noise so reading an unwritten slot shows) and compares
the full logits with Hugging Face's, run on each sequence alone.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import KVCacheLayer
from pdserve.kernels.torch_attention import paged_attention_torch, paged_decode_attention_torch
from pdserve.models import load_model
from pdserve.models.attention import AttentionMetadata

BLOCK_SIZE = 4
ATOL = RTOL = 1e-4
PROMPT_LENS = (5, 11, 19, 2)  # 11 and 19 exceed the Mistral window (8) and Qwen2's (6)


def _sequences(vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _reference(hf, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Append HF's greedy next token to each prompt; HF logits over every full sequence."""
    fulls, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            first = hf(torch.tensor([prompt])).logits[0]
            full = prompt + [int(first[-1].argmax())]
            fulls.append(full)
            logits.append(hf(torch.tensor([full])).logits[0].float())  # (len + 1, vocab)
    return fulls, logits


def _check(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.fixture(scope="module")
def loaded(family_case, hf_model):
    model = load_model(family_case.path)
    hf = hf_model(family_case.path)
    fulls, ref = _reference(hf, _sequences(model.config.vocab_size))
    return model, fulls, ref


def test_prefill_then_decode_matches_hf(loaded, paged_batch):
    model, fulls, ref = loaded
    batch = paged_batch(model.config, len(fulls), max(map(len, fulls)), seed=1)
    # Step 1: every prompt at once, packed.
    ids, pos, meta = batch.step({s: (0, full[:-1]) for s, full in enumerate(fulls)})
    logits = model.compute_logits(model(ids, pos, batch.caches, meta))
    _check(logits, torch.cat([r[:-1] for r in ref]))
    # Step 2: one new token per sequence through the paged decode path.
    ids, pos, meta = batch.step({s: (len(full) - 1, full[-1:]) for s, full in enumerate(fulls)})
    assert meta.is_decode_only
    logits = model.compute_logits(model(ids, pos, batch.caches, meta))
    _check(logits, torch.stack([r[-1] for r in ref]))


def test_chunked_prefill_mixed_with_decode_matches_hf(loaded, paged_batch):
    model, fulls, ref = loaded
    batch = paged_batch(model.config, len(fulls), max(map(len, fulls)), seed=2)
    prompts = [full[:-1] for full in fulls]
    splits = [3, 4, 7]  # first-chunk lengths of seqs 0-2; seq 3 is fully prefilled in step A
    step_a = {s: (0, prompts[s][:n]) for s, n in enumerate(splits)}
    step_a[3] = (0, prompts[3])
    ids, pos, meta = batch.step(step_a)
    logits = model.compute_logits(model(ids, pos, batch.caches, meta))
    _check(logits, torch.cat([ref[s][: len(toks)] for s, (_, toks) in step_a.items()]))
    # Step B: the rest of each prompt over its cached prefix, plus seq 3's decode token.
    step_b = {s: (n, fulls[s][n:]) for s, n in enumerate(splits)}
    step_b[3] = (len(prompts[3]), fulls[3][-1:])
    ids, pos, meta = batch.step(step_b)
    assert not meta.is_decode_only
    logits = model.compute_logits(model(ids, pos, batch.caches, meta))
    _check(logits, torch.cat([ref[s][start:] for s, (start, _) in step_b.items()]))


def test_sliding_window_semantics_match_transformers():
    """transformers' mask: query p sees key k iff k <= p and k > p - window; so do our refs."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    window, n = 3, 9
    mask_fn = sliding_window_causal_mask_function(window)
    hf_visible = torch.tensor([[bool(mask_fn(0, 0, torch.tensor(q), torch.tensor(k)))
                                for k in range(n)] for q in range(n)])
    # Values are one-hot positions and queries are zero, so attention is uniform over the
    # visible keys and the output row reveals exactly which keys a query saw.
    kv = torch.zeros(2, 3, BLOCK_SIZE, 1, n)
    kv[1].view(-1, n)[:n] = torch.eye(n)
    cache = KVCacheLayer(kv)
    tables = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    out = paged_attention_torch(torch.zeros(n, 1, n), cache, torch.tensor([0, n]),
                                torch.tensor([n]), tables, 1.0, sliding_window=window)
    assert torch.equal(out[:, 0] > 0, hf_visible)
    out = paged_decode_attention_torch(torch.zeros(1, 1, n), cache, tables, torch.tensor([n]),
                                       1.0, sliding_window=window)
    assert torch.equal(out[0, 0] > 0, hf_visible[-1])


def test_sampled_rows_alone_through_the_last_layer(loaded, paged_batch):
    """forward(rows=...) returns those rows' hidden states as the full forward does (the last
    layer attends them as single queries, to float32 rounding), writes every K/V the same bit
    for bit, and runs the last layer's MLP on those rows alone."""
    model, fulls, _ = loaded
    prompts = [full[:-1] for full in fulls]
    full_run, rows_run, empty_run = (
        paged_batch(model.config, len(fulls), max(map(len, fulls)), seed=3) for _ in range(3))
    # seq 0: a first chunk (samples nothing); 1: a whole prompt; 2: a decode-like last token
    # after a cached prefix (written by the first step); 3: three rows sampled (a draft check)
    for run in (full_run, rows_run, empty_run):
        ids, pos, meta = run.step({2: (0, prompts[2][:-1])})
        model(ids, pos, run.caches, meta)
    step = {0: (0, prompts[0][:3]), 1: (0, prompts[1]), 2: (len(prompts[2]) - 1, prompts[2][-1:]),
            3: (0, prompts[3] + fulls[3][-1:])}
    ends = torch.tensor([len(tokens) for _, tokens in step.values()]).cumsum(0)
    rows = torch.cat([ends[1:3] - 1, torch.arange(ends[3] - 3, ends[3])])
    ids, pos, meta = full_run.step(step)
    every = model(ids, pos, full_run.caches, meta)
    seen = []
    down = model.model.layers[-1].mlp.down_proj
    original = down.forward
    down.forward = lambda x, *rest: seen.append(len(x)) or original(x, *rest)
    try:
        picked = model(ids, pos, rows_run.caches, meta, rows=rows)
        empty = model(ids, pos, empty_run.caches, meta, rows=rows[:0])
    finally:
        del down.forward
    assert seen == [len(rows)]  # the empty call stops after the last layer's K/V
    torch.testing.assert_close(picked, every[rows], atol=1e-5, rtol=1e-5)
    assert torch.equal(model.compute_logits(picked).argmax(-1),
                       model.compute_logits(every[rows]).argmax(-1))
    assert empty.shape == (0, model.config.hidden_size)
    for ours, theirs in zip(rows_run.caches, full_run.caches, strict=True):
        assert torch.equal(ours.kv, theirs.kv)
    for ours, theirs in zip(empty_run.caches, full_run.caches, strict=True):
        assert torch.equal(ours.kv, theirs.kv)  # the empty call wrote every layer's K/V too


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_one_sampled_row_beside_a_chunk_that_samples_nothing(loaded, paged_batch, backend):
    """A one-token prompt, the only row sampled, beside another prompt's first chunk: in the
    last layer it attends as one query over its one key (not as a whole prompt over the
    step's K/V)."""
    model, fulls, _ = loaded
    full_run, rows_run = (paged_batch(model.config, len(fulls), max(map(len, fulls)), seed=4,
                                      backend=backend) for _ in range(2))
    ids, pos, meta = full_run.step({0: (0, fulls[0][:1]), 1: (0, fulls[1][:5])})
    every = model(ids, pos, full_run.caches, meta)
    picked = model(ids, pos, rows_run.caches, meta, rows=torch.tensor([0]))
    torch.testing.assert_close(picked, every[:1], atol=1e-5, rtol=1e-5)


def test_rows_metadata_are_single_queries_at_their_positions(paged_batch):
    meta = AttentionMetadata(
        slot_mapping=torch.arange(9), cu_seqlens_q=torch.tensor([0, 4, 5, 9], dtype=torch.int32),
        context_lens=torch.tensor([4, 12, 7], dtype=torch.int32),
        block_tables=torch.tensor([[5, 6], [7, 8], [9, 10]], dtype=torch.int32),
        max_query_len=4, max_context_len=12)
    rows = meta.of_rows(torch.tensor([3, 4, 6, 8]))
    assert rows.context_lens.tolist() == [4, 12, 5, 7]  # row 6 is seq 2's position 4
    assert rows.block_tables.tolist() == [[5, 6], [7, 8], [9, 10], [9, 10]]
    assert rows.slot_mapping.tolist() == [3, 4, 6, 8]
    assert rows.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert rows.is_decode_only and rows.max_context_len == 12
