"""``n`` and ``best_of`` in the engine: a request forks into its sequences after one prefill;
they share the prompt's full KV blocks (one copy, by reference count), each samples with its
own random stream, and each equals the offline engine run alone with that stream's seed."""

from __future__ import annotations

import re

import pytest

from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import Sequence
from pdserve.streaming_worker.mailboxes import RouterMailboxes
from pdserve.worker_api import (
    NeverFits,
    RequestDelta,
    StepDeltas,
    WorkRequest,
    choice_request_id,
    split_choice,
)
from pdserve.worker_api.sampling_params import MAX_N, SamplingParams, child_seed

PROMPT = [5, 6, 7, 9, 10, 11, 12, 40, 41, 77]  # 10 tokens: 2 full blocks of 4, 2 left


@pytest.fixture(scope="module")
def llm(tiny_dir):
    with LLM(str(tiny_dir), num_kv_blocks=64, block_size=4) as engine:
        yield engine


def sampled(seed: int | None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 12), temperature=1.0, seed=seed, **kw)


def test_n_and_best_of_are_checked():
    assert SamplingParams().n == 1 and SamplingParams().num_sequences == 1
    assert SamplingParams(n=2, best_of=5).num_sequences == 5
    for kw, message in [(dict(n=0), "n must be >= 1"), (dict(n=-1), "n must be >= 1"),
                        (dict(n=2**63), f"n must be <= {MAX_N}"), (dict(n=1.0), "n must be an"),
                        (dict(n=True), "n must be an integer"),
                        (dict(n=3, best_of=2), "best_of must be >= n (3), got 2"),
                        (dict(best_of=0), "best_of must be >= 1"),
                        (dict(best_of=MAX_N + 1), f"best_of must be <= {MAX_N}")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            SamplingParams(**kw)


def test_child_seeds_and_ids():
    assert child_seed(7, 0) == 7
    seeds = {child_seed(7, i) for i in range(1, MAX_N)}
    assert len(seeds) == MAX_N - 1 and all(-(2**63) <= s < 2**63 for s in seeds)
    assert child_seed(7, 3) == child_seed(7, 3) != child_seed(8, 3)
    assert choice_request_id("abc", 0) == "abc"
    assert split_choice(choice_request_id("abc", 3)) == ("abc", 3)
    assert split_choice("abc") == ("abc", 0) and split_choice("a#b") == ("a#b", 0)
    assert split_choice("a#0") == ("a#0", 0) and split_choice("a#07") == ("a#07", 0)


def test_each_of_n_equals_the_engine_run_with_its_seed(llm):
    outs = llm.generate(PROMPT, sampled(1234, n=4), use_tqdm=False)
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert len({o.request_id for o in outs}) == 1
    assert len({tuple(o.token_ids) for o in outs}) > 1  # (random weights: distinct streams)
    for out in outs:
        alone = llm.generate(PROMPT, sampled(child_seed(1234, out.index)), use_tqdm=False)[0]
        assert out.token_ids == alone.token_ids, out.index
        assert out.text == alone.text and out.finish_reason == alone.finish_reason


def test_greedy_n_gives_n_equal_outputs(llm):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PROMPT, params, use_tqdm=False)[0]
    outs = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0, n=4,
                                               ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == [alone.token_ids] * 4


def test_best_of_returns_the_n_of_highest_cumulative_logprob(llm):
    every = llm.generate(PROMPT, sampled(99, n=5, logprobs=0), use_tqdm=False)
    best = llm.generate(PROMPT, sampled(99, n=2, best_of=5), use_tqdm=False)
    ranked = sorted(every, key=lambda o: o.cumulative_logprob, reverse=True)
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked[:2]]
    assert [o.index for o in best] == [0, 1]
    assert all(o.logprobs is None for o in best)  # (not asked for)


def step_until(engine: LLMEngine, done) -> None:
    for _ in range(200):
        if done():
            return
        engine.step()
    raise AssertionError("the engine did not get there")


def test_the_prompt_blocks_are_one_copy_and_abort_frees_every_sequence(tiny_dir):
    with LLM(str(tiny_dir), num_kv_blocks=64, block_size=4,
             enable_prefix_caching=False) as offline:
        engine = offline.engine
        bm = engine.parts.block_manager
        parent = engine.add_request("r", PROMPT, sampled(5, n=4, max_tokens=40,
                                                         ignore_eos=True))
        step_until(engine, lambda: engine.num_requests == 4)
        children = [engine.scheduler.get(choice_request_id("r", i)) for i in range(1, 4)]
        assert all(isinstance(c, Sequence) for c in children)
        assert [c.index for c in children] == [1, 2, 3]
        shared = parent.block_table[:2]  # the prompt's 2 full blocks: one copy, 4 holders
        for child in children:
            assert child.block_table[:2] == shared
            assert child.num_cached_tokens == 8
        assert [bm.ref_count(b) for b in shared] == [4, 4]
        step_until(engine, lambda: all(c.num_output_tokens >= 2 for c in children))
        # each sequence has its own third block (the prompt's partial one and on)
        thirds = {s.block_table[2] for s in [parent, *children]}
        assert len(thirds) == 4
        assert bm.num_used_blocks == 2 + sum(len(s.block_table) - 2
                                             for s in [parent, *children])
        engine.abort("r")
        assert engine.num_requests == 0 and not engine.has_unfinished_requests()
        assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
        bm.check_invariants()


