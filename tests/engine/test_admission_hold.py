"""``SchedulerConfig.admission_hold_s``: while sequences decode, a newly arrived prompt waits
(up to the hold, from its arrival) so that prompts arriving close together prefill in one
step and the decodes run without prefills between them; it goes at once when nothing decodes,
when the waiting prompts fill a step, or with the hold at 0 (the default)."""

from __future__ import annotations

import math
import time

import pytest

from pdserve import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache.block_manager import BlockManager
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parts import EngineParts
from pdserve.engine.sequence import SequenceStatus
from pdserve.engine.step.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.step.scheduling_policy import SchedulingPolicy
from pdserve.testing.general_steps import general_steps

from .test_scheduler import TOKEN, req


def make(hold_s: float, budget: int = 32, pure: bool = False) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256,
                             admission_hold_s=hold_s)
    return Scheduler(config, BlockManager(64, 4, True, None),
                     SchedulingPolicy() if pure else general_steps())


def step(sched: Scheduler):
    """One engine step, pure decode steps included: schedule, update, sample TOKEN, finish
    on max_tokens."""
    out = sched.schedule()
    sched.update(out)
    sampled = [*out.decodes, *(item.seq for item in out.chunks if item.samples)]
    for seq in sampled:
        seq.append_token(TOKEN)
        if seq.num_output_tokens >= seq.sampling_params.max_tokens:
            sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    sched.block_manager.check_invariants()
    return out


def run_all(sched: Scheduler) -> list:
    outs = []
    while sched.has_unfinished:
        outs.append(step(sched))
        assert len(outs) < 500, "no progress"
    return outs


def prompt(tag: str, n: int) -> list[int]:
    """n tokens no other prompt of a test shares (no prefix-cache hits between them)."""
    base = 100 * (1 + ord(tag[0]) % 50) + 10 * (int(tag[1:]) if tag[1:] else 0)
    return list(range(base, base + n))


def ids(out) -> list[tuple[str, int]]:
    return ([(s.request_id, 1) for s in out.decodes]
            + [(i.seq.request_id, i.num_new_tokens) for i in out.chunks])


def decoding(sched: Scheduler, names: str = "abc", max_tokens: int = 20) -> list:
    """Sequences named by ``names``' letters, each decoding after a 6-token prompt."""
    seqs = [req(name, prompt(name, 6), max_tokens=max_tokens) for name in names]
    for seq in seqs:
        sched.add(seq)
    # alone: admitted at once, whatever the hold
    assert ids(step(sched)) == [(name, 6) for name in names]
    return seqs


@pytest.mark.parametrize("pure", [False, True])
def test_a_prompt_waits_while_others_decode_until_its_hold_runs_out(pure):
    sched = make(hold_s=60.0, pure=pure)
    decoders = decoding(sched)
    p = req("p", prompt("p", 5))
    sched.add(p)
    for _ in range(3):  # decode steps without p's prefill (pure ones where they are on)
        out = step(sched)
        assert ids(out) == [("a", 1), ("b", 1), ("c", 1)]
        assert (out.decodes_version >= 0) == pure  # a steady step, on the rows
    assert p.status == SequenceStatus.WAITING and p.first_scheduled_time is None
    p.arrival_time = time.monotonic() - 60.0  # its hold has run out
    assert ids(step(sched)) == [("a", 1), ("b", 1), ("c", 1), ("p", 5)]
    run_all(sched)
    assert all(s.status == SequenceStatus.FINISHED_LENGTH for s in [*decoders, p])


def test_prompts_held_together_prefill_in_one_step_when_the_decodes_end():
    sched = make(hold_s=60.0)
    decoding(sched, max_tokens=3)
    for name in ("p1", "p2"):
        sched.add(req(name, prompt(name, 5)))
    outs = run_all(sched)
    admitted = next(i for i, out in enumerate(outs) if ("p1", 5) in ids(out))
    assert ids(outs[admitted]) == [("p1", 5), ("p2", 5)]  # the decoders had finished
    assert all(("a", 1) in ids(out) for out in outs[:admitted])


def test_as_many_waiting_as_decoding_go_at_once():
    sched = make(hold_s=60.0)
    decoding(sched, "ab")
    sched.add(req("p1", prompt("p1", 5)))
    assert ids(step(sched)) == [("a", 1), ("b", 1)]  # one prompt, two decodes: held
    sched.add(req("p2", prompt("p2", 5)))
    assert ids(step(sched)) == [("a", 1), ("b", 1), ("p1", 5), ("p2", 5)]
    run_all(sched)


def test_a_prompt_goes_at_once_when_nothing_decodes():
    sched = make(hold_s=60.0, budget=16)
    long = req("long", prompt("l", 20))  # a prefill in chunks: running, but not decoding
    sched.add(long)
    step(sched)
    short = req("short", prompt("s", 3))
    sched.add(short)
    assert ("short", 3) in ids(step(sched))
    run_all(sched)


def test_waiting_prompts_that_fill_a_step_go_at_once():
    sched = make(hold_s=60.0, budget=32)
    decoding(sched)
    sched.add(req("p1", prompt("p1", 24)))
    assert ids(step(sched)) == [("a", 1), ("b", 1), ("c", 1)]  # 24 tokens wait: less than 32
    sched.add(req("p2", prompt("p2", 8)))  # 32 waiting: the next step is full anyway
    assert ids(step(sched)) == [("a", 1), ("b", 1), ("c", 1), ("p1", 24), ("p2", 5)]
    run_all(sched)


def test_no_hold_admits_at_once():
    sched = make(hold_s=0.0)
    decoding(sched)
    sched.add(req("p", prompt("p", 5)))
    assert ids(step(sched)) == [("a", 1), ("b", 1), ("c", 1), ("p", 5)]
    run_all(sched)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "1", True, None])
def test_a_bad_hold_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="admission_hold_s"):
        SchedulerConfig(max_model_len=64, admission_hold_s=bad)


def _serve_one_late(tiny_dir, hold_s: float) -> tuple[dict[str, list[int]], int]:
    """Three requests decode, a fourth arrives after their first token: every request's
    tokens, and how many tokens "a" had when the late one's first came."""
    engine = LLMEngine(EngineParts.build(EngineConfig(model=str(tiny_dir),
                                                      admission_hold_s=hold_s)))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {name: [] for name in ("a", "b", "c", "late")}
    for i, name in enumerate("abc"):
        engine.add_request(name, [5, 6, 7 + i], params)
    a_when_late_started, added = -1, False
    while engine.has_unfinished_requests():
        for delta in engine.render(engine.step()):
            if delta.request_id == "late" and not outputs["late"]:
                a_when_late_started = len(outputs["a"])
            outputs[delta.request_id] += delta.new_token_ids
        if outputs["a"] and not added:
            engine.add_request("late", [9, 10, 11, 12], params)
            added = True
    return outputs, a_when_late_started


def test_the_engine_holds_a_late_prompt_until_the_decodes_end_and_its_tokens_stay(tiny_dir):
    held, a_at_held = _serve_one_late(tiny_dir, hold_s=60.0)
    free, a_at_free = _serve_one_late(tiny_dir, hold_s=0.0)
    assert held == free and all(len(tokens) == 6 for tokens in held.values())
    assert a_at_free < 6 and a_at_held == 6  # held: prefilled once the three had finished
