"""Greedy equality with Hugging Face on configuration variants beyond the family fixtures:
other rope scalings, biases, explicit head_dim, tied or untied heads, a bf16 checkpoint."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

BASE = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, vocab_size=301, max_position_embeddings=512)
CASES = {
    "llama-linear-rope": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear",
                                                             "factor": 2.0})),
    "llama-dynamic-rope": ("LlamaConfig", dict(rope_scaling={"rope_type": "dynamic",
                                                              "factor": 2.0})),
    "llama-yarn-rope": ("LlamaConfig", dict(rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})),
    "llama-biases-head-dim": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True,
                                                  head_dim=24)),
    "llama-mha-tied": ("LlamaConfig", dict(num_key_value_heads=6, tie_word_embeddings=True)),
    "qwen3-tied": ("Qwen3Config", dict(head_dim=40, tie_word_embeddings=True)),
    "mistral-head-dim": ("MistralConfig", dict(head_dim=32, sliding_window=16)),
    "qwen2-untied": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "llama-bf16-checkpoint": ("LlamaConfig", dict()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_matches_hf(tmp_path, name, hf_greedy):
    config_class, extra = CASES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**BASE, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    if name == "llama-bf16-checkpoint":
        model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 300) for _ in range(n)] for n in (5, 23, 40)]
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_kv_blocks=128,
              max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert ours == hf_greedy(tmp_path, prompts, 12)
    assert llm.engine.parts.block_manager.num_used_blocks == 0
