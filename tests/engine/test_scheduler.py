"""Scheduler lifecycles driven by a scripted fake runner; every test ends in a leak check."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.kv_cache.block_manager import BlockManager
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.step.scheduler import (
    DecodePolicy,
    PrefillOnlyPolicy,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from pdserve.testing.general_steps import general_steps
from pdserve.worker_api.sampling_params import SamplingParams

TOKEN = 7  # what the fake runner samples
_created: list[Scheduler] = []


@pytest.fixture(autouse=True)
def leak_check():
    _created.clear()
    yield
    for sched in _created:
        bm = sched.block_manager
        assert not sched.has_unfinished, "a test left requests in the scheduler"
        assert bm.num_used_blocks == 0, f"{bm.num_used_blocks} blocks leaked"
        bm.check_invariants()


def make_sched(num_blocks=64, block_size=4, budget=32, max_seqs=8, max_model_len=256,
               chunked=True, window=None, policy=None, prefix_caching=True) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                             max_model_len=max_model_len, enable_chunked_prefill=chunked)
    sched = Scheduler(config, BlockManager(num_blocks, block_size, prefix_caching, window),
                      general_steps(policy))  # (step() below reads the general shape)
    _created.append(sched)
    return sched


def req(request_id: str, prompt: int | list[int], max_tokens: int = 4) -> Sequence:
    token_ids = list(range(1000, 1000 + prompt)) if isinstance(prompt, int) else list(prompt)
    return Sequence(request_id, token_ids, SamplingParams(max_tokens=max_tokens, temperature=0))


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step: schedule, 'run', update, sample TOKEN, finish on max_tokens."""
    cfg, bm = sched.config, sched.block_manager
    out = sched.schedule()
    assert out.num_batched_tokens == sum(i.num_new_tokens for i in out.chunks)
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(out.chunks) <= cfg.max_num_seqs
    assert len({id(i.seq) for i in out.chunks}) == len(out.chunks)
    for item in out.chunks:
        assert item.num_new_tokens >= 1 and item.seq.status == SequenceStatus.RUNNING
        assert len(item.seq.block_table) * bm.block_size >= item.start + item.num_new_tokens
    sched.update(out)
    for item in out.chunks:
        if item.samples:
            item.seq.append_token(TOKEN)
            if item.seq.num_output_tokens >= item.seq.sampling_params.max_tokens:
                sched.finish(item.seq, SequenceStatus.FINISHED_LENGTH)
    bm.check_invariants()
    return out


def run_all(sched: Scheduler, max_steps: int = 2000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished:
        outs.append(step(sched))
        assert len(outs) < max_steps, "scheduler made no progress"
    return outs


def test_budget_and_seat_limits_hold_and_everyone_finishes():
    sched = make_sched(budget=16, max_seqs=4)
    seqs = [req(f"r{i}", 5 + 3 * i, max_tokens=3 + i % 4) for i in range(12)]
    for seq in seqs:
        sched.add(seq)
    outs = run_all(sched)
    assert max(o.num_batched_tokens for o in outs) == 16
    for seq in seqs:
        assert seq.status == SequenceStatus.FINISHED_LENGTH
        assert seq.output_token_ids == [TOKEN] * seq.sampling_params.max_tokens
        assert seq.first_scheduled_time is not None


def test_chunked_prefill_splits_a_long_prompt():
    sched = make_sched(budget=16)
    seq = req("long", 50, max_tokens=2)
    sched.add(seq)
    outs = run_all(sched)
    assert [o.chunks[0].num_new_tokens for o in outs] == [16, 16, 16, 2, 1]
    assert [o.chunks[0].samples for o in outs] == [False, False, False, True, True]
    assert [o.chunks[0].start for o in outs] == [0, 16, 32, 48, 50]


def test_without_chunking_a_prompt_waits_for_a_step_it_fits():
    sched = make_sched(budget=64, max_model_len=64, chunked=False)
    a, b = req("a", 40), req("b", [5] * 30)  # no shared prefix
    sched.add(a)
    sched.add(b)
    first = step(sched)
    assert [(i.seq.request_id, i.num_new_tokens) for i in first.chunks] == [("a", 40)]
    second = step(sched)
    assert [(i.seq.request_id, i.num_new_tokens) for i in second.chunks] == [("a", 1),
                                                                                ("b", 30)]
    run_all(sched)


def computed_elsewhere(bm: BlockManager, request_id: str, prompt: int | list[int],
                       max_tokens: int) -> Sequence:
    """A sequence whose prompt KV sits in bm's blocks with token 0 sampled (decode side)."""
    seq = req(request_id, prompt, max_tokens)
    bm.match_prefix(seq)
    bm.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    seq.append_token(TOKEN)
    return seq


def test_decodes_are_scheduled_before_prefill_chunks():
    sched = make_sched(budget=16)
    long = req("long", 60)
    sched.add(long)
    step(sched)  # the long prompt takes the whole budget
    decoding = computed_elsewhere(sched.block_manager, "dec", 6, max_tokens=4)
    sched.add_running(decoding)  # joins the running list behind the partial prefill
    out = step(sched)
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.chunks] == [("dec", 1),
                                                                             ("long", 15)]
    run_all(sched)
    assert decoding.output_token_ids == [TOKEN] * 4


