"""Greedy output of the engine equals Hugging Face transformers token for token (fp32, CPU)."""

from __future__ import annotations

import os
import random

import pytest

from pdserve import LLM, SamplingParams

transformers = pytest.importorskip("transformers")


def random_prompts(seed: int, vocab: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def assert_no_leak(llm: LLM) -> None:
    bm = llm.engine.parts.block_manager
    assert bm.num_used_blocks == 0
    assert bm.num_free_blocks + bm.num_cached_blocks == bm.num_blocks
    assert llm.engine.num_requests == 0


def run_engine(model_dir, prompts, max_tokens, **engine_kwargs):
    llm = LLM(str(model_dir), dtype="float32", **engine_kwargs)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finish_reason == "length" for o in outs)
    return llm, [o.token_ids for o in outs]


def test_greedy_matches_hf_every_family(hf_checkpoint, family_params, hf_greedy):
    for family, overrides in family_params:
        model_dir = hf_checkpoint(family, **overrides)
        vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
        prompts = random_prompts(1, vocab, [3, 17, 9, 33])
        llm, ours = run_engine(model_dir, prompts, 12, block_size=4, num_kv_blocks=128)
        assert ours == hf_greedy(model_dir, prompts, 12), f"{family} {overrides}"
        assert_no_leak(llm)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PDSERVE_HF_CHECK_MODEL"),
                    reason="set PDSERVE_HF_CHECK_MODEL to a real checkpoint folder "
                           "(e.g. SmolLM2-135M) to check it")
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_greedy_matches_hf_on_a_real_checkpoint(hf_greedy, backend):
    """A real model's greedy tokens, eight prompts decoded as one batch (every CPU kernel and
    the packed GEMMs in play), equal Hugging Face's for each prompt alone."""
    model_dir = os.environ["PDSERVE_HF_CHECK_MODEL"]
    vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    prompts = random_prompts(2, vocab, [256, 31, 190, 7, 128, 64, 300, 17])
    llm, ours = run_engine(model_dir, prompts, 48, attention_backend=backend)
    assert ours == hf_greedy(model_dir, prompts, 48)
    assert_no_leak(llm)


def test_chunked_prefill_small_budget(hf_checkpoint, hf_greedy):
    model_dir = hf_checkpoint("llama")
    prompts = random_prompts(2, 200, [30, 5, 21])
    llm, ours = run_engine(model_dir, prompts, 8, block_size=4, num_kv_blocks=64,
                           max_num_batched_tokens=7)
    assert ours == hf_greedy(model_dir, prompts, 8)
    assert_no_leak(llm)


def test_prefix_cache_hits_shared_system_prompt(hf_checkpoint, hf_greedy):
    model_dir = hf_checkpoint("qwen2")
    system = random_prompts(3, 200, [24])[0]
    tails = random_prompts(4, 200, [3, 6, 9])
    prompts = [system + t for t in tails]
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=128)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 24 for o in rest)
    assert [o.token_ids for o in first + rest] == hf_greedy(model_dir, prompts, 6)
    assert_no_leak(llm)


def test_preemption_with_tiny_pool(hf_checkpoint, hf_greedy):
    model_dir = hf_checkpoint("llama")
    prompts = random_prompts(5, 200, [10, 12, 14, 9])
    llm, ours = run_engine(model_dir, prompts, 20, block_size=4, num_kv_blocks=16)
    assert llm.engine.scheduler.num_preemptions > 0
    assert ours == hf_greedy(model_dir, prompts, 20)
    assert_no_leak(llm)


def test_sliding_window_past_the_window(hf_checkpoint, hf_greedy):
    model_dir = hf_checkpoint("mistral")
    window = transformers.AutoConfig.from_pretrained(model_dir).sliding_window
    prompts = random_prompts(6, 200, [window * 2 + 3, 5])
    llm, ours = run_engine(model_dir, prompts, window + 6, block_size=4, num_kv_blocks=64,
                           max_num_batched_tokens=9)
    assert ours == hf_greedy(model_dir, prompts, window + 6)
    assert_no_leak(llm)
