"""ModelConfig parsing: families, RoPE styles, eos/bos sources, windows, derived sizes."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.models.checkpoint import open_checkpoint
from pdserve.models.config import ModelConfig

BASE = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)


def cfg(**overrides) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **overrides})


def test_defaults_and_head_dim():
    c = cfg()
    assert c.head_dim == 16 and c.rope_theta == 10000.0 and c.rope_scaling is None
    assert c.sliding_window is None and c.layer_sliding_windows == (None,) * 3
    assert cfg(head_dim=32).head_dim == 32  # explicit head_dim wins over hidden / heads
    assert cfg(num_key_value_heads=None).num_key_value_heads == 4


def test_rope_styles_parse_identically():
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
    new = cfg(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **scaling})
    old = cfg(rope_theta=5e5, rope_scaling={"rope_type": "llama3", **scaling})
    older = cfg(rope_theta=5e5, rope_scaling={"type": "llama3", **scaling})
    assert new.rope_theta == old.rope_theta == older.rope_theta == 5e5
    assert new.rope_scaling == old.rope_scaling == older.rope_scaling == {
        "rope_type": "llama3", **scaling}
    # llama3 without original_max_position_embeddings falls back to max_position_embeddings
    no_orig = cfg(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0})
    assert no_orig.rope_scaling["original_max_position_embeddings"] == 256
    assert cfg(rope_parameters={"rope_type": "default", "rope_theta": 1e6}).rope_scaling is None


@pytest.mark.parametrize("bad, match", [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, "longrope"),
    ({"rope_parameters": {"rope_type": "linear"}}, "factor"),
    ({"model_type": "gpt2"}, "gpt2.*llama, mistral, qwen2, qwen3"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"intermediate_size": None}, "intermediate_size"),
])
def test_bad_configs_raise_naming_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        cfg(**bad)


def test_family_switches():
    qwen2 = cfg(model_type="qwen2")
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    qwen3 = cfg(model_type="qwen3")
    assert qwen3.qk_norm and qwen3.head_dim == 128  # Qwen3Config's default head_dim
    assert not qwen3.attention_bias
    llama = cfg(attention_bias=True, mlp_bias=True)
    assert llama.attention_bias and llama.o_proj_bias and llama.mlp_bias
    assert not cfg(model_type="mistral", attention_bias=True).attention_bias


def test_sliding_windows():
    assert cfg(model_type="llama", sliding_window=8).sliding_window is None
    mistral = cfg(model_type="mistral", sliding_window=8)
    assert mistral.sliding_window == 8 and mistral.layer_sliding_windows == (8, 8, 8)
    assert cfg(model_type="mistral").sliding_window == 4096  # MistralConfig default
    assert cfg(model_type="mistral", sliding_window=None).sliding_window is None
    # Qwen: ignored unless use_sliding_window; then layers >= max_window_layers use it.
    assert cfg(model_type="qwen2", sliding_window=8).layer_sliding_windows == (None,) * 3
    mixed = cfg(model_type="qwen2", use_sliding_window=True, sliding_window=8,
                max_window_layers=1)
    assert mixed.layer_sliding_windows == (None, 8, 8)
    assert mixed.sliding_window is None  # no single window covers every layer
    explicit = cfg(model_type="qwen3", use_sliding_window=True, sliding_window=8,
                   layer_types=["sliding_attention"] * 3)
    assert explicit.sliding_window == 8 and explicit.layer_sliding_windows == (8, 8, 8)
    with pytest.raises(ValueError, match="layer_types"):
        cfg(model_type="qwen2", use_sliding_window=True, sliding_window=8,
            layer_types=["full_attention"])


def test_eos_bos_from_generation_config_then_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 7,
                                                      "bos_token_id": 5}))
    c = open_checkpoint(tmp_path).model_config
    assert c.eos_token_ids == (7,) and c.bos_token_id == 5
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7, 9]}))
    c = open_checkpoint(tmp_path).model_config
    assert c.eos_token_ids == (9, 7) and c.bos_token_id == 5
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3,
                                                                 "bos_token_id": 4}))
    c = open_checkpoint(tmp_path).model_config
    assert c.eos_token_ids == (3,) and c.bos_token_id == 4


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        _ = open_checkpoint(tmp_path).model_config
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        _ = open_checkpoint(tmp_path).model_config


def test_dtype_field_both_spellings():
    assert cfg(dtype="bfloat16").torch_dtype == "bfloat16"
    assert cfg(torch_dtype="float16").torch_dtype == "float16"


def test_kv_bytes_per_token():
    c = cfg(head_dim=32)
    assert c.kv_bytes_per_token(torch.bfloat16) == 2 * 3 * 2 * 32 * 2
    assert c.kv_bytes_per_token(torch.float32) == 2 * 3 * 2 * 32 * 4
    assert c.kv_cache_shape(10, 16) == (2, 10, 16, 2, 32)


def test_num_parameters_matches_transformers(family_case, hf_model):
    config = open_checkpoint(family_case.path).model_config
    hf = hf_model(family_case.path)
    assert config.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert config.weight_bytes(torch.bfloat16) == 2 * config.num_parameters()