def test_preemption_takes_the_tail_which_recomputes_and_finishes():
    sched = make_sched(num_blocks=6, block_size=4, budget=64, max_seqs=2)
    a, b, c = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8), req("c", [3] * 4)
    for seq in (a, b, c):
        sched.add(seq)
    outs = []
    while not any(o.preempted for o in outs):
        outs.append(step(sched))
    preempting = outs[-1]
    assert preempting.preempted == [b] and list(sched.waiting) == [b, c]  # b goes first
    outs += run_all(sched)
    preempting = [o for o in outs if o.preempted]
    assert [i.seq.request_id for i in preempting[0].chunks] == ["a"]  # no admission then
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert sched.num_preemptions == b.num_preemptions
    # b's recompute covers prompt + generated tokens and ends in a sample.
    after = outs[outs.index(preempting[0]) + 1:]
    recompute = next(i for o in after for i in o.chunks if i.seq is b)
    assert recompute.start == b.num_cached_tokens and recompute.samples
    for seq in (a, b):
        assert seq.output_token_ids == [TOKEN] * 8
        assert seq.status == SequenceStatus.FINISHED_LENGTH


def test_a_sequence_preempts_itself_when_it_is_the_only_candidate():
    sched = make_sched(num_blocks=4, block_size=4, budget=64)
    seq = req("a", 6, max_tokens=6)
    sched.add(seq)
    step(sched)  # prompt computed: 2 blocks (room up to position 7), token 0 sampled
    outsider = req("held", 8)  # blocks held outside the scheduler (e.g. a KV reservation)
    sched.block_manager.allocate(outsider, 8)
    step(sched)
    step(sched)  # positions 6 and 7 still fit
    out = step(sched)  # position 8 needs a third block: none left
    assert out.preempted == [seq] and out.is_empty
    assert seq.status == SequenceStatus.WAITING and list(sched.waiting) == [seq]
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert step(sched).is_empty  # still no room: it waits, nothing leaks
    sched.block_manager.free(outsider)
    run_all(sched)
    assert seq.output_token_ids == [TOKEN] * 6


def test_refusals_name_the_field_and_limit():
    sched = make_sched(num_blocks=8, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt length \(64\).*max_model_len - 1 \(63\)"):
        sched.add(req("too-long", 64))
    with pytest.raises(ValueError, match=r"max_tokens.*9 KV blocks.*8 blocks"):
        sched.add(req("too-big", 20, max_tokens=16))
    sched.add(req("fits", 20, max_tokens=12))
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add(req("fits", 4))
    assert sched.abort("fits") is not None
    windowed = make_sched(num_blocks=4, block_size=4, max_model_len=64, window=8)
    windowed.add(req("long-but-windowed", 40, max_tokens=20))  # ceil(8 / 4) + 2 = 4 blocks
    windowed.abort("long-but-windowed")
    decode = make_sched(policy=DecodePolicy())
    with pytest.raises(ValueError, match="block_table"):
        uncovered = req("u", 4)
        uncovered.num_computed_tokens = 4
        decode.add_running(uncovered)
    with pytest.raises(ValueError, match="running"):
        make_sched(policy=PrefillOnlyPolicy()).add_running(req("x", 4))


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_num_seqs=0, max_model_len=16), "max_num_seqs"),
    (dict(max_num_batched_tokens=0, max_model_len=16), "max_num_batched_tokens"),
    (dict(max_model_len=1), "max_model_len"),
    (dict(max_model_len=4096, enable_chunked_prefill=False), "max_num_batched_tokens"),
    (dict(max_model_len=16, enable_chunked_prefill=1), "enable_chunked_prefill"),
])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


def test_abort_is_idempotent_in_every_state():
    sched = make_sched(budget=8)
    waiting, prefilling, done = req("w", 30), req("p", 30), req("d", 3, max_tokens=1)
    sched.add(done)
    run_all(sched)
    sched.add(prefilling)
    step(sched)
    sched.add(waiting)
    assert prefilling.status == SequenceStatus.RUNNING and 0 < prefilling.num_computed_tokens < 30
    assert waiting.status == SequenceStatus.WAITING
    for seq in (waiting, prefilling):
        assert sched.abort(seq.request_id) is seq
        assert seq.status == SequenceStatus.FINISHED_ABORTED and seq.block_table == []
        assert sched.abort(seq.request_id) is None
    assert sched.abort("d") is None and done.status == SequenceStatus.FINISHED_LENGTH
    assert sched.abort("never-seen") is None
    assert sched.num_waiting == sched.num_running == 0


def test_abort_between_schedule_and_update():
    sched = make_sched()
    seq = req("a", 10)
    sched.add(seq)
    out = sched.schedule()
    sched.abort("a")
    sched.update(out)  # skips the aborted sequence
    assert seq.num_computed_tokens == 0
    assert seq.status == SequenceStatus.FINISHED_ABORTED and seq.block_table == []
    sched.finish(seq, SequenceStatus.FINISHED_STOPPED)  # late finish keeps the first status
    assert seq.status == SequenceStatus.FINISHED_ABORTED


