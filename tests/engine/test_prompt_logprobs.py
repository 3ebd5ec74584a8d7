"""Prompt logprobs in the engine (engine/step/prompt_logprobs.py): each prompt token's
log-probability and the top ones at its position equal Hugging Face's fp32 log-softmax of
the prompt (the tiny model; tolerance 1e-4), whether the prompt runs in one chunk or many,
beside requests that do not ask (their tokens unchanged), and with the prefix cache holding
the prompt's blocks (a request that asks computes every position anyway)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.worker_api import WorkRequest
from pdserve.worker_api.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [40, 41, 42, 43, 44, 45, 46],
           [77, 3, 9, 100, 4, 200, 31, 8, 9, 10, 300, 2, 6, 7, 50, 51, 52, 53, 54, 55, 56]]
TOL = 1e-4


@pytest.fixture(scope="module")
def hf(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()

    def logprobs(prompt: list[int]) -> torch.Tensor:  # (len(prompt) - 1, vocab)
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=1)
    return logprobs


def check(prompt: list[int], entries: list, expected: torch.Tensor, num_top: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i, entry in enumerate(entries[1:], 1):
        row = expected[i - 1]
        top = torch.topk(row, num_top).indices.tolist()
        assert set(entry) == {prompt[i], *top}, i
        for token_id, value in entry.items():
            assert abs(value - float(row[token_id])) < TOL, (i, token_id)


def greedy(max_tokens: int = 3, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("chunk_tokens", [512, 8, 3])
def test_prompt_logprobs_equal_hugging_face_in_one_chunk_or_many(tiny_dir, hf, chunk_tokens):
    with LLM(str(tiny_dir), num_kv_blocks=64, block_size=4,
             max_num_batched_tokens=chunk_tokens) as llm:
        outs = llm.generate(PROMPTS, [greedy(prompt_logprobs=k) for k in (0, 2, 5)],
                            use_tqdm=False)
    for prompt, out, k in zip(PROMPTS, outs, (0, 2, 5), strict=True):
        check(prompt, out.prompt_logprobs, hf(prompt), k)


def test_requests_that_do_not_ask_are_unchanged_and_get_none(tiny_dir):
    with LLM(str(tiny_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=8) as llm:
        alone = [o.token_ids for o in llm.generate(PROMPTS, greedy(8), use_tqdm=False)]
        mixed = llm.generate(PROMPTS, [greedy(8), greedy(8, prompt_logprobs=1), greedy(8)],
                             use_tqdm=False)
    assert [o.token_ids for o in mixed] == alone
    assert mixed[0].prompt_logprobs is None and mixed[2].prompt_logprobs is None
    assert len(mixed[1].prompt_logprobs) == len(PROMPTS[1])


def test_a_cached_prefix_is_computed_again_for_a_request_that_asks(tiny_dir, hf):
    with LLM(str(tiny_dir), num_kv_blocks=64, block_size=4) as llm:
        llm.generate(PROMPTS[2], greedy(), use_tqdm=False)  # its blocks now cached
        out = llm.generate(PROMPTS[2], greedy(prompt_logprobs=3), use_tqdm=False)[0]
        assert llm.engine.parts.block_manager.num_prefix_queries > 0
    check(PROMPTS[2], out.prompt_logprobs, hf(PROMPTS[2]), 3)


def test_a_resumed_request_does_not_send_them_again(tiny_dir):
    with LLM(str(tiny_dir), num_kv_blocks=64, block_size=4) as llm:
        engine = llm.engine
        engine.add_work(WorkRequest("resumed", list(PROMPTS[1]), greedy(4, prompt_logprobs=2),
                                    seed=0, arrival_time=0.0, output_token_ids=[9, 10]))
        deltas = []
        while engine.has_unfinished_requests():
            deltas += list(engine.render(engine.step()))
    assert deltas and all(d.prompt_logprobs is None for d in deltas)


def test_prompt_logprobs_are_checked_when_built():
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_a_speculating_engine_scores_prompts_too(tiny_dir, hf):
    with LLM(str(tiny_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=8,
             speculative_config={"method": "ngram", "num_speculative_tokens": 2}) as llm:
        outs = llm.generate(PROMPTS, [greedy(8), greedy(8, prompt_logprobs=2), greedy(8)],
                            use_tqdm=False)
        alone = llm.generate(PROMPTS[1], greedy(8), use_tqdm=False)[0].token_ids
    check(PROMPTS[1], outs[1].prompt_logprobs, hf(PROMPTS[1]), 2)
    assert outs[1].token_ids == alone
