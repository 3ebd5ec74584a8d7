"""int8 KV cache: calibrated scales, 2-4x the blocks on the same budget, close to full precision."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.kv_quant import calibrate_kv_scales
from pdserve.models import ModelConfig, load_model


@pytest.fixture(scope="module")
def model_dir(hf_checkpoint):
    return hf_checkpoint("llama")


def test_scales_are_per_channel_and_cover_calibration(model_dir):
    mc = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir)
    dtypes = [torch.int8] * mc.num_hidden_layers
    scales = calibrate_kv_scales(model, mc, dtypes, torch.device("cpu"), "torch")
    assert len(scales) == mc.num_hidden_layers
    for k_scale, v_scale in scales:
        assert k_scale.shape == (mc.num_key_value_heads, mc.head_dim) == v_scale.shape
        assert k_scale.dtype == torch.float32 and bool((k_scale > 0).all())
        assert k_scale.std() > 0  # per channel, not one number


def test_edge_layers_kept_and_more_blocks_fit(model_dir):
    budget = 64 << 20
    full = LLM(str(model_dir), memory_budget_bytes=budget)
    int8 = LLM(str(model_dir), memory_budget_bytes=budget, kv_cache_dtype="int8",
               kv_int8_keep_edge_layers=False)
    edges = LLM(str(model_dir), memory_budget_bytes=budget, kv_cache_dtype="int8")
    caches = edges.engine.parts.runner.kv_caches
    assert caches[0].kv.dtype == torch.float32 and caches[-1].kv.dtype == torch.float32
    assert all(c.kv.dtype == torch.int8 for c in caches[1:-1])
    # fp32 -> int8 quarters the per-block bytes: the pool holds ~4x the blocks
    ratio = int8.memory_ledger.num_kv_blocks / full.memory_ledger.num_kv_blocks
    assert 3.9 < ratio <= 4.0
    assert int8.memory_ledger.num_kv_blocks_model_dtype == pytest.approx(
        full.memory_ledger.num_kv_blocks, rel=0.01)
    assert any("int8 KV gain" in row[0] for row in int8.memory_ledger.rows())


def test_int8_logits_close_to_full_precision(model_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 200) for _ in range(n)] for n in (7, 19, 33)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)
    full = LLM(str(model_dir), block_size=4, num_kv_blocks=64)
    int8 = LLM(str(model_dir), block_size=4, num_kv_blocks=64, kv_cache_dtype="int8",
               kv_int8_keep_edge_layers=False)
    a = full.generate(prompts, params, use_tqdm=False)
    b = int8.generate(prompts, params, use_tqdm=False)
    # the first token's distribution depends only on the prompt's KV: compare its logprobs
    for x, y in zip(a, b, strict=True):
        top = x.logprobs[0]
        err = max(abs(top[t] - y.logprobs[0].get(t, top[t])) for t in top)
        assert err < 0.05
    assert int8.engine.parts.block_manager.num_used_blocks == 0
