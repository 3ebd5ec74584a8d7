"""int8 KV cache: scale schemes, calibration on real text only, the pool's layout and the
ledger agree, more blocks on the same budget, close to full precision, token scales travel."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.kv_eval_text import EVAL_TEXTS
from pdserve.engine.int8_calibration import calibrate_kv_scales
from pdserve.engine.kv_cache.calibration_text import CALIBRATION_TEXTS
from pdserve.engine.kv_cache.int8_scales import (
    CALIBRATION_TOKENS,
    INT8_SCHEMES,
    calibration_prompts,
)
from pdserve.kernels import KVCacheLayer
from pdserve.kernels.kv_layout import TOKEN_SCALE_DTYPE
from pdserve.kv_transfer import layers_nbytes, pack_layers, unpack_layers
from pdserve.models import load_model
from pdserve.models.checkpoint import open_checkpoint

SCHEMES = sorted(INT8_SCHEMES)


@pytest.fixture(scope="module")
def model_dir(hf_checkpoint):
    return hf_checkpoint("llama")


def test_calibration_is_real_text_only(model_dir):
    tokenizer = open_checkpoint(model_dir).tokenizer()
    prompts, known = calibration_prompts(tokenizer, vocab_size=512, max_len=64)
    assert known == 1.0  # (a byte-level tokenizer has no unknown token)
    text_ids = [tokenizer.encode(t) for t in CALIBRATION_TEXTS]
    flat = [t for p in prompts for t in p]
    assert 0 < len(flat) <= CALIBRATION_TOKENS and all(len(p) <= 64 for p in prompts)
    # every prompt is a window of one calibration text: no random ids anywhere
    joined = [" ".join(map(str, ids)) for ids in text_ids]
    assert all(any(" ".join(map(str, p)) in j for j in joined) for p in prompts)
    mc = open_checkpoint(model_dir).model_config
    model = load_model(model_dir)
    with pytest.raises(ValueError, match="needs the checkpoint's tokenizer.*'token'"):
        calibrate_kv_scales(model, mc, [torch.int8] * 2, torch.device("cpu"), "torch", None)
    ones, calibration = calibrate_kv_scales(model, mc, [torch.int8] * 2, torch.device("cpu"),
                                            "torch", None, scheme=INT8_SCHEMES["token"])
    assert all(torch.equal(k, torch.ones_like(k)) and torch.equal(v, k) for k, v in ones)
    assert calibration.source == "none"


def test_scales_are_per_channel_and_cover_calibration(model_dir):
    mc = open_checkpoint(model_dir).model_config
    model = load_model(model_dir)
    dtypes = [torch.int8] * mc.num_hidden_layers
    scales, calibration = calibrate_kv_scales(model, mc, dtypes, torch.device("cpu"), "torch",
                                              open_checkpoint(model_dir).tokenizer(),
                                              scheme=INT8_SCHEMES["kivi"])
    assert calibration.source == "text" and calibration.num_tokens > 0
    assert len(scales) == mc.num_hidden_layers
    for k_scale, v_scale in scales:
        assert k_scale.shape == (mc.num_key_value_heads, mc.head_dim) == v_scale.shape
        assert k_scale.dtype == torch.float32 and bool((k_scale > 0).all())
        assert k_scale.std() > 0  # per channel, not one number
        assert torch.equal(v_scale, torch.ones_like(v_scale))  # kivi: values per token only


@pytest.mark.parametrize("scheme", SCHEMES)
def test_pool_layout_matches_the_ledger_and_capacity(model_dir, scheme):
    budget = 64 << 20
    full = LLM(str(model_dir), memory_budget_bytes=budget)
    int8 = LLM(str(model_dir), memory_budget_bytes=budget, kv_cache_dtype="int8",
               kv_int8_keep_edge_layers=False, kv_int8_scales=scheme)
    caches = int8.engine.parts.runner.kv_caches
    spec = INT8_SCHEMES[scheme]
    for cache in caches:
        assert cache.kv.dtype == torch.int8
        assert (cache.k_token_scale is not None) == spec.k_token
        assert (cache.v_token_scale is not None) == spec.v_token
        for t in cache.token_scales:
            assert t.dtype == TOKEN_SCALE_DTYPE and t.shape == cache.kv.shape[1:4]
    ledger = int8.memory_ledger
    # what the planner charged per block is what the allocated pool holds per block
    assert ledger.kv_bytes_per_token * ledger.block_size == sum(c.bytes_per_block for c in caches)
    assert scheme in ledger.kv_dtype
    # fp32 -> int8 quarters the K/V bytes; fp16 token scales cost 2 B per (token, head, half)
    mc = int8.engine.parts.model_config
    per_head = 2 * mc.head_dim + 2 * spec.num_token_scaled
    expected = 4 * 2 * mc.head_dim / per_head
    ratio = ledger.num_kv_blocks / full.memory_ledger.num_kv_blocks
    assert ratio == pytest.approx(expected, rel=0.02)
    assert any("int8 KV gain" in row[0] for row in ledger.rows())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_int8_logits_close_to_full_precision(model_dir, scheme):
    # held-out text (static scales saturate on random ids they were not calibrated on)
    prompts = [text[:n] for text, n in zip(EVAL_TEXTS, (20, 60, 120), strict=False)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)
    full = LLM(str(model_dir), block_size=4, num_kv_blocks=64)
    int8 = LLM(str(model_dir), block_size=4, num_kv_blocks=64, kv_cache_dtype="int8",
               kv_int8_keep_edge_layers=False, kv_int8_scales=scheme)
    a = full.generate(prompts, params, use_tqdm=False)
    b = int8.generate(prompts, params, use_tqdm=False)
    # the first token's distribution depends only on the prompt's KV: compare its logprobs
    for x, y in zip(a, b, strict=True):
        top = x.logprobs[0]
        err = max(abs(top[t] - y.logprobs[0].get(t, top[t])) for t in top)
        assert err < 0.05
    assert int8.engine.parts.block_manager.num_used_blocks == 0


def _pool(gen, dynamic: str, num_blocks: int = 6) -> KVCacheLayer:
    kv = torch.randint(-127, 128, (2, num_blocks, 4, 2, 8), generator=gen, dtype=torch.int8)
    scales = [torch.rand(num_blocks, 4, 2, generator=gen).to(TOKEN_SCALE_DTYPE)
              if half in dynamic else None for half in "kv"]
    return KVCacheLayer(kv, torch.rand(2, 8, generator=gen), torch.rand(2, 8, generator=gen),
                        *scales)


@pytest.mark.parametrize("dynamic", ["kv", "v"])
def test_token_scales_travel_with_their_blocks(dynamic):
    gen = torch.Generator().manual_seed(0)
    src = [_pool(gen, dynamic) for _ in range(3)]
    dst = [_pool(gen, dynamic) for _ in range(3)]
    src_ids, dst_ids = torch.tensor([4, 1]), torch.tensor([0, 5])
    payload = pack_layers(src, src_ids, 0, 3)
    assert payload.dtype == torch.uint8 and payload.numel() == layers_nbytes(src, 2, 0, 3)
    unpack_layers(payload.clone(), dst, dst_ids, 0, 3)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d.kv[:, dst_ids], s.kv[:, src_ids])
        for ts, td in zip(s.token_scales, d.token_scales, strict=True):
            assert torch.equal(td[dst_ids], ts[src_ids])
    with pytest.raises(ValueError, match="same token scales"):
        pack_layers([src[0], _pool(gen, "")], src_ids, 0, 2)
