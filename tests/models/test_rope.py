"""RoPE cos/sin caches against transformers' rotary embedding, fp32."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.torch_ops import rotary_torch
from pdserve.models.config import ModelConfig
from pdserve.models.rope import build_cos_sin_cache, cos_sin_cache_for

HEAD_DIM, MAX_POS = 64, 512

ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
             "original_max_position_embeddings": 128},
}


def _hf_cos_sin(rope_parameters: dict) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=HEAD_DIM * 2, num_attention_heads=2,
                         max_position_embeddings=MAX_POS, rope_parameters=dict(rope_parameters))
    rotary = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, torch.arange(MAX_POS)[None])
    return cos[0], sin[0]  # (MAX_POS, HEAD_DIM) each


@pytest.mark.parametrize("name", sorted(ROPE_CASES))
def test_cache_matches_transformers(name):
    params = dict(ROPE_CASES[name])
    config = ModelConfig.from_dict(dict(model_type="llama", vocab_size=8, hidden_size=HEAD_DIM * 2,
                                        intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=2, max_position_embeddings=MAX_POS,
                                        rope_parameters=params))
    cache = cos_sin_cache_for(config)
    assert cache.shape == (MAX_POS, HEAD_DIM) and cache.dtype == torch.float32
    hf_cos, hf_sin = _hf_cos_sin(params)
    half = HEAD_DIM // 2
    torch.testing.assert_close(cache[:, :half], hf_cos[:, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(cache[:, half:], hf_sin[:, :half], atol=1e-6, rtol=0)
    # HF repeats the halves ([f, f]); the rotate-half cache stores each once.
    assert torch.equal(hf_cos[:, :half], hf_cos[:, half:])


def test_scaling_changes_the_cache():
    plain = build_cos_sin_cache(HEAD_DIM, MAX_POS, 500000.0)
    scaled = build_cos_sin_cache(HEAD_DIM, MAX_POS, 500000.0, ROPE_CASES["llama3"])
    assert not torch.allclose(plain, scaled)
    assert torch.equal(plain[0], scaled[0])  # position 0 is the identity either way


def test_rotary_with_cache_matches_transformers_apply():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, 3, HEAD_DIM, generator=gen)  # (T, heads, head_dim)
    k = torch.randn(7, 1, HEAD_DIM, generator=gen)
    positions = torch.tensor([0, 1, 2, 100, 101, 511, 7])
    hf_cos, hf_sin = _hf_cos_sin(ROPE_CASES["llama3"])
    cache = build_cos_sin_cache(HEAD_DIM, MAX_POS, 500000.0, ROPE_CASES["llama3"])
    ours_q, ours_k = rotary_torch(q, k, positions, cache)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, hf_cos[positions], hf_sin[positions],
                                        unsqueeze_dim=1)
    torch.testing.assert_close(ours_q, ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_k, ref_k, atol=1e-5, rtol=1e-5)


def test_cache_is_float32_on_cpu_even_under_meta_device():
    with torch.device("meta"):
        cache = build_cos_sin_cache(HEAD_DIM, 16, 10000.0)
    assert cache.device.type == "cpu" and cache.dtype == torch.float32
    with pytest.raises(ValueError, match="max_positions"):
        build_cos_sin_cache(HEAD_DIM, 0, 10000.0)
