"""``SchedulerConfig.prefill_batch_tokens``: a step admits a further waiting prompt only while
its prompt tokens stay within the bound, so prompts that arrive together take their first
tokens in turn instead of all at the end of one long step; the step's first prompt always
goes, whatever its length; None (the default) bounds nothing but the step's budget."""

from __future__ import annotations

import pytest

from pdserve import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache.block_manager import BlockManager
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parts import EngineParts
from pdserve.engine.sequence import SequenceStatus
from pdserve.engine.step.scheduler import Scheduler, SchedulerConfig
from pdserve.testing.general_steps import general_steps

from .test_admission_hold import decoding, ids, prompt, run_all, step
from .test_scheduler import req


def make(bound: int | None, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256,
                             prefill_batch_tokens=bound)
    return Scheduler(config, BlockManager(64, 4, True, None), general_steps())


def test_prompts_that_arrive_together_prefill_a_bound_at_a_time():
    sched = make(bound=12)
    for name in ("p1", "p2", "p3", "p4", "p5"):
        sched.add(req(name, prompt(name, 6), max_tokens=3))
    assert ids(step(sched)) == [("p1", 6), ("p2", 6)]
    # the first two decode beside the next two prompts
    assert ids(step(sched)) == [("p1", 1), ("p2", 1), ("p3", 6), ("p4", 6)]
    assert ids(step(sched)) == [("p1", 1), ("p2", 1), ("p3", 1), ("p4", 1), ("p5", 6)]
    outs = run_all(sched)
    assert all(out.num_batched_tokens <= 12 + 8 for out in outs)


def test_without_a_bound_every_prompt_that_fits_goes_in_one_step():
    sched = make(bound=None)
    for name in ("p1", "p2", "p3", "p4", "p5"):
        sched.add(req(name, prompt(name, 6), max_tokens=3))
    assert ids(step(sched)) == [(f"p{i}", 6) for i in range(1, 6)]
    run_all(sched)


def test_the_first_prompt_goes_whatever_its_length_and_a_chunk_counts():
    sched = make(bound=12, budget=32)
    decoders = decoding(sched, "ab")
    long, short = req("long", prompt("l", 40), max_tokens=2), req("s", prompt("s", 3))
    sched.add(long)
    sched.add(short)
    # the long prompt passes the bound alone (split by the step's budget); the short one waits
    assert ids(step(sched)) == [("a", 1), ("b", 1), ("long", 30)]
    # the long prompt's last chunk (10 tokens) is the step's prompt work: 3 more pass 12
    assert ids(step(sched)) == [("a", 1), ("b", 1), ("long", 10)]
    assert short.status == SequenceStatus.WAITING
    assert ("s", 3) in ids(step(sched))
    run_all(sched)
    assert all(s.status == SequenceStatus.FINISHED_LENGTH for s in [*decoders, long, short])


@pytest.mark.parametrize("bad", [0, -1, 1.5, "8", True])
def test_a_bad_bound_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="prefill_batch_tokens"):
        SchedulerConfig(max_model_len=64, prefill_batch_tokens=bad)
    with pytest.raises(ValueError, match="prefill_batch_tokens"):
        EngineConfig(model="unused", prefill_batch_tokens=bad)


def test_the_engine_gives_the_same_tokens_with_and_without_a_bound(tiny_dir):
    """Greedy tokens do not depend on how prompts were grouped into steps; with a bound the
    first prompt's first token comes before the last prompt is computed."""
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    results = {}
    for bound in (None, 8):
        engine = LLMEngine(EngineParts.build(EngineConfig(model=str(tiny_dir),
                                                          prefill_batch_tokens=bound)))
        for i in range(4):
            engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9, 10], params)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
        first_before_last = False
        while engine.has_unfinished_requests():
            for delta in engine.render(engine.step()):
                tokens[delta.request_id] += delta.new_token_ids
            first_before_last |= bool(tokens["r0"]) and not tokens["r3"]
        results[bound] = (tokens, first_before_last)
    assert results[None][0] == results[8][0]
    assert all(len(t) == 5 for t in results[8][0].values())
    assert results[8][1] and not results[None][1]
