"""Priority scheduling in the engine: admission, preemption victims and prefill chunks follow
(priority, arrival); a long low-priority prompt never blocks a short high-priority one; the
fcfs policy keeps arrival order. Every test ends in a leak check."""

from __future__ import annotations

import pytest

from pdserve import SamplingParams
from pdserve.engine.kv_cache.block_manager import BlockManager
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.step.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.step.scheduling_policy import (
    DecodePolicy,
    PrefillOnlyPolicy,
    SchedulingPolicy,
)
from pdserve.testing.general_steps import general_steps

TOKEN = 7


def make(policy, num_blocks=64, budget=16, max_seqs=8) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                             max_model_len=512)
    return Scheduler(config, BlockManager(num_blocks, 4, True, None), general_steps(policy))


def seq(request_id: str, n: int, priority: int = 0, max_tokens: int = 2,
        arrival: float = 0.0) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, priority=priority)
    s = Sequence(request_id, list(range(100, 100 + n)), params)
    s.arrival_time = arrival
    return s


def step(sched: Scheduler):
    out = sched.schedule()
    sched.update(out)
    for item in out.chunks:
        if item.samples:
            item.seq.append_token(TOKEN)
            if item.seq.num_output_tokens >= item.seq.sampling_params.max_tokens:
                sched.finish(item.seq, SequenceStatus.FINISHED_LENGTH)
    return out


def finish_order(sched: Scheduler, seqs: list[Sequence]) -> list[str]:
    order = []
    for _ in range(500):
        if not sched.has_unfinished:
            break
        step(sched)
        order += [s.request_id for s in seqs if s.is_finished and s.request_id not in order]
    assert not sched.has_unfinished and sched.block_manager.num_used_blocks == 0
    return order


@pytest.mark.parametrize("ordering, expected", [("priority", ["high", "mid", "low"]),
                                                ("fcfs", ["low", "mid", "high"])])
def test_admission_follows_the_policy(ordering, expected):
    sched = make(SchedulingPolicy(ordering), max_seqs=1)
    seqs = [seq("low", 8, 5, arrival=1), seq("mid", 8, 1, arrival=2), seq("high", 8, -3,
                                                                         arrival=3)]
    for s in seqs:
        sched.add(s)
    assert finish_order(sched, seqs) == expected


def test_ties_keep_arrival_order():
    sched = make(SchedulingPolicy("priority"), max_seqs=1)
    seqs = [seq(f"r{i}", 6, 2, arrival=i) for i in range(4)]
    for s in reversed(seqs):  # queued in reverse: arrival still decides
        sched.add(s)
    assert finish_order(sched, seqs) == ["r0", "r1", "r2", "r3"]


def test_a_long_low_priority_prefill_yields_to_a_short_high_priority_one():
    sched = make(PrefillOnlyPolicy("priority"), budget=8)
    long = seq("long", 64, priority=5, max_tokens=1)
    sched.add(long)
    step(sched)  # long is running, mid-prompt
    short = seq("short", 6, priority=0, max_tokens=1, arrival=1)
    sched.add(short)
    out = sched.schedule()
    assert out.chunks[0].seq is short and out.chunks[0].samples  # whole prompt first
    sched.update(out)
    for s in (short, long):
        sched.abort(s.request_id)
    assert sched.block_manager.num_used_blocks == 0


def test_fcfs_lets_the_running_prefill_keep_its_chunk():
    sched = make(PrefillOnlyPolicy("fcfs"), budget=8)
    long = seq("long", 64, priority=5, max_tokens=1)
    sched.add(long)
    step(sched)
    sched.add(seq("short", 6, priority=0, max_tokens=1, arrival=1))
    out = sched.schedule()
    assert out.chunks[0].seq is long and out.num_batched_tokens == 8
    sched.update(out)
    for request_id in ("long", "short"):
        sched.abort(request_id)
    assert sched.block_manager.num_used_blocks == 0


def test_the_lowest_priority_running_request_is_bounced_on_a_decode_worker():
    sched = make(DecodePolicy("priority"), num_blocks=7)
    seqs = []
    for i, priority in enumerate([0, 9, 1]):  # 9 is the victim though not the newest
        s = seq(f"r{i}", 7, priority, max_tokens=8, arrival=i)
        sched.block_manager.allocate(s, s.num_tokens)
        s.num_computed_tokens = s.num_tokens - 1
        sched.add_running(s)
        seqs.append(s)
    bounced = []
    while sched.has_unfinished:
        bounced += step(sched).bounced
    assert [s.request_id for s in bounced][:1] == ["r1"]
    assert sched.num_bounces == len(bounced) and sched.block_manager.num_used_blocks == 0
    assert all(s.output_token_ids == [TOKEN] * 8 for s in seqs if s not in bounced)


def test_unknown_policy_is_a_value_error():
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulingPolicy("lifo")
