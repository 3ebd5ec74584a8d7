"""The check the fault tests apply to streams (``pdserve.testing.draw_check``), on the chaos
tests' own workload, offline.

Batched, a seeded request's logits differ from the same request alone in the last bits, so its
tokens may flip where a draw sits on a rounding boundary; the check accepts those and nothing
else. These tests show it accepts the engine's streams, alone and batched, and fails the faults
a migration could cause: a lost token, a repeated one, a draw keyed to the wrong seed, a short
stream."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve import LLM, SamplingParams
from pdserve.bench.failover import chaos_requests
from pdserve.testing.draw_check import draw_problems


@pytest.fixture(scope="module")
def workload(hf_checkpoint):
    model = str(hf_checkpoint("qwen2", max_position_embeddings=2048))
    requests = chaos_requests(16, seed=sum(map(ord, "raise")), prefix="raise", min_tokens=96,
                              max_tokens=128)
    # one more, penalized: the check applies penalties as the sampler does
    penalized = dataclasses.replace(requests[1], sampling={
        **requests[1].sampling, "presence_penalty": 0.5, "repetition_penalty": 1.3})
    pairs = [(r.prompt, SamplingParams(**r.sampling)) for r in [*requests, penalized]]
    llm = LLM(model, dtype="float32", block_size=4, num_kv_blocks=1024,
              max_num_batched_tokens=32)
    together = llm.generate([p for p, _ in pairs], [q for _, q in pairs], use_tqdm=False)
    return model, pairs, [o.token_ids for o in together]


def test_batched_streams_are_their_requests_draws(workload):
    model, requests, streams = workload
    assert draw_problems(model, requests, streams) == []


def test_a_stream_alone_is_its_draws(workload):
    model, requests, _ = workload
    llm = LLM(model, dtype="float32", block_size=16, num_kv_blocks=256)
    alone = [llm.generate([prompt], params, use_tqdm=False)[0].token_ids
             for prompt, params in requests[:4]]
    assert draw_problems(model, requests[:4], alone) == []


@pytest.mark.parametrize("index", [2, 1], ids=["greedy", "seeded"])
def test_a_lost_or_repeated_token_is_caught(workload, index):
    model, requests, streams = workload
    tokens = streams[index]
    # a lost token inside a run of one token does not show: cut where three neighbours differ
    j = next(j for j in range(40, len(tokens) - 1) if len(set(tokens[j - 1:j + 2])) == 3)
    lost = tokens[:j] + tokens[j + 1:] + [tokens[-1]]
    repeated = tokens[:j] + [tokens[j]] + tokens[j:-1]
    problems = draw_problems(model, [requests[index]] * 2, [lost, repeated])
    assert [p.split(" is ")[0] for p in problems] == [f"stream 0: token {j} ({tokens[j + 1]})",
                                                     f"stream 1: token {j + 1} ({tokens[j]})"]


def test_another_seed_a_missing_penalty_or_a_short_stream_is_caught(workload):
    model, requests, streams = workload
    prompt, params = requests[1]
    other_seed = (prompt, dataclasses.replace(params, seed=7))
    unpenalized = (prompt, requests[1][1])  # the penalized request's stream, checked without
    short = streams[1][:-1]
    problems = draw_problems(model, [other_seed, unpenalized, requests[1]],
                             [streams[1], streams[-1], short])
    assert all(p.startswith(f"stream {i}: token ") for i, p in enumerate(problems[:2]))
    assert problems[2] == f"stream 2: {len(short)} tokens, expected max_tokens={params.max_tokens}"