def test_shared_system_prompt_hits_the_prefix_cache():
    sched = make_sched(block_size=4, budget=64)
    system = list(range(500, 532))  # 8 full blocks
    first = req("first", system + [1, 2, 3])
    sched.add(first)
    step(sched)  # first's prompt is computed and cached
    second = req("second", system + [4, 5])
    sched.add(second)
    out = step(sched)
    chunk = next(i for i in out.chunks if i.seq is second)
    assert second.num_cached_tokens == 32 and (chunk.start, chunk.num_new_tokens) == (32, 2)
    assert second.block_table[:8] == first.block_table[:8]
    bm = sched.block_manager
    assert bm.num_prefix_hit_tokens == 32 and bm.num_prefix_queries == 2
    run_all(sched)
    late = req("late", system + [9])  # both gone: the prefix waits in the cache
    sched.add(late)
    run_all(sched)
    assert late.num_cached_tokens == 32 and bm.num_prefix_hit_tokens == 64


def test_sliding_window_generation_runs_in_a_pool_of_window_blocks():
    sched = make_sched(num_blocks=4, block_size=4, budget=32, max_model_len=128, window=8)
    seq = req("a", 30, max_tokens=40)
    sched.add(seq)
    outs = run_all(sched)
    # The 30-token chunk needs 8 blocks at once: alone, it shrinks to what 4 blocks hold.
    assert [o.num_batched_tokens for o in outs[:3]] == [16, 8, 6]
    assert seq.output_token_ids == [TOKEN] * 40
    assert sched.num_preemptions == 0
    assert sum(o.num_batched_tokens for o in outs) == 30 + 39


def test_prefill_only_policy_hands_off_after_the_prompt():
    sched = make_sched(budget=8, policy=PrefillOnlyPolicy())
    seq = req("a", 20)
    sched.add(seq)
    outs = [step(sched) for _ in range(3)]
    assert outs[-1].chunks[0].samples and seq.output_token_ids == [TOKEN]
    assert step(sched).is_empty  # prompt done: never decoded here
    sched.hand_off(seq)
    assert seq.status == SequenceStatus.SENDING_KV and not sched.has_unfinished
    assert sched.block_manager.num_used_blocks == 5  # the KV sender owns them now
    sched.finish(seq, SequenceStatus.FINISHED_STOPPED)  # send done: blocks go back
    assert seq.block_table == []


def test_decode_only_policy_continues_committed_sequences():
    sched = make_sched(num_blocks=7, block_size=4, policy=DecodePolicy())
    seqs = [computed_elsewhere(sched.block_manager, f"r{i}", 9, max_tokens=6) for i in range(2)]
    for seq in seqs:
        sched.add_running(seq)
    outs = run_all(sched)  # 7 blocks for 2 x 14 tokens of KV: one is handed back, not recomputed
    bounced = [s for o in outs for s in o.bounced]
    assert sched.num_bounces == sched.num_preemptions == len(bounced) == 1
    assert bounced[0].status == SequenceStatus.FINISHED_ABORTED and not bounced[0].block_table
    survivor = next(s for s in seqs if s is not bounced[0])
    assert survivor.output_token_ids == [TOKEN] * 6
    assert all(item.num_new_tokens == 1 for o in outs for item in o.chunks)  # no prefill


def test_running_sequences_beyond_max_num_seqs_take_turns():
    sched = make_sched(max_seqs=1, policy=DecodePolicy())
    seqs = [computed_elsewhere(sched.block_manager, f"r{i}", [i] * 5, max_tokens=3)
            for i in range(2)]
    for seq in seqs:
        sched.add_running(seq)
    outs = run_all(sched)
    assert all(len(o.chunks) == 1 for o in outs) and len(outs) == 4


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "step", "abort"]), st.integers(0, 9),
                              st.integers(1, 40), st.integers(1, 16)), max_size=40),
       num_blocks=st.integers(6, 24), budget=st.integers(4, 48),
       window=st.none() | st.integers(4, 16), chunked=st.booleans())
def test_random_traffic_keeps_invariants(ops, num_blocks, budget, window, chunked):
    if not chunked:
        budget = 128
    sched = make_sched(num_blocks=num_blocks, block_size=4, budget=budget, max_seqs=4,
                       max_model_len=128, chunked=chunked, window=window)
    _created.remove(sched)  # checked below: the fixture runs once per test, not per example
    system = list(range(200, 224))
    for i, (op, who, length, max_tokens) in enumerate(ops):
        if op == "add":
            try:
                sched.add(req(f"q{i}", system[:length % 25] + [i] * (length // 3 + 1),
                              max_tokens))
            except ValueError:
                pass
        elif op == "step":
            step(sched)
        else:
            sched.abort(f"q{who}")
    run_all(sched)
    assert sched.block_manager.num_used_blocks == 0
    sched.block_manager.check_invariants()
