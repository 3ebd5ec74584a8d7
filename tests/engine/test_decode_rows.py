"""The persistent decode rows (engine/step/decode_rows.py) equal a batch rebuilt every step.

Random traffic (arrivals, aborts, finishes, and preemptions from a pool too small for the
load) runs on two engines: one whose decodes run on the persistent rows, one whose every
sequence is a chunk rebuilt every step. The requests mix what the rows treat
differently: greedy and seeded sampling, EOS on and off, stop strings, stop token ids,
logprobs, penalties, max_tokens. Every step's tensors and every request's rendered deltas
(tokens, text, finish reason, logprobs, counters) must be equal, and no block may leak.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parts import EngineParts
from pdserve.engine.sampling.sampler import SamplingBatch, sampling_row
from pdserve.engine.step import decode_rows
from pdserve.engine.step.model_runner import ModelInput
from pdserve.engine.step.scheduling_policy import DecodePolicy
from pdserve.testing import general_steps
from pdserve.worker_api import NoRoomNow, WorkRequest
from pdserve.worker_api.sampling_params import SamplingParams


def _engine(tiny_dir, rebuild: bool) -> LLMEngine:
    parts = EngineParts.build(EngineConfig(model=str(tiny_dir), block_size=4, num_kv_blocks=24,
                                           max_num_seqs=12, max_num_batched_tokens=64,
                                           enable_prefix_caching=True))
    return general_steps.engine(parts, rows=not rebuild)


def _params(rng: random.Random) -> SamplingParams:
    """Mostly plain greedy (the rows' vectorised path), the rest each kind of exception."""
    kind = rng.choice(["greedy"] * 4 + ["sampled", "eos", "stop", "stop_ids", "logprobs",
                                        "penalty"])
    extra = {"sampled": dict(temperature=rng.choice([0.5, 0.9, 1.3]),
                             top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 5]),
                             min_p=rng.choice([0.0, 0.1]), seed=rng.randrange(-2**63, 2**63)),
             "eos": dict(ignore_eos=False),
             "stop": dict(stop=["e"]),
             "stop_ids": dict(stop_token_ids=[rng.randrange(1, 480) for _ in range(20)]),
             "logprobs": dict(logprobs=2),
             "penalty": dict(repetition_penalty=1.3)}.get(kind, {})
    return SamplingParams(**{"max_tokens": rng.randrange(1, 40), "temperature": 0.0,
                             "ignore_eos": True, **extra})


def _traffic(rng: random.Random, num_steps: int) -> list[list[tuple]]:
    """Per step, the events before it: ("add", id, prompt, params) or ("abort", id)."""
    events, live = [], []
    for step in range(num_steps):
        now = []
        if rng.random() < 0.6:
            request_id = f"r{step}"
            prompt = [rng.randrange(1, 200) for _ in range(rng.randrange(1, 14))]
            now.append(("add", request_id, prompt, _params(rng)))
            live.append(request_id)
        if live and rng.random() < 0.08:
            now.append(("abort", live.pop(rng.randrange(len(live)))))
        events.append(now)
    return events


def _content(delta) -> tuple:
    """A delta less its timings (which differ between two runs)."""
    return (delta.new_token_ids, delta.text, delta.finish_reason, delta.logprobs,
            delta.num_prompt_tokens, delta.num_output_tokens, delta.error, delta.attempt,
            delta.preempted)


def _run(engine: LLMEngine, events, batches: list | None) -> dict[str, list]:
    """Every request's rendered deltas (less timings), in order."""
    deltas: dict[str, list] = {}
    runner = engine.parts.runner
    run = runner.run

    def recording(batch, after_layer=None):
        if batches is not None:  # a copy: the rows' batch is rewritten by the next step
            batches.append(_snapshot(batch))
        return run(batch, after_layer)

    runner.run = recording
    for now in events:
        for event in now:
            if event[0] == "add":
                _, request_id, prompt, params = event
                engine.add_request(request_id, prompt, params)
                deltas[request_id] = []
            else:
                engine.abort(event[1])
        for delta in engine.render(engine.step()):
            deltas[delta.request_id].append(_content(delta))
    while engine.has_unfinished_requests():
        for delta in engine.render(engine.step()):
            deltas[delta.request_id].append(_content(delta))
    return deltas


def _snapshot(batch: ModelInput) -> ModelInput:
    """``batch`` with its tensors copied."""
    def copied(obj):
        return dataclasses.replace(obj, **{f.name: getattr(obj, f.name).clone()
                                           for f in dataclasses.fields(obj)
                                           if isinstance(getattr(obj, f.name), torch.Tensor)})
    return dataclasses.replace(copied(batch), metadata=copied(batch.metadata))


