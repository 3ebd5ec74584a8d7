"""The persistent decode batch (engine/input_batch.py) equals a batch rebuilt every step.

Random traffic (arrivals, aborts, finishes, and preemptions from a pool too small for the
load) runs on two engines: one whose runner takes the persistent fast path for pure decode
steps, one that rebuilds every batch with the general path. Every step's tensors and every
request's tokens must be equal, and no block may leak.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parts import EngineParts
from pdserve.engine.sampling_params import SamplingParams


def _engine(tiny_dir, rebuild: bool) -> LLMEngine:
    parts = EngineParts.build(EngineConfig(model=str(tiny_dir), block_size=4, num_kv_blocks=24,
                                           max_num_seqs=12, max_num_batched_tokens=64,
                                           enable_prefix_caching=True))
    engine = LLMEngine(parts)
    if rebuild:
        runner = parts.runner
        runner.prepare = runner._prepare_general  # the reference: no persistent state
    return engine


def _traffic(rng: random.Random, num_steps: int) -> list[list[tuple]]:
    """Per step, the events before it: ("add", id, prompt, max_tokens) or ("abort", id)."""
    events, live = [], []
    for step in range(num_steps):
        now = []
        if rng.random() < 0.6:
            request_id = f"r{step}"
            prompt = [rng.randrange(1, 200) for _ in range(rng.randrange(1, 14))]
            now.append(("add", request_id, prompt, rng.randrange(1, 40)))
            live.append(request_id)
        if live and rng.random() < 0.08:
            now.append(("abort", live.pop(rng.randrange(len(live)))))
        events.append(now)
    return events


def _run(engine: LLMEngine, events, batches: list | None) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    runner = engine.parts.runner
    prepare = runner.prepare

    def recording(scheduled):
        batch = prepare(scheduled)
        if batches is not None:
            batches.append(batch)
        return batch

    runner.prepare = recording
    for now in events:
        for event in now:
            if event[0] == "add":
                _, request_id, prompt, max_tokens = event
                engine.add_request(request_id, prompt, SamplingParams(
                    max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
                tokens[request_id] = []
            else:
                engine.abort(event[1])
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
    return tokens


def _same_batch(a, b) -> None:
    for name in ("input_ids", "positions", "sample_indices"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    ma, mb = a.metadata, b.metadata
    for name in ("slot_mapping", "cu_seqlens_q", "context_lens"):
        assert torch.equal(getattr(ma, name).long(), getattr(mb, name).long()), name
    width = ma.block_tables.shape[1]  # the persistent table may be wider: the rest is unread
    blocks_needed = -(-mb.context_lens.long() // 4)
    for row in range(mb.block_tables.shape[0]):
        n = int(blocks_needed[row])
        assert n <= width
        assert torch.equal(ma.block_tables[row, :n].long(), mb.block_tables[row, :n].long())
    assert (ma.max_query_len, ma.max_context_len) == (mb.max_query_len, mb.max_context_len)
    assert (a.num_attended, a.num_context) == (b.num_attended, b.num_context)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_traffic_gives_the_same_batches_and_tokens_as_rebuilding(tiny_dir, seed):
    events = _traffic(random.Random(seed), 90)
    fast, rebuilt = _engine(tiny_dir, rebuild=False), _engine(tiny_dir, rebuild=True)
    fast_batches, rebuilt_batches = [], []
    fast_tokens = _run(fast, events, fast_batches)
    assert fast_tokens == _run(rebuilt, events, rebuilt_batches)
    assert len(fast_batches) == len(rebuilt_batches)
    for a, b in zip(fast_batches, rebuilt_batches, strict=True):
        _same_batch(a, b)
    assert fast.scheduler.num_preemptions > 0  # the pool was short: preemption happened
    assert sum(len(t) for t in fast_tokens.values()) > 100
    for engine in (fast, rebuilt):
        bm = engine.parts.block_manager
        assert bm.num_used_blocks == 0
        bm.check_invariants()


def test_the_fast_path_serves_pure_decode_steps(tiny_dir):
    """Guards the test above: the persistent batch is what runs when every sequence decodes."""
    engine = _engine(tiny_dir, rebuild=False)
    calls = []
    fast = engine.parts.runner._prepare_decodes
    engine.parts.runner._prepare_decodes = lambda seqs: calls.append(len(seqs)) or fast(seqs)
    for i in range(3):
        engine.add_request(f"d{i}", [5, 6, 7 + i], SamplingParams(max_tokens=6, temperature=0.0,
                                                                   ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert calls == [3] * 5  # one prefill step, then five pure decode steps
