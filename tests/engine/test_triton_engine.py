"""The engine on the Triton kernels (interpreter on CPU) gives Hugging Face's greedy tokens,
through chunked prefill and a prefix-cache hit."""

from __future__ import annotations

import random
import sys

import pytest

from pdserve import LLM, SamplingParams

pytestmark = [pytest.mark.triton, pytest.mark.slow]


def test_triton_backend_greedy_equals_hf(hf_checkpoint, hf_greedy):
    model_dir = hf_checkpoint("llama")
    rng = random.Random(7)
    system = [rng.randrange(1, 200) for _ in range(12)]
    prompts = [system + [5, 6, 7], system + [9, 10]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=32,
              max_num_batched_tokens=8, attention_backend="triton")
    first = llm.generate(prompts[:1], params, use_tqdm=False)  # 15 tokens in chunks of 8
    second = llm.generate(prompts[1:], params, use_tqdm=False)  # 12 cached tokens
    assert second[0].num_cached_tokens == 12
    assert [first[0].token_ids, second[0].token_ids] == hf_greedy(model_dir, prompts, 4)
    assert llm.engine.parts.block_manager.num_used_blocks == 0
    for module in ("prefill_attention", "decode_attention", "kv_write", "norm"):
        assert f"pdserve.kernels.{module}" in sys.modules  # the Triton path really ran
