"""Speculative decoding on the workers: a decode worker (KV from the prefill worker, the draft's
KV caught up from token ids) and a colocated worker give Hugging Face's greedy tokens on every
family with each method, leave no block behind, and report the counters in their stats."""

from __future__ import annotations

import random
import time

import pytest

from pdserve import SamplingParams
from pdserve.colocated_worker.worker import ColocatedWorker
from pdserve.worker_api import WorkRequest
from pdserve.workers.build import build_worker

from .conftest import engine_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
MAX_TOKENS = [10, 10, 2, 10]  # the 2-token request never speculates


def specs(hf_checkpoint, family: str, overrides: dict) -> list[dict]:
    draft = hf_checkpoint(family, **{**overrides, "num_hidden_layers": 1})
    return [NGRAM, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}]


def prompts_for(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 17, 9)] + [[7, 8, 9] * 6]


def colocated_generate(worker: ColocatedWorker, prompts, params, timeout: float = 60.0):
    """Every prompt at once (one mixed batch); returns the tokens of each. The requests are
    added in one call on the loop thread, so every run steps the same batches (one submit at a
    time would let the loop step between them, and the batch shapes, hence float rounding near
    a tie, would vary from run to run)."""
    tokens = {f"c{i}": [] for i in range(len(prompts))}
    requests = [WorkRequest(f"c{i}", prompt, p, seed=i, arrival_time=time.time())
                for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))]
    worker.loop.call(lambda: [worker.engine.add_work(r) for r in requests]).result(10)
    pending, deadline = set(tokens), time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for delta in worker.poll(0.2):
            tokens[delta.request_id] += delta.new_token_ids
            if delta.finish_reason is not None:
                assert delta.finish_reason == "length"
                pending.discard(delta.request_id)
    assert not pending
    return [tokens[f"c{i}"] for i in range(len(prompts))]


def test_decode_and_colocated_workers_greedy_equal_hf(hf_checkpoint, family_params, hf_model,
                                                      make_pair, hf_greedy):
    prompts = prompts_for(0)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    for family, overrides in family_params:
        model_dir = hf_checkpoint(family, **overrides)
        model = hf_model(model_dir)
        expected = [t[:m] for t, m in zip(hf_greedy(model, prompts, max(MAX_TOKENS)),
                                           MAX_TOKENS, strict=True)]
        for spec in specs(hf_checkpoint, family, overrides):
            label = f"{family} {overrides} {spec['method']}"
            pair = make_pair(model_dir, speculative_config=spec)
            got = [pair.generate(f"r{i}", p, sp)[0]
                   for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
            assert got == expected, f"disaggregated {label}"
            assert pair.used_blocks() == (0, 0), label
            decode = pair.decode.stats().result(10)
            assert decode.spec_num_drafts > 0, label
            assert pair.prefill.stats().result(10).spec_num_drafts == 0  # it never speculates
            assert pair.prefill.engine.speculator is None
            assert pair.prefill.engine.parts.ledger.draft_bytes == 0  # no room kept for it
            pair.close()
            worker = build_worker("colocated", f"c-{family}",
                                  engine_config(model_dir, speculative_config=spec))
            try:
                assert colocated_generate(worker, prompts, params) == expected, \
                    f"colocated {label}"
                stats = worker.stats().result(10)
                assert stats.used_blocks == 0 and stats.spec_num_drafts > 0, label
            finally:
                worker.close()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_decode_worker_seeded_sampling_equals_offline(hf_checkpoint, make_pair, method):
    """Sampling keyed by (seed, position): the decode worker's speculative tokens equal the
    offline engine's with the same seed and the same speculative config."""
    from pdserve import LLM

    model_dir = hf_checkpoint("llama")
    spec = specs(hf_checkpoint, "llama", {})[method == "draft_model"]
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, ignore_eos=True)
    prompt = prompts_for(1)[3]
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=128,
              speculative_config=spec)
    llm.engine.add_request("x", prompt, params, seed=1234)  # the seed Pair.generate uses
    offline = []
    while llm.engine.has_unfinished_requests():
        offline += [t for d in llm.engine.render(llm.engine.step()) for t in d.new_token_ids]
    pair = make_pair(model_dir, speculative_config=spec)
    tokens, reason = pair.generate("s", prompt, params)
    assert reason == "length" and tokens == offline
    assert pair.used_blocks() == (0, 0)