def _same_batch(a, b, window: int | None = None) -> None:
    """Equal tensors; of the block tables, the entries the kernels read (with a ``window``,
    the blocks holding its keys: a freed entry is 0 in one and the old id in the other)."""
    for name in ("input_ids", "positions", "sample_indices"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    ma, mb = a.metadata, b.metadata
    for name in ("slot_mapping", "cu_seqlens_q", "context_lens"):
        assert torch.equal(getattr(ma, name).long(), getattr(mb, name).long()), name
    width = ma.block_tables.shape[1]  # the persistent table may be wider: the rest is unread
    blocks_needed = -(-mb.context_lens.long() // 4)
    for row in range(mb.block_tables.shape[0]):
        n = int(blocks_needed[row])
        first = 0 if window is None else max(0, int(mb.context_lens[row]) - window) // 4
        assert n <= width
        assert torch.equal(ma.block_tables[row, first:n].long(),
                           mb.block_tables[row, first:n].long())
    assert (ma.max_query_len, ma.max_context_len) == (mb.max_query_len, mb.max_context_len)
    assert (a.num_attended, a.num_context) == (b.num_attended, b.num_context)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_traffic_gives_the_same_batches_and_tokens_as_rebuilding(tiny_dir, seed):
    _assert_same_as_rebuilding(tiny_dir, _traffic(random.Random(seed), 90))


@pytest.mark.parametrize("few_rows", [0, 1000])
def test_array_ops_and_per_row_writes_for_rows_entering_blocks_each_match_rebuilding(
        tiny_dir, monkeypatch, few_rows):
    """The rows that enter a block in a step get their slots and blocks by array ops, or one
    at a time when they are few (``FEW_ROWS``): each way alone gives the rebuilt batches."""
    monkeypatch.setattr(decode_rows, "FEW_ROWS", few_rows)
    _assert_same_as_rebuilding(tiny_dir, _traffic(random.Random(3), 90))


def test_random_traffic_with_a_sliding_window_gives_the_same_batches_and_tokens(hf_checkpoint):
    """A window of 8 frees blocks under the rows (their tables keep the freed ids, which the
    kernels never read): the same batches where the kernels read, the same tokens."""
    fast = _assert_same_as_rebuilding(hf_checkpoint("mistral"), _traffic(random.Random(4), 90),
                                      window=8, watch=_count_window_frees)
    assert fast.window_frees > 5  # rows steps freed blocks that left the window


def _count_window_frees(engine: LLMEngine) -> None:
    """Count the blocks freed for leaving the window in rows steps (``engine.window_frees``)."""
    rows, bm, scheduler = engine.parts.runner.rows, engine.parts.block_manager, engine.scheduler
    engine.window_frees = 0
    update = scheduler.update

    def counted(output) -> None:
        used = bm.num_used_blocks
        update(output)
        if output.decodes:
            engine.window_frees += used - bm.num_used_blocks

    scheduler.update = counted
    assert bm.sliding_window == rows.window == 8


def _assert_same_as_rebuilding(model_dir, events, window: int | None = None,
                               watch=None) -> LLMEngine:
    """``watch(fast)`` runs before the traffic; returns the engine with the rows."""
    fast, rebuilt = _engine(model_dir, rebuild=False), _engine(model_dir, rebuild=True)
    rows_steps = _count_rows_steps(fast)
    if watch is not None:
        watch(fast)
    fast_batches, rebuilt_batches = [], []
    fast_deltas = _run(fast, events, fast_batches)
    assert fast_deltas == _run(rebuilt, events, rebuilt_batches)
    assert len(fast_batches) == len(rebuilt_batches)
    for a, b in zip(fast_batches, rebuilt_batches, strict=True):
        _same_batch(a, b, window)
    assert fast.scheduler.num_preemptions > 0  # the pool was short: preemption happened
    assert sum(len(d[0]) for ds in fast_deltas.values() for d in ds) > 100
    assert len(rows_steps) >= 20 and len(set(rows_steps)) >= 3  # the rows served steps of
    # several batch sizes (rows joined and left between them)
    assert fast.mixed_steps >= 5  # and steps whose decodes ran beside chunks
    finishes = {ds[-1][2] for ds in fast_deltas.values() if ds}  # (aborts: none)
    assert {"stop", "length"} <= finishes
    for engine in (fast, rebuilt):
        bm = engine.parts.block_manager
        assert bm.num_used_blocks == 0
        bm.check_invariants()
    return fast


def _count_rows_steps(engine: LLMEngine) -> list[int]:
    """The batch sizes of the steps of decodes alone, as they happen; the steps with decodes
    and chunks are counted in ``engine.mixed_steps``."""
    sizes: list[int] = []
    runner = engine.parts.runner
    prepare = runner.prepare
    engine.mixed_steps = 0

    def counted(output):
        batch = prepare(output)
        assert len(runner.rows) == len(output.decodes)
        if output.decodes and output.chunks:
            engine.mixed_steps += 1
        elif output.decodes:
            sizes.append(len(runner.rows))
        return batch

    runner.prepare = counted
    return sizes


def test_the_rows_keep_the_sampling_batch_of_their_sequences(tiny_dir):
    """The parameters, seed keys and positions the rows hand the sampler (kept in their
    state across syncs, appends and drops) are those built from the sequences."""
    engine, rng = _engine(tiny_dir, rebuild=False), random.Random(5)
    rows, checked = engine.parts.runner.rows, []
    sampling_batch = rows.sampling_batch

    def checking(penalized=None):
        batch = sampling_batch(penalized)
        expected = SamplingBatch.of(list(map(sampling_row, rows.seqs)))
        for name in ("floats", "top_k", "logprobs", "seed_keys", "positions"):
            got, want = getattr(batch, name), getattr(expected, name)
            assert got.dtype == want.dtype and np.array_equal(got, want), name
        assert (batch.penalized is None) == (expected.penalized is None)
        checked.append(len(batch))
        return batch

    rows.sampling_batch = checking
    for step in range(100):
        if step < 80 and rng.random() < 0.5:
            params = _params(rng)
            params.ignore_eos = rng.random() < 0.5
            engine.add_request(f"r{step}", [rng.randrange(1, 200) for _ in range(5)], params)
        engine.render(engine.step())
    while engine.has_unfinished_requests():
        engine.render(engine.step())
    assert len(checked) > 20 and max(checked) > 3  # the check ran, on batches of several rows
    assert engine.parts.block_manager.num_used_blocks == 0


def test_the_rows_serve_pure_decode_steps(tiny_dir):
    """Guards the test above: the persistent rows are what runs when every sequence decodes,
    through finishes, and the compact deltas render to one delta per request."""
    engine = _engine(tiny_dir, rebuild=False)
    sizes = _count_rows_steps(engine)
    rows, syncs = engine.parts.runner.rows, []
    sync = rows.sync
    rows.sync = lambda seqs, version=-1: syncs.append(len(seqs)) or sync(seqs, version)
    for i in range(3):
        engine.add_request(f"d{i}", [5, 6, 7 + i], SamplingParams(max_tokens=6 + i,
                                                                   temperature=0.0,
                                                                   ignore_eos=True))
    outputs: dict[str, list[int]] = {f"d{i}": [] for i in range(3)}
    while engine.has_unfinished_requests():
        for delta in engine.render(engine.step()):
            outputs[delta.request_id] += delta.new_token_ids
    # one prefill step, then pure decode steps on the rows as requests finish one by one
    assert sizes == [3] * 5 + [2, 1]
    assert syncs == [3]  # a row that finished was dropped in its step: no sync after it
    assert [len(outputs[f"d{i}"]) for i in range(3)] == [6, 7, 8]


def test_a_decode_that_must_preempt_leaves_the_rows_for_the_general_step(tiny_dir):
    """When a row needs a block and none is free, the general schedule preempts; the tokens
    equal the reference engine's (the random traffic test covers this too, by chance)."""
    def run(rebuild: bool) -> dict[str, list[int]]:
        parts = EngineParts.build(EngineConfig(model=str(tiny_dir), block_size=4,
                                               num_kv_blocks=6, max_num_seqs=4))
        engine = general_steps.engine(parts, rows=not rebuild)
        for i in range(3):
            engine.add_request(f"p{i}", [3 + i, 4, 5], SamplingParams(
                max_tokens=9, temperature=0.0, ignore_eos=True))
        out: dict[str, list[int]] = {f"p{i}": [] for i in range(3)}
        while engine.has_unfinished_requests():
            for delta in engine.render(engine.step()):
                out[delta.request_id] += delta.new_token_ids
        assert engine.scheduler.num_preemptions > 0
        assert parts.block_manager.num_used_blocks == 0
        return out

    assert run(rebuild=False) == run(rebuild=True)


def _decode_engine(tiny_dir, rows_on: bool) -> LLMEngine:
    parts = EngineParts.build(EngineConfig(model=str(tiny_dir), block_size=4, num_kv_blocks=40,
                                           max_num_seqs=12))
    return general_steps.engine(parts, rows=rows_on, policy=DecodePolicy())


def _decode_traffic(engine: LLMEngine, seed: int, batches: list) -> dict[str, list]:
    """A decode worker's life: requests join with their KV reserved and token 0 sampled
    elsewhere (``start_running``), finish, get aborted; every delta's content, in order."""
    rng = random.Random(seed)
    out: dict[str, list] = {}
    run = engine.parts.runner.run
    engine.parts.runner.run = lambda batch, after_layer=None: (
        batches.append(_snapshot(batch)) or run(batch, after_layer))
    engine.used_blocks = []  # the blocks held after each step
    for step in range(70):
        if step < 50 and rng.random() < 0.5:
            request_id = f"j{step}"
            request = WorkRequest(request_id, [rng.randrange(1, 200) for _ in range(
                rng.randrange(1, 12))], _params(rng), seed=step, arrival_time=0.0)
            seq = engine.sequence_for(request)
            try:
                engine.reserve_blocks(seq)
            except NoRoomNow:
                continue
            out[request_id] = [_content(engine.start_running(seq, rng.randrange(1, 200)))]
        live = [r for r in out if engine.scheduler.get(r) is not None]
        if live and rng.random() < 0.05:
            engine.abort(rng.choice(live))
        for delta in engine.render(engine.step()):
            out[delta.request_id].append(_content(delta))
        engine.used_blocks.append(engine.parts.block_manager.num_used_blocks)
    while engine.has_unfinished_requests():
        for delta in engine.render(engine.step()):
            out[delta.request_id].append(_content(delta))
    return out


@pytest.mark.parametrize("seed,model", [(0, "tiny"), (1, "tiny"), (2, "mistral")])
def test_decode_worker_joins_and_finishes_give_the_same_batches_and_deltas(
        tiny_dir, hf_checkpoint, seed, model):
    """Also with a sliding window of 8 (``mistral``): prompts longer than it join with blocks
    already out of the window, which must be freed in the same step as without the rows."""
    model_dir, window = (tiny_dir, None) if model == "tiny" else (hf_checkpoint(model), 8)
    rows_engine, reference = _decode_engine(model_dir, True), _decode_engine(model_dir, False)
    syncs: list[int] = []
    rows = rows_engine.parts.runner.rows
    sync, old_rows = rows.sync, rows._old_rows
    rows.sync = lambda seqs, version=-1: syncs.append(len(seqs)) or sync(seqs, version)
    mapped: list[int] = []  # syncs that mapped every sequence to its row (not an append)
    rows._old_rows = lambda seqs, tables: mapped.append(len(seqs)) or old_rows(seqs, tables)
    rows_batches, reference_batches = [], []
    got = _decode_traffic(rows_engine, seed, rows_batches)
    assert got == _decode_traffic(reference, seed, reference_batches)
    assert rows_engine.used_blocks == reference.used_blocks  # the same blocks held, step by step
    assert len(rows_batches) == len(reference_batches) > 40
    for a, b in zip(rows_batches, reference_batches, strict=True):
        _same_batch(a, b, window)
    assert mapped and len(syncs) > len(mapped)  # joins took the append path, aborts not
    assert {"stop", "length"} <= {d[-1][2] for d in got.values()}
    for engine in (rows_engine, reference):
        assert engine.parts.block_manager.num_used_blocks == 0
        engine.parts.block_manager.check_invariants()


def test_a_full_house_with_a_queue_still_decodes_on_the_rows(tiny_dir):
    """Every seat taken and requests waiting: no admission can happen, so the step is a pure
    decode step on the rows; the queue is admitted as seats free up, as the general path does."""
    def run(rows_on: bool) -> tuple[dict[str, list], list[int]]:
        parts = EngineParts.build(EngineConfig(model=str(tiny_dir), block_size=4,
                                               num_kv_blocks=64, max_num_seqs=2))
        engine = general_steps.engine(parts, rows=rows_on)
        queued = []  # requests waiting at each step on the rows
        schedule = engine.scheduler.schedule

        def schedule_noting_the_queue():
            output = schedule()
            if output.decodes and not output.chunks:
                queued.append(len(engine.scheduler.waiting))
            return output
        engine.scheduler.schedule = schedule_noting_the_queue
        out: dict[str, list] = {}
        for i in range(5):
            engine.add_request(f"q{i}", [4 + i, 5, 6], SamplingParams(
                max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True))
            out[f"q{i}"] = []
        while engine.has_unfinished_requests():
            for delta in engine.render(engine.step()):
                out[delta.request_id].append(_content(delta))
        return out, queued

    got, queued = run(True)
    assert got == run(False)[0]
    assert sum(1 for n in queued if n > 0) >= 5  # decodes with a queue waiting ran on the rows
