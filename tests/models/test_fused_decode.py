"""The one-call decode (kernels/cpu_decode_layers) against the unfused forward it replaces.

Every family of FAMILY_PARAMS, float32 and bfloat16, packed for the CPU's GEMM: prompts go
through the unfused forward (a prefill), then one decode step runs twice on copies of the same
pools, once fused and once unfused. The fused step must give the same final hidden states and
write the same K/V (float32: bit for bit, the same kernels in the same order; bfloat16: to its
rounding), and run where it claims to (a spy counts its calls); Qwen3's q/k norm, more rows than
it takes, unpacked weights and pools of another dtype stay unfused.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pdserve.kernels import KVCacheLayer, cpu_decode_layers
from pdserve.models import load_model

pytestmark = pytest.mark.skipif(
    not cpu_decode_layers.serves_dtype(torch.float32),
    reason="the fused decode runs where the panel GEMM beats oneDNN (AVX-512) and C builds")

PROMPT_LENS = [2 + (7 * i) % 19 for i in range(33)]  # 2-20 tokens, for up to 33 sequences


@pytest.fixture
def fused_calls(monkeypatch):
    """How many times the fused decode ran."""
    calls = []
    real = cpu_decode_layers.DecodeLayers.forward

    def spy(self, *args, **kwargs):
        calls.append(len(args[0]))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cpu_decode_layers.DecodeLayers, "forward", spy)
    return calls


def _model(path, dtype):
    model = load_model(path, dtype)
    model.pack_linears()
    return model


def _prefilled(model, paged_batch, num_seqs: int, seed: int):
    """A native-backend batch whose first num_seqs sequences hold their prompts' K/V, and
    each one's next token."""
    batch = paged_batch(model.config, num_seqs, max(PROMPT_LENS) + 2, seed=seed,
                        num_blocks=256, backend="native")
    for cache in batch.caches:
        cache.kv = cache.kv.to(model.dtype)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
               for n in PROMPT_LENS[:num_seqs]]
    ids, pos, meta = batch.step({s: (0, p) for s, p in enumerate(prompts)})
    model(ids, pos, batch.caches, meta)
    return batch, prompts


def _decode_both_ways(model, batch, prompts):
    """One decode step fused (as the model chooses) and forced unfused, each on its own copy of
    the pools: (fused hidden, fused pools, unfused hidden, unfused pools)."""
    ids, pos, meta = batch.step({s: (len(p), [(7 * s) % model.config.vocab_size])
                                 for s, p in enumerate(prompts)})
    assert meta.is_decode_only
    unfused_caches = [KVCacheLayer(c.kv.clone()) for c in batch.caches]
    fused = model(ids, pos, batch.caches, meta)
    plain = copy.copy(model)
    plain.fuses_decode = False
    unfused = plain(ids, pos, unfused_caches, meta)
    return fused, batch.caches, unfused, unfused_caches


@pytest.mark.parametrize("dtype, num_seqs", [
    (torch.float32, 1), (torch.float32, 3), (torch.float32, 16),
    (torch.bfloat16, 1), (torch.bfloat16, 3), (torch.bfloat16, 17), (torch.bfloat16, 32)])
def test_fused_decode_equals_the_unfused_forward(family_case, paged_batch, fused_calls, dtype,
                                                 num_seqs):
    model = _model(family_case.path, dtype)
    batch, prompts = _prefilled(model, paged_batch, num_seqs, seed=num_seqs)
    assert fused_calls == []  # prompts are not decode steps
    fused, fused_pools, unfused, unfused_pools = _decode_both_ways(model, batch, prompts)
    if family_case.family == "qwen3":  # per-head q/k norm: not fused
        assert fused_calls == []
        assert not cpu_decode_layers.takes_model(model)
        return
    if not cpu_decode_layers.serves_dtype(dtype):  # bf16 without AMX
        assert fused_calls == []
        return
    assert fused_calls == [num_seqs]
    if dtype == torch.float32:
        assert torch.equal(fused, unfused)
        for a, b in zip(fused_pools, unfused_pools, strict=True):
            assert torch.equal(a.kv, b.kv)
    else:
        torch.testing.assert_close(fused, unfused, atol=2e-2, rtol=2e-2)
        for a, b in zip(fused_pools, unfused_pools, strict=True):
            torch.testing.assert_close(a.kv, b.kv, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_more_rows_than_it_takes_stay_unfused(hf_checkpoint, paged_batch, fused_calls, dtype):
    model = _model(hf_checkpoint("llama"), dtype)
    batch, prompts = _prefilled(model, paged_batch, cpu_decode_layers.MAX_ROWS[dtype] + 1,
                                seed=4)
    fused, _, unfused, _ = _decode_both_ways(model, batch, prompts)
    assert fused_calls == []
    assert torch.equal(fused, unfused)


def test_pools_of_another_dtype_and_unpacked_models_stay_unfused(hf_checkpoint, paged_batch,
                                                                  fused_calls):
    model = _model(hf_checkpoint("llama"), torch.float32)
    batch, prompts = _prefilled(model, paged_batch, 2, seed=5)
    for cache in batch.caches:
        cache.kv = cache.kv.to(torch.bfloat16)
    _decode_both_ways(model, batch, prompts)
    assert fused_calls == []
    unpacked = load_model(hf_checkpoint("llama"))
    assert not cpu_decode_layers.takes_model(unpacked)


def test_a_new_pool_gets_a_new_table(hf_checkpoint, paged_batch, fused_calls):
    """The pointer table follows the pools it is handed: a second set of pools is written,
    the first left alone."""
    model = _model(hf_checkpoint("llama"), torch.float32)
    first, prompts = _prefilled(model, paged_batch, 2, seed=6)
    _decode_both_ways(model, first, prompts)
    before = [c.kv.clone() for c in first.caches]
    second, prompts = _prefilled(model, paged_batch, 2, seed=7)
    fused, _, unfused, _ = _decode_both_ways(model, second, prompts)
    assert fused_calls == [2, 2]
    assert torch.equal(fused, unfused)
    assert all(torch.equal(a, c.kv) for a, c in zip(before, first.caches, strict=True))


def test_a_slot_outside_the_pool_is_refused(hf_checkpoint, paged_batch):
    model = _model(hf_checkpoint("llama"), torch.float32)
    batch, prompts = _prefilled(model, paged_batch, 1, seed=8)
    ids, pos, meta = batch.step({0: (len(prompts[0]), [3])})
    meta.slot_mapping = torch.tensor([10 ** 9])
    with pytest.raises(ValueError, match="outside the pool"):
        model(ids, pos, batch.caches, meta)
