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
