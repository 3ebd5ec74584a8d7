"""A request that makes a step fail fails alone: the batch and the engine go on.

Faults are injected where a step's per-request work runs: the sampler (on the general step,
which samples a request's first token, and on the persistent decode rows, which sample the
rest) and the text/stop stage. The poisoned request ends with an ``abort`` delta marked
``faulted`` (never migrated), the others finish with the very tokens of a clean run, and every
block comes back.
"""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.sampling.sampler import Sampler
from pdserve.engine.sampling.seeded_uniforms import seed_key
from pdserve.worker_api import RequestDelta

POISON_SEED = 2
SEEDS = (1, POISON_SEED, 3, 4)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def llm(hf_checkpoint):
    return LLM(str(hf_checkpoint("llama")), block_size=4, num_kv_blocks=64, max_model_len=64)


def run(engine) -> dict[str, list[RequestDelta]]:
    for seed in SEEDS:
        engine.add_request(f"r{seed}", [5, 6, 7, seed],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=seed,
                                          ignore_eos=True))
    deltas: dict[str, list[RequestDelta]] = {f"r{seed}": [] for seed in SEEDS}
    for _ in range(4 * MAX_TOKENS):
        if not engine.has_unfinished_requests():
            break
        for delta in engine.render(engine.step()):
            deltas[delta.request_id].append(delta)
    return deltas


def tokens(deltas: list[RequestDelta]) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


@pytest.fixture(scope="module")
def clean(llm):
    return {rid: tokens(ds) for rid, ds in run(llm.engine).items()}


def assert_only_the_poisoned_one_failed(llm, deltas, clean):
    last = deltas["r2"][-1]
    assert last.finish_reason == "abort" and last.faulted
    assert "injected" in last.error and "failed in the engine" in last.error
    for seed in SEEDS:
        if seed != POISON_SEED:
            rid = f"r{seed}"
            assert deltas[rid][-1].finish_reason == "length" and not deltas[rid][-1].faulted
            assert tokens(deltas[rid]) == clean[rid]
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.parts.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("position", [0, 3], ids=["first-token-general-step", "decode-rows"])
def test_a_sampler_failure_fails_only_its_request(llm, clean, monkeypatch, position):
    sample = Sampler.sample
    poison = seed_key(POISON_SEED)

    def poisoned(self, logits, batch):
        hit = (batch.seed_keys == poison) & (batch.positions == position)
        if hit.any():
            raise OverflowError("injected: the poisoned row")
        return sample(self, logits, batch)

    monkeypatch.setattr(Sampler, "sample", poisoned)
    deltas = run(llm.engine)
    assert_only_the_poisoned_one_failed(llm, deltas, clean)
    # it failed where it was poisoned: exactly ``position`` tokens reached the client
    assert len(tokens(deltas["r2"])) == position


def test_a_text_stage_failure_fails_only_its_request(llm, clean, monkeypatch):
    text = llm.engine.text
    append = type(text).append

    def poisoned(self, request_id, token_id):
        if request_id == "r2":
            raise UnicodeError("injected: the poisoned text")
        return append(self, request_id, token_id)

    monkeypatch.setattr(type(text), "append", poisoned)
    deltas = run(llm.engine)
    assert_only_the_poisoned_one_failed(llm, deltas, clean)


def test_the_engine_still_matches_a_clean_run_afterwards(llm, clean):
    deltas = run(llm.engine)
    assert {rid: tokens(ds) for rid, ds in deltas.items()} == clean


def test_a_clean_batch_is_sampled_whole(llm, caplog):
    """The per-row fallback runs only on a failure."""
    with caplog.at_level("ERROR"):
        run(llm.engine)
    assert "sampling each row alone" not in caplog.text
