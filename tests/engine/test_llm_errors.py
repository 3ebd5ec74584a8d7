"""Bad input to the offline API raises ValueError naming what is wrong, and leaks nothing."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(hf_checkpoint):
    return LLM(str(hf_checkpoint("llama")), block_size=4, num_kv_blocks=64, max_model_len=64)


@pytest.mark.parametrize("prompt, match", [
    ("", "prompt"), ([], "prompt"), ([1, 2, 10**6], "prompt token ids"), ([1, -1], "prompt"),
    ([1, 2.5], "prompt"),
])
def test_bad_prompts(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.parts.block_manager.num_used_blocks == 0


def test_prompt_plus_max_tokens_beyond_context(llm):
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[1] * 60], SamplingParams(max_tokens=10), use_tqdm=False)


def test_request_that_can_never_fit_the_pool(hf_checkpoint):
    small = LLM(str(hf_checkpoint("llama")), block_size=4, num_kv_blocks=4, max_model_len=64)
    with pytest.raises(ValueError):
        small.generate([[1] * 20], SamplingParams(max_tokens=10), use_tqdm=False)
    assert small.engine.parts.block_manager.num_used_blocks == 0


def test_bad_engine_config(hf_checkpoint):
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(hf_checkpoint("llama")), block_size=0)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(hf_checkpoint("llama")), kv_cache_dtype="fp4")


def test_engine_still_correct_after_errors(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0,
                                                   ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 3 and out[0].finish_reason == "length"
