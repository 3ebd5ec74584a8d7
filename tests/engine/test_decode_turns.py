"""``Scheduler.max_decode_rows``: where a decode step of up to that many sequences runs as one
fused call (far faster a token than the unfused forward a step of more takes), at most that
many sequences decode a step and the running ones take turns, those that waited the most
steps first; None (no fused call: other devices, LoRA, speculation) decodes every one."""

from __future__ import annotations

import math

import pytest

from pdserve import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache.block_manager import BlockManager
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parts import EngineParts
from pdserve.engine.sequence import SequenceStatus
from pdserve.engine.step.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.step.scheduling_policy import SchedulingPolicy
from pdserve.kernels import cpu_decode_layers

from .test_admission_hold import prompt, run_all, step
from .test_scheduler import req


def make(cap: int | None) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256)
    sched = Scheduler(config, BlockManager(128, 4, True, None), SchedulingPolicy())
    sched.max_decode_rows = cap
    return sched


def decoded(out) -> list[str]:
    return [seq.request_id for seq in out.decodes] + [
        item.seq.request_id for item in out.chunks if item.num_new_tokens == 1]


@pytest.mark.parametrize("num_seqs, cap", [(10, 4), (7, 3), (5, 4), (9, 2)])
def test_decodes_take_turns_and_none_waits_longer_than_its_round(num_seqs, cap):
    sched = make(cap)
    seqs = [req(f"r{i}", prompt(f"r{i}", 5), max_tokens=12) for i in range(num_seqs)]
    for seq in seqs:
        sched.add(seq)
    step(sched)  # every prompt in one step
    waited = {seq.request_id: 0 for seq in seqs}
    most_waited = 0
    while sched.has_unfinished:
        running = {s.request_id for s in sched.running}
        out = step(sched)
        turn = decoded(out)
        assert len(turn) == min(cap, len(running)), "every step decodes as many as it may"
        for name in running:
            waited[name] = 0 if name in turn else waited[name] + 1
            most_waited = max(most_waited, waited[name])
    assert most_waited <= math.ceil(num_seqs / cap) - 1
    assert all(seq.status == SequenceStatus.FINISHED_LENGTH and seq.num_output_tokens == 12
               for seq in seqs)
    assert sched.block_manager.num_used_blocks == 0


def test_without_a_cap_every_running_sequence_decodes_every_step():
    sched = make(None)
    seqs = [req(f"r{i}", prompt(f"r{i}", 5), max_tokens=6) for i in range(10)]
    for seq in seqs:
        sched.add(seq)
    outs = run_all(sched)
    assert [len(decoded(out)) for out in outs[1:]] == [10] * 5


def test_a_step_with_a_prompt_takes_every_decode():
    """A prompt's step runs the unfused forward whatever its decodes: all of them go."""
    sched = make(2)
    early = [req(f"a{i}", prompt(f"a{i}", 5), max_tokens=8) for i in range(4)]
    for seq in early:
        sched.add(seq)
    step(sched)
    assert len(decoded(step(sched))) == 2  # decodes alone: two a turn
    late = req("late", prompt("l", 6), max_tokens=3)
    sched.add(late)
    out = step(sched)  # the newcomer's prompt goes beside every decode
    assert any(item.seq is late and item.num_new_tokens == 6 for item in out.chunks)
    assert len(decoded(out)) == 4
    assert len(decoded(step(sched))) == 2  # decodes alone again
    run_all(sched)
    assert all(s.status == SequenceStatus.FINISHED_LENGTH for s in [*early, late])


def test_the_engine_takes_turns_where_the_decode_fuses_with_the_same_tokens(tiny_dir):
    """A float32 CPU engine caps decodes at the fused call's rows; greedy tokens are those of
    an engine that decodes every sequence every step."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    results = {}
    for cap in ("fused", None):
        engine = LLMEngine(EngineParts.build(EngineConfig(model=str(tiny_dir))))
        rows = engine.scheduler.max_decode_rows
        if cap is None:
            engine.scheduler.max_decode_rows = None
        elif rows is None:
            pytest.skip("no fused decode on this machine (the C kernels did not build)")
        else:
            assert rows == cpu_decode_layers.MAX_ROWS[engine.parts.runner.model.dtype]
        num_seqs = 2 * cpu_decode_layers.MAX_ROWS[engine.parts.runner.model.dtype] + 3
        for i in range(num_seqs):
            engine.add_request(f"r{i}", [5 + i % 50, 6 + i % 7, 7, 8, 9], params)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(num_seqs)}
        widest = 0
        while engine.has_unfinished_requests():
            for delta in engine.render(engine.step()):
                tokens[delta.request_id] += delta.new_token_ids
            if engine.last_step.num_tokens == engine.last_step.num_seqs:  # a pure decode step
                widest = max(widest, engine.last_step.num_seqs)
        results[cap] = tokens
        assert widest == (rows if cap == "fused" else num_seqs)
    assert results["fused"] == results[None]
    assert all(len(t) == 6 for t in results[None].values())


@pytest.mark.parametrize("settings", [
    {"enable_lora": True},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                            "prompt_lookup_max": 2, "prompt_lookup_min": 1}}])
def test_lora_and_speculation_keep_every_decode_every_step(tiny_dir, settings):
    engine = LLMEngine(EngineParts.build(EngineConfig(model=str(tiny_dir), **settings)))
    assert engine.scheduler.max_decode_rows is None