def test_a_sequence_ending_early_keeps_the_shared_blocks_of_the_others(llm):
    """max_tokens 1: every sequence ends at its first token, the blocks all come back."""
    bm = llm.engine.parts.block_manager
    outs = llm.generate(PROMPT, sampled(3, n=3, max_tokens=1), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [1, 1, 1]
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_structured_outputs_give_each_sequence_its_own_matcher(llm):
    params = sampled(11, n=3, max_tokens=20, structured_outputs={"regex": "[a-c]{3}-[0-9]{2}"})
    outs = llm.generate(PROMPT, params, use_tqdm=False)
    for out in outs:
        alone = llm.generate(PROMPT, sampled(child_seed(11, out.index), max_tokens=20,
                                             structured_outputs={"regex": "[a-c]{3}-[0-9]{2}"}),
                             use_tqdm=False)[0]
        assert out.text == alone.text and len(out.text) == 6


def test_a_forked_request_never_resumes_elsewhere(llm):
    request = WorkRequest("m", PROMPT, sampled(1, n=2), seed=1, arrival_time=0.0,
                          output_token_ids=[3])
    with pytest.raises(NeverFits, match="^n: a request forked"):
        llm.engine.sequence_for(request)


def test_every_sequence_ends_with_a_final_delta(tiny_dir):
    """expire, abort_all and abort_request end each forked sequence with its own final delta
    (a worker's mailboxes end each sequence's owner entry with it); before the fork, only
    the request's own."""
    with LLM(str(tiny_dir), num_kv_blocks=64, block_size=4) as offline:
        engine = offline.engine
        params = sampled(5, n=3, max_tokens=40, ignore_eos=True)
        engine.add_request("early", PROMPT, params)
        assert [d.request_id for d in engine.abort_request("early")] == ["early"]
        for end in ("expire", "abort_all", "abort_request"):
            seq = engine.add_request("r", PROMPT, params)
            step_until(engine, lambda: engine.num_requests == 3)
            if end == "expire":
                for s in [seq, *(engine.scheduler.get(choice_request_id("r", i))
                                 for i in (1, 2))]:
                    s.deadline = 0.0
                deltas = engine.expire(1.0)
                assert all(d.deadline_exceeded for d in deltas)
            elif end == "abort_all":
                deltas = engine.abort_all("gone")
                assert all(d.error == "gone" for d in deltas)
            else:
                deltas = engine.abort_request("r")
            assert sorted(d.request_id for d in deltas) == ["r", "r#1", "r#2"], end
            assert all(d.finish_reason == "abort" for d in deltas)
            assert engine.num_requests == 0
            assert engine.parts.block_manager.num_used_blocks == 0


def test_forks_belong_to_the_requests_router():
    boxes = RouterMailboxes()
    boxes.claim("r.1", 1, "router-a")
    boxes.claim_forks("r.1", ["r.1#1", "r.1#2"])
    boxes.claim_forks("unknown", ["unknown#1"])  # (no owner: nothing claimed)
    assert boxes.sizes().num_owned == 3
    deltas = StepDeltas([RequestDelta("r.1#1", [4], "", "stop", attempt=1),
                         RequestDelta("r.1#2", [5], "", None, attempt=1)])
    assert not boxes.sort(deltas, "router-b")  # router-a's, boxed for it
    assert [d.request_id for d in boxes.take("router-a")] == ["r.1#1", "r.1#2"]
    assert boxes.sizes().num_owned == 2  # r.1#1's final delta ended its entry


@pytest.mark.parametrize("prompt_len, num_shared_blocks", [(10, 2), (27, 0)])
def test_forks_under_a_sliding_window(hf_checkpoint, prompt_len, num_shared_blocks):
    """Mistral, window 8, blocks of 4: a prompt inside the window forks sharing its full
    blocks; one past it, whose parent freed the blocks a fork's first queries still need,
    forks sharing none (each computes the prompt). Each equals its seed run alone."""
    with LLM(str(hf_checkpoint("mistral")), dtype="float32", num_kv_blocks=64, block_size=4,
             enable_prefix_caching=False) as windowed:
        engine, prompt = windowed.engine, list(range(3, 3 + prompt_len))
        engine.add_request("w", prompt, sampled(8, n=3, ignore_eos=True))
        step_until(engine, lambda: engine.num_requests == 3)
        child = engine.scheduler.get(choice_request_id("w", 1))
        assert child.num_cached_tokens == 4 * num_shared_blocks
        engine.abort("w")
        outs = windowed.generate(prompt, sampled(8, n=3, ignore_eos=True), use_tqdm=False)
        for out in outs:
            alone = windowed.generate(prompt, sampled(child_seed(8, out.index), ignore_eos=True),
                                      use_tqdm=False)[0]
            assert out.token_ids == alone.token_ids, out.index
        bm = windowed.engine.parts.block_manager
        assert bm.num_used_blocks == 0
        bm.check_invariants()
